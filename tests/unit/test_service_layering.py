"""hora_service's packages import one way: base -> scheduling -> store -> runtimes -> users ->
jobs -> observability -> sessions -> web -> entry points.

Each module may import (at top level, inside a function or under ``TYPE_CHECKING``) only
modules of its own package, of another package of its layer, or of a lower layer; every
package and top-level module of ``hora_service`` has a layer. The same table is in
docs/dev/architecture.md ("The service's packages").
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import hora_service
from helpers.fresh import import_graph

# Lowest first. A unit is a package of hora_service or one of its top-level modules.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("models", "identity", "settings"),
    "scheduling": ("scheduling",),
    "store": ("store",),
    "runtimes": ("runtimes",),
    "users": ("users",),
    "jobs": ("jobs", "manager"),
    "observability": ("observability",),
    "sessions": ("sessions",),
    "web": ("api", "ui", "hub"),
    "entry": ("cli", "up", "images"),
}
RANK = {unit: i for i, units in enumerate(LAYERS.values()) for unit in units}
# Imports against the layers, each with its reason. The targets are leaves: they import no
# module of hora_service (test_exceptions_are_leaves).
EXCEPTIONS = {
    ("settings", "runtimes.limits"): "a limit setting is parsed by the runtimes' own parser",
    ("settings", "runtimes.imageref"): "the image allow-list is checked by the docker rules",
}
PACKAGE = Path(hora_service.__file__).parent


def _name(path: Path) -> str:
    """``runtimes.docker`` for service/hora_service/runtimes/docker.py; a package's own
    ``__init__`` is the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, known: set[str]) -> set[str]:
    """The hora_service modules ``source`` imports anywhere (``from hora_service.x import y``
    names ``x.y`` when that is a module, else ``x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hora_service" or node.module.startswith("hora_service."):
                base = node.module.removeprefix("hora_service").lstrip(".")
                for alias in node.names:
                    full = f"{base}.{alias.name}".lstrip(".")
                    found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("hora_service.") for a in node.names
                         if a.name.startswith("hora_service."))  # fmt: skip
    return {m for m in found if m}


def _read_graph() -> dict[str, list[str]]:
    paths = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")
    known = {_name(p) for p in paths}
    return {_name(p): sorted(_imports(p.read_text(), known) - {_name(p)}) for p in paths}


def _graph() -> dict[str, set[str]]:
    """The import graph, read in a fresh interpreter (:mod:`helpers.fresh`)."""
    return import_graph(__file__)


def _unit(module: str) -> str:
    return module.split(".")[0]


def _layer(unit: str) -> str:
    return next(name for name, units in LAYERS.items() if unit in units)


def test_every_package_and_top_level_module_has_a_layer() -> None:
    assert sorted({_unit(m) for m in _graph()}) == sorted(RANK)


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = [
        f"{mod} ({_layer(_unit(mod))}) imports {dep} ({_layer(_unit(dep))})"
        for mod, deps in _graph().items()
        for dep in sorted(deps)
        if RANK[_unit(dep)] > RANK[_unit(mod)] and (mod, dep) not in EXCEPTIONS
    ]
    assert not upward, upward


def test_exceptions_are_leaves_and_still_needed() -> None:
    graph = _graph()
    for mod, dep in EXCEPTIONS:
        assert dep in graph[mod], f"{mod} no longer imports {dep}: drop the exception"
        assert graph[dep] == set(), f"{dep} imports {sorted(graph[dep])}"


def test_nothing_below_the_web_layer_imports_api_ui_or_hub() -> None:
    web = set(LAYERS["web"])
    below = {
        mod: sorted(d for d in deps if _unit(d) in web)
        for mod, deps in _graph().items()
        if RANK[_unit(mod)] < RANK["api"]
    }
    assert {mod: deps for mod, deps in below.items() if deps} == {}


def test_store_and_scheduling_import_only_the_base() -> None:
    base = set(LAYERS["base"])
    for mod, deps in _graph().items():
        if _unit(mod) in ("store", "scheduling"):
            assert {_unit(d) for d in deps} <= base | {_unit(mod)}, (mod, deps)


def test_lazy_and_aliased_imports_are_seen() -> None:
    src = (
        "from hora_service import identity\nfrom hora_service.users import homes\n"
        "def f():\n    from hora_service.store.db import Store\n"
        "    import hora_service.api.app\n"
    )
    known = {"identity", "users.homes", "store.db", "api.app"}
    assert _imports(src, known) == {"identity", "users.homes", "store.db", "api.app"}


if __name__ == "__main__":  # what _graph() runs
    print(json.dumps(_read_graph()))
