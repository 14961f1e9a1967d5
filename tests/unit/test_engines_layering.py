"""hora.engines' modules import one way: no cycle, and the cluster's parts never import it.

Every import counts: at top level, inside a function, and under ``if TYPE_CHECKING:``. The
notebook :class:`~hora.engines.cluster.Cluster` owns its parts (recovery, health, the cell's
rejoin); they are given the engines' state (:class:`~hora.engines.group.EngineGroup`) and
plain callables, never the cluster. docs/dev/architecture.md says the same.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import hora.engines
from helpers.fresh import assert_no_cycle, import_graph

PACKAGE = Path(hora.engines.__file__).parent
# the cluster's parts: each is given what it needs, never the cluster (nor a session cluster)
PARTS = ("recovery", "health", "rejoin", "parking")
FACADES = ("cluster", "session")


def _imports(source: str) -> set[str]:
    """The hora.engines modules ``source`` imports anywhere (top level, function, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "hora.engines":  # a sibling module, or a name __init__ exports
                found.update(
                    a.name if (PACKAGE / f"{a.name}.py").exists() else "__init__"
                    for a in node.names
                )
            elif node.module.startswith("hora.engines."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hora.engines."):
                    found.add(a.name.split(".")[2])
                elif a.name == "hora.engines":
                    found.add("__init__")
    return {m for m in found if (PACKAGE / f"{m}.py").exists()}


def _graph() -> dict[str, set[str]]:
    """The import graph, read in a fresh interpreter (:mod:`helpers.fresh`)."""
    return import_graph(__file__)


def _read_graph() -> dict[str, list[str]]:
    return {p.stem: sorted(_imports(p.read_text()) - {p.stem})
            for p in sorted(PACKAGE.glob("*.py"))}  # fmt: skip


def test_no_import_cycle() -> None:
    assert_no_cycle(_graph())


def test_the_cluster_parts_never_import_the_cluster() -> None:
    graph = _graph()
    back = [f"{part} imports {dep}" for part in PARTS for dep in sorted(graph[part])
            if dep in (*FACADES, "__init__")]  # fmt: skip
    assert not back, back


def test_every_import_is_seen() -> None:
    """The scan finds imports inside functions and under TYPE_CHECKING, not only at the top."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hora.engines.cluster import Cluster\n"
        "def f():\n    from hora.engines import health, Cluster\n    import hora.engines.world\n"
    )
    assert _imports(src) == {"cluster", "health", "world", "__init__"}


if __name__ == "__main__":  # what _graph() runs
    print(json.dumps(_read_graph()))
