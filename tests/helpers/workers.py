"""Which tests share a pytest-xdist worker when CI runs a folder on two (``-n 2``).

CI runs ``tests/dist`` and ``tests/e2e`` with ``-n 2 --dist loadgroup``: both folders mostly
wait (on rank processes, servers, timeouts by design), so two workers share the 2 cores. Tests
that must not run side by side, or whose expensive fixtures should start once, get the same
``xdist_group`` here (:func:`mark_groups`, called by tests/conftest.py); a worker runs a group's
tests one after another, in collection order. The groups, a whole module at a time:

* ``docker``: every module that uses the Docker engine (:mod:`helpers.docker_engine`). They
  share one engine, whose hora containers a module may clear at its start
  (:func:`helpers.docker_engine.Engine.remove_stopped_hora_containers`) and count at its end
  (``DOCKER_NONE_LEFT``): two such modules at once would see each other's.
* ``shared world``: every module whose tests read tests/dist's shared healthy worlds (the
  session-scoped ``world`` fixture, 2 and 3 ranks): they are started once, not once a worker.
* any other module is a group of its own, so its module-scoped fixtures start once.

Without ``--dist loadgroup`` (a developer's plain ``pytest``) nothing is marked.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import pytest

DOCKER = "docker"
SHARED_WORLD = "shared world"


def _uses_docker(module: types.ModuleType) -> bool:
    return any(getattr(v, "__module__", None) == "helpers.docker_engine"
               for v in vars(module).values())  # fmt: skip


def group_of(module: types.ModuleType, items: Sequence[pytest.Item]) -> str:
    """The worker group of a test module (see the module docstring)."""
    fixtures = {f for item in items for f in getattr(item, "fixturenames", ())}
    if "docker_engine" in fixtures or _uses_docker(module):
        return DOCKER
    if "world" in fixtures:
        return SHARED_WORLD
    return module.__name__


def mark_groups(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Give every test its module's ``xdist_group`` when the run distributes by group."""
    if not getattr(config.option, "loadgroup", False):  # set by pytest-xdist, workers included
        return
    by_module: dict[types.ModuleType | None, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(getattr(item, "module", None), []).append(item)
    for module, its in by_module.items():
        name = group_of(module, its) if module is not None else "no module"
        for item in its:
            item.add_marker(pytest.mark.xdist_group(name))
