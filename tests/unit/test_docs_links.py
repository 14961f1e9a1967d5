"""README.md stays one screen, and the README's and the manual's relative links all resolve.

Checks README.md (at most 100 lines, no path outside the repository) and every Markdown page
under docs/ (relative links point to files that exist inside the repository, and a link's
``#anchor`` to a heading that exists in its target, with GitHub's and MyST's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
# written by the build (docs/_ext/hora_reference.py), not committed: links there are relative
# to the page that includes them
GENERATED = {"_build", "generated", "examples"}
PAGES = sorted(p for p in DOCS.rglob("*.md") if not GENERATED & set(p.relative_to(DOCS).parts))

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _links(path: Path) -> list[str]:
    """Every relative Markdown link target in a file (no scheme, no pure ``#anchor``)."""
    targets = []
    for line in _prose(path.read_text(encoding="utf-8")):
        line = re.sub(r"``[^`]*``|`[^`]*`", "", line)  # code spans hold no links
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            targets.append(target)
    return targets


def slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor for a heading text.

    >>> slug("GPU binding, and why")
    'gpu-binding-and-why'
    >>> slug("`hora up`: everything in one command")
    'hora-up-everything-in-one-command'
    """
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file."""
    return {slug(m.group(2)) for line in _prose(path.read_text(encoding="utf-8"))
            if (m := _HEADING.match(line))}


def _problems(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in _links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: no heading with anchor #{anchor} in {file_part}")
    return problems


def test_readme_is_one_screen() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 100, f"README.md has {len(lines)} lines; move the rest into docs/"


def test_readme_keeps_the_two_set_up_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "scripts/install.sh && .venv/bin/hora up" in text
    assert "\nscripts/test.sh\n" in text


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_no_path_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "../shared" not in text
    assert not re.search(r"(?<![\w.])/work/", text), "names a path of the build machine"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert _problems(path) == []


def test_the_pages_exist() -> None:
    """The manual has the pages other pages and helpers write into."""
    names = {str(p.relative_to(DOCS)) for p in PAGES}
    assert {"index.md", "install.md", "quickstart.md", "run.md", "service/security.md",
            "elastic.md", "slurm.md", "dashboard.md"} <= names


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A heading\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [x](missing.md) [y](../outside.md)\n"
                    "[z](other.md#no-such-heading) `[c](in-code.md)`\n"
                    "```\n[w](fenced.md)\n```\n", encoding="utf-8")
    assert _problems(page, root=tmp_path) == [
        "missing.md: no such file",
        "../outside.md: outside the repository",
        "other.md#no-such-heading: no heading with anchor #no-such-heading in other.md",
    ]
