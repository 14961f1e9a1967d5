"""The magics page says what the magics take: docs/notebooks/magics.md against their parsers.

The table under "## The magics" gives one synopsis per magic (``%dist_start [-n N] ...``). Each
magic's options come from its own ``magic_arguments`` parser (what ``%dist_start?`` prints),
loaded from ``hora.magics.HoraMagics``: a magic registered but not in the table (or the other
way round), an option the parser declares that the synopsis leaves out, an option the synopsis
shows that the parser lacks, or a positional argument on one side only fails. So does an
option named in a section about a magic (``### `%dist_start```: ``* `--ip ADDR`: ...``) that
none of the magics the heading names takes.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from hora.magics import HoraMagics

PAGE = Path(__file__).resolve().parents[2] / "docs" / "notebooks" / "magics.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
MAGIC = re.compile(r"(%%?[a-z_]+)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")


def _parser(prefix: str, name: str) -> argparse.ArgumentParser | None:
    """The parser of ``%name`` (prefix ``%``) or ``%%name`` (``%%``); None: it takes none.

    A magic that is both a line and a cell magic (``%%distributed``) parses its options in
    the cell form only: its line form runs the whole line as one statement
    (``HoraMagics.distributed`` with ``cell=None``).
    """
    kind = "cell" if prefix == "%%" else "line"
    method = HoraMagics.magics[kind][name]
    if kind == "line" and name in HoraMagics.magics["cell"]:
        return None
    return getattr(getattr(HoraMagics, method), "parser", None)


def _declared(prefix: str, name: str) -> tuple[list[list[str]], int]:
    """The magic's options (each its option strings) and how many positionals it takes."""
    parser = _parser(prefix, name)
    if parser is None:
        return [], 0
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    options = [list(a.option_strings) for a in actions if a.option_strings]
    return options, sum(1 for a in actions if not a.option_strings)


def _table() -> dict[str, str]:
    """``%name`` / ``%%name`` -> the synopsis after it, from the page's magics table."""
    text = PAGE.read_text().split("## The magics\n", 1)[1].split("\n#", 1)[0]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cell = re.match(r"\| `(%[^`]*)` \|", line)
        if cell:
            magic, _, rest = cell.group(1).replace("\\|", "|").partition(" ")
            rows[magic] = rest
    return rows


def _positionals(synopsis: str) -> int:
    """Groups of a synopsis that are no option: ``NAME ...``, ``[ID]``, ``STATEMENT``."""
    groups = re.findall(r"\[[^\]]*\]|[^\s\[\]]+", synopsis)
    count = 0
    for group in groups:
        if group.startswith("["):
            count += not OPTION.search(group)
        else:
            count += bool(PLACEHOLDER.match(group))
    return count


def _registered() -> set[str]:
    return {("%%" if kind == "cell" else "%") + name
            for kind, names in HoraMagics.magics.items() for name in names}


def test_the_table_lists_every_magic_and_only_them() -> None:
    assert set(_table()) == _registered()


@pytest.mark.parametrize("magic", sorted(_registered()))
def test_a_magics_synopsis_shows_exactly_its_parsers_options(magic: str) -> None:
    prefix, name = ("%%", magic[2:]) if magic.startswith("%%") else ("%", magic[1:])
    synopsis = _table()[magic]
    shown = set(OPTION.findall(synopsis))
    options, positionals = _declared(prefix, name)
    undocumented = [forms for forms in options if not shown & set(forms)]
    assert undocumented == [], f"{magic} takes {undocumented}, not in its synopsis"
    unknown = shown - {form for forms in options for form in forms}
    assert unknown == set(), f"{magic}'s synopsis shows {sorted(unknown)}, which it does not take"
    if name == "distributed" and prefix == "%":
        positionals = 1  # the statement: the whole line (see _parser)
    assert _positionals(synopsis) == positionals, f"{magic}: positional arguments differ"


def _sections() -> list[tuple[str, str]]:
    """(heading, body) of every section of the page."""
    parts = re.split(r"^(#{2,4} .*)$", PAGE.read_text(), flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_a_section_about_a_magic_names_only_options_it_takes() -> None:
    checked = 0
    for heading, body in _sections():
        magics = set(MAGIC.findall(heading)) & _registered()
        if not magics:
            continue
        takes = {form for magic in magics
                 for forms in _declared(*(("%%", magic[2:]) if magic.startswith("%%")
                                          else ("%", magic[1:])))[0]
                 for form in forms}
        # options are named in code that starts with one: `--ip ADDR`, `-n N`
        named = {option for span in re.findall(r"`([^`]+)`", body) if OPTION.match(span)
                 for option in OPTION.findall(span)}
        assert named <= takes, f"{heading!r} names {sorted(named - takes)}, not options of it"
        checked += len(named)
    assert checked >= 10  # the sections about %dist_start, %%distributed, ... were read
