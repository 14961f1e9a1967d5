"""Fixtures shared by tests/dist: the multi-process harness and the shared healthy world.

Starting a rank (a process plus the torch import) costs seconds on a loaded machine, so the
modules in SHARED do not start worlds of their own: each defines ``suite(hvd, rank, size)``,
and one world per size (2 and 3 ranks) runs every suite after a single ``hvd.init()``
(tests/dist/_suites.py). Each test then checks its part of the returned results.

Rank processes load modules by path (tests/helpers/child.py), where the ``helpers`` package
is not importable; test modules therefore get the harness from these fixtures instead of
importing it at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.world import run_world as _run_world

HERE = Path(__file__).parent
SHARED = (
    "test_collectives.py", "test_objects.py", "test_optimizer.py", "test_model_state.py",
    "test_autograd.py", "test_large_results.py",
)
SIZES = (2, 3)
# Collectives time out in 20 s (a hang fails fast); the rendezvous waits for slow imports.
WORLD_ENV = {"HORA_TIMEOUT": "20", "HORA_START_TIMEOUT": "120"}


@dataclass(frozen=True)
class World:
    """What the shared world returned: ``by_rank[r][module stem]`` is that suite's result."""

    size: int
    by_rank: list[dict[str, Any]]

    def results(self, module_file: str) -> list[Any]:
        """Return each rank's result of the suite defined in ``module_file``."""
        stem = Path(module_file).stem
        return [r[stem] for r in self.by_rank]


@pytest.fixture(scope="session")
def run_world() -> Callable[..., list[Any]]:
    """Return ``run_world(file, func, n, args=..., env=..., ...)`` with WORLD_ENV applied."""

    def run(file: str, func: str, n: int, **kw: Any) -> list[Any]:
        kw["env"] = {**WORLD_ENV, **kw.get("env", {})}
        return _run_world(file, func, n, **kw)

    return run


@pytest.fixture(scope="session", params=SIZES, ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest, run_world: Callable[..., list[Any]]) -> World:
    """The shared healthy world of ``request.param`` ranks, with every SHARED suite's results."""
    n = request.param
    files = [str(HERE / f) for f in SHARED]
    return World(
        n, run_world(str(HERE / "_suites.py"), "_rank_body", n, args=(files,), timeout=240)
    )
