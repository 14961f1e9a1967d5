"""hora.torch's modules import one way: state -> diagnosis -> launch -> ops -> API.

Each module may import (at top level or inside a function) only modules of its own layer or
of lower ones, and no two modules import each other, directly or around a loop. The upper
layers hook into the lower ones instead (``_state.register_init_hook`` and friends).
The same table is in docs/dev/architecture.md ("Layering").
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import hora.torch
from helpers.fresh import assert_no_cycle, import_graph

LAYERS: dict[str, tuple[str, ...]] = {
    "state": (
        "_dist", "_sealed", "_authstore", "_rendezvous", "_heartbeat", "_state", "basics",
        "host", "compression", "_kinds", "_pages",
    ),
    "diagnosis": ("_stall", "timeline", "_preflight_figures"),
    "launch": (
        "_handles", "_shm_ops", "_lane", "_cpus", "_segfile", "_shm", "_arena", "_hier", "_comm",
        "_wire", "_negotiation", "_engine", "_process_sets",
    ),
    "ops": ("_collective", "_ops", "_gather", "_objects", "_grouped"),
    "api": (
        "_autograd", "mpi_ops", "functions", "_reducer", "optimizer", "sync_batch_norm",
        "preflight", "__init__",
    ),
}
RANK = {mod: i for i, mods in enumerate(LAYERS.values()) for mod in mods}
PACKAGE = Path(hora.torch.__file__).parent


def _imports(source: str) -> set[str]:
    """The hora.torch modules ``source`` imports anywhere (top level or in a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "hora.torch":
                found.update(a.name for a in node.names)
            elif node.module.startswith("hora.torch."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[2] for a in node.names if a.name.startswith("hora.torch.")
            )
    return {m for m in found if (PACKAGE / f"{m}.py").exists()}


def _graph() -> dict[str, set[str]]:
    """The import graph, read in a fresh interpreter (:mod:`helpers.fresh`)."""
    return import_graph(__file__)


def _read_graph() -> dict[str, list[str]]:
    return {p.stem: sorted(_imports(p.read_text()) - {p.stem})
            for p in sorted(PACKAGE.glob("*.py"))}  # fmt: skip


def test_every_module_has_a_layer() -> None:
    assert sorted(_graph()) == sorted(RANK)


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = [
        f"{mod} ({_layer(mod)}) imports {dep} ({_layer(dep)})"
        for mod, deps in _graph().items()
        for dep in sorted(deps)
        if RANK[dep] > RANK[mod]
    ]
    assert not upward, upward


def test_no_import_cycle() -> None:
    assert_no_cycle(_graph())


def test_lazy_imports_are_seen() -> None:
    """The scan finds imports inside functions, not only at the top."""
    src = "def f():\n    from hora.torch import timeline\n    import hora.torch._engine\n"
    assert _imports(src) == {"timeline", "_engine"}


def _layer(mod: str) -> str:
    return next(name for name, mods in LAYERS.items() if mod in mods)


if __name__ == "__main__":  # what _graph() runs
    print(json.dumps(_read_graph()))
