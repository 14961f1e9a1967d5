"""Fixtures shared by tests/dist: the multi-process harness as a fixture.

Rank processes load a test module by path (tests/helpers/child.py), where the ``helpers``
package is not importable; test modules therefore get ``run_world`` from this fixture instead
of importing it at module level, so the same module serves as the rank body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from helpers.world import run_world as _run_world

# Every world runs with a short collective timeout: a hang fails in seconds, not minutes.
WORLD_ENV = {"HORA_TIMEOUT": "20"}


@pytest.fixture(scope="session")
def run_world() -> Callable[..., list[Any]]:
    """Return ``run_world(file, func, n, args=..., env=..., ...)`` with WORLD_ENV applied."""

    def run(file: str, func: str, n: int, **kw: Any) -> list[Any]:
        kw["env"] = {**WORLD_ENV, **kw.get("env", {})}
        return _run_world(file, func, n, **kw)

    return run
