"""The magics page says what the magics take: docs/notebooks/magics.md against their parsers.

The table under "## The magics" gives one synopsis per magic (``%dist_start [-n N] ...``). Each
magic's options come from its own ``magic_arguments`` parser (what ``%dist_start?`` prints),
loaded from ``hora.magics.HoraMagics``: a magic registered but not in the table (or the other
way round), an option the parser declares that the synopsis leaves out, an option the synopsis
shows that the parser lacks, or a positional argument on one side only fails. So does an
option named in a section about a magic (``### `%dist_start```: ``* `--ip ADDR`: ...``) that
none of the magics the heading names takes.

The rest of the manual is held to the code the same way (the tests after the magics'): each
`hora` command line a page shows and its options against the command's argparse parser, each
``HORA_*`` variable against the settings and the code that reads it, each REST route against
the service's app (and docs/service/api.md against every ``/v1`` route), each settings table's
names and defaults against ``Settings``, each ``hora.*`` Python name against the import.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
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


# --- Every other page: commands, variables, routes, settings and Python names it shows ------
#
# The manual (docs/, less the reference pages, which are generated from the code) names
# `hora` commands with their options, HORA_* variables, REST routes, settings with their
# defaults and hora's Python names. Each test below holds one kind of name to the code that
# defines it, so a renamed option, setting, route or module fails here, not in a reader's hands.

DOCS = Path(__file__).resolve().parents[2] / "docs"
REPO = DOCS.parent
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _pages() -> list[Path]:
    """The hand-written pages: every docs/ page but the generated reference."""
    return sorted(p for p in DOCS.rglob("*.md")
                  if "reference" not in p.relative_to(DOCS).parts and "_build" not in p.parts)


def _code(text: str) -> list[str]:
    """The page's code: each inline span and each line of each fenced block."""
    spans = CODE_SPAN.findall(FENCE.sub("", text))
    return spans + [line for block in FENCE.findall(text) for line in block.splitlines()]


# `hora <command>` -> where its parser is built (hora.cli dispatches on the first word)
PARSERS = {"run": ("hora.launch.config", "make_parser"),
           "kernel": ("hora.engines.kernelspec", "build_parser"),
           "serve": ("hora_service.cli", "build_parser"),
           "user": ("hora_service.cli", "build_parser"),
           "up": ("hora_service.up", "build_parser"),
           "image": ("hora_service.images", "build_parser")}
COMMAND_LINE = re.compile(r"^\s*(?:\$\s+|!)?hora ([a-z][\w-]*)(?=\s|$)(.*)$")
# where a command's own options end: a comment, a pipe, the next command, `--`, the program
PAST_OPTIONS = re.compile(r"\s(?:#|\||&&|;|>|--(?:\s|$))|\s(?:python3?|\S+\.py)(?:\s|$)")


def _command_parser(command: str) -> argparse.ArgumentParser:
    module, function = PARSERS.get(command, ("hora.jobs_cli", "build_parser"))
    parser: argparse.ArgumentParser = getattr(importlib.import_module(module), function)()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and of its subcommands (``hora user add --quota``)."""
    found: set[str] = set()
    for action in parser._actions:
        found |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _command_lines() -> list[tuple[str, str, str]]:
    """(page, command, what follows it) for each `hora <command> ...` the pages show."""
    lines = []
    for page in _pages():
        for code in _code(page.read_text()):
            match = COMMAND_LINE.match(code)
            if match:
                rest = PAST_OPTIONS.split(match.group(2) + " ", maxsplit=1)[0]
                lines.append((page.relative_to(DOCS).as_posix(), match.group(1), rest))
    return lines


def test_every_hora_command_the_docs_show_exists_with_the_options_shown() -> None:
    from hora.cli import COMMANDS

    checked = 0
    for page, command, rest in _command_lines():
        assert command in COMMANDS, f"{page}: `hora {command}` is no hora command"
        takes = _options(_command_parser(command))
        for option in OPTION.findall(rest):
            assert option in takes, f"{page}: `hora {command}` takes no {option}"
            checked += 1
    assert checked >= 40  # the pages' commands were found and read


HORA_VARIABLE = re.compile(r"\bHORA_[A-Z0-9_]*[A-Z0-9]\b")
# who reads a variable: the product, or the repository's own scripts, tests and CI
READERS = ("kernels", "service", "tests", "scripts", ".ci", "bench", "docker", "examples")


def _read_by_code() -> set[str]:
    names: set[str] = set()
    for top in READERS:
        for path in (REPO / top).rglob("*"):
            if path.suffix in {".py", ".sh", ""} and path.is_file() and ".venv" not in path.parts:
                names |= set(HORA_VARIABLE.findall(path.read_text(errors="replace")))
    return names


def test_every_hora_variable_the_docs_name_is_read_by_the_code() -> None:
    from hora_service.settings import Settings

    known = {"HORA_" + name.upper() for name in Settings.model_fields} | _read_by_code()
    named = {(page.relative_to(DOCS).as_posix(), name) for page in _pages()
             for name in HORA_VARIABLE.findall(page.read_text())}
    assert len(named) >= 50
    unknown = sorted(f"{page}: {name}" for page, name in named if name not in known)
    assert unknown == [], f"no setting and no code reads {unknown}"


ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[^\s`)?,;]*)")
PARAM = re.compile(r"\{[^}/]*\}")


def _app(tmp_path: Path) -> FastAPI:
    from hora_service.api.app import create_app
    from hora_service.settings import Settings

    return create_app(Settings(data_dir=tmp_path))


def _served(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path with ``{}`` for each parameter) of every route the service's app has."""

    def walk(routes: list[object]) -> list[object]:
        flat: list[object] = []
        for route in routes:
            inner = getattr(route, "original_router", None)  # an included router: its routes
            flat += walk(inner.routes) if inner is not None else [route]
        return flat

    return {(method, PARAM.sub("{}", route.path)) for route in walk(list(app.routes))
            for method in getattr(route, "methods", None) or ()}


def _matches(path: str, served: set[tuple[str, str]], method: str) -> bool:
    """Whether the docs' path (``/v1/jobs/{id}``, ``/v1/jobs/ID``) is a served route."""
    return any(m == method and re.fullmatch(re.escape(p).replace(r"\{\}", "[^/]+"), path)
               for m, p in served)


def test_every_route_the_docs_name_is_served(tmp_path: Path) -> None:
    served = _served(_app(tmp_path))
    named = [(page.relative_to(DOCS).as_posix(), method, path) for page in _pages()
             for method, path in ROUTE.findall(page.read_text())
             if not path.startswith("/hub/")]  # JupyterHub's own API, not hora's
    assert len(named) >= 60
    unknown = [f"{page}: {method} {path}" for page, method, path in named
               if not _matches(PARAM.sub("{}", path), served, method)]
    assert unknown == [], f"the service has no route {unknown}"


def test_the_api_page_lists_every_v1_route(tmp_path: Path) -> None:
    text = PARAM.sub("{}", (DOCS / "service" / "api.md").read_text())
    listed = {(method, path) for method, path in ROUTE.findall(text)}
    api = _app(tmp_path).openapi()["paths"]  # the API's routes, not the 405 answers
    missing = sorted(f"{method.upper()} {path}" for path, methods in api.items()
                     for method in methods if path.startswith("/v1/")
                     and (method.upper(), PARAM.sub("{}", path)) not in listed)
    assert missing == [], f"docs/service/api.md does not list {missing}"


SIZE = re.compile(r"^(\d+) (KiB|MiB|GiB)$")
BARE = re.compile(r"^(true|false|on|off|none|[\d.]+)$")


def _setting_rows() -> list[tuple[str, str, str]]:
    """(page, setting, default cell) of every row of a ``| Setting | Default |`` table."""
    rows = []
    for page in _pages():
        for table in re.findall(r"^\| [Ss]etting[^|]*\| [Dd]efault \|[^\n]*\n\|[-| ]+\n"
                                r"((?:\|[^\n]*\n)+)", page.read_text(), flags=re.M):
            for row in table.splitlines():
                cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
                for name in re.findall(r"`([A-Za-z_0-9]+)`", cells[0]):
                    name = name.removeprefix("HORA_").lower()
                    rows.append((page.relative_to(DOCS).as_posix(), name, cells[1]))
    return rows


def _spelled(value: object) -> str | None:
    """A setting's default as the docs spell it (None: no default, ``none`` in the docs)."""
    if value is None or value == [] or value == "none":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _literal(cell: str) -> str | None | bool:
    """The default a cell states (False: prose, not one value)."""
    cell = cell.strip("`") if re.fullmatch(r"`[^`]*`", cell) else cell
    if cell in ("none", "off"):
        return None if cell == "none" else "false"
    if cell == "on":
        return "true"
    size = SIZE.match(cell)
    if size:
        return str(int(size.group(1)) * 1024 ** ("KMG".index(size.group(2)[0]) + 1))
    return cell if BARE.match(cell) or not re.search(r"[\s(]", cell) else False


def test_the_settings_tables_name_real_settings_and_their_defaults() -> None:
    from hora_service.settings import Settings

    fields = Settings.model_fields
    checked = 0
    for page, name, cell in _setting_rows():
        assert name in fields, f"{page}: the setting {name!r} does not exist"
        stated = _literal(cell)
        if stated is False or "HORA_" in cell or len(re.findall(r"`[a-z_]+`", cell)) > 1:
            continue  # a default told in words (`home directory`, `$DOCKER_HOST`, ...)
        field = fields[name]
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        if stated is None and field.default_factory is None and field.default is None:
            checked += 1
            continue
        assert stated == _spelled(default), f"{page}: {name} defaults to {default!r}, not {cell}"
        checked += 1
    assert checked >= 35


PYTHON_NAME = re.compile(r"(?<![\w.])((?:hora|hora_service)(?:\.[A-Za-z_]\w*)+)")
# the store's file name and the docker runtime's container labels: no Python names
NOT_PYTHON = {"hora.db", "hora.instance", "hora.job", "hora.attempt", "hora.source"}


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_python_name_the_docs_give_exists() -> None:
    named = {(page.relative_to(DOCS).as_posix(), name) for page in _pages()
             for span in CODE_SPAN.findall(page.read_text())
             for name in PYTHON_NAME.findall(span) if name not in NOT_PYTHON}
    assert len(named) >= 30
    missing = sorted(f"{page}: {name}" for page, name in named if not _resolves(name))
    assert missing == [], f"no such module or attribute: {missing}"
