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

The groups go to the workers longest first (:func:`longest_first`): a worker that is free takes
the next group in that order, so a group of minutes does not start last and keep one worker
busy while the other waits. How long a module takes is read from ``tests/durations.json``
(seconds, measured in CI's phases on its machine kind; ``--record-durations`` rewrites the
entries of the modules a run ran); a module not in it counts :data:`UNKNOWN_TEST_S` a test.

Without ``--dist loadgroup`` (a developer's plain ``pytest``) nothing is marked or reordered.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

DOCKER = "docker"
SHARED_WORLD = "shared world"
DURATIONS = Path(__file__).parents[1] / "durations.json"
UNKNOWN_TEST_S = 5.0  # a test of a module that tests/durations.json does not know yet


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


def by_group(config: pytest.Config) -> bool:
    """Whether this run distributes by group (``--dist loadgroup``): the controller sees the
    option itself, a worker only pytest-xdist's ``loadgroup`` flag (its ``dist`` is ``no``)."""
    option = config.option
    return getattr(option, "dist", "no") == "loadgroup" or getattr(option, "loadgroup", False)


def module_of(nodeid: str) -> str:
    """The test file of a test id, as tests/durations.json names it (``tests/e2e/test_x.py``:
    test ids are relative to the repository root, where pyproject.toml is)."""
    return nodeid.split("::", 1)[0]


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    """tests/durations.json: the seconds each test module took (empty when it is missing)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


def longest_first(groups: Mapping[str, Sequence[pytest.Item]],
                  durations: Mapping[str, float]) -> list[str]:  # fmt: skip
    """The groups, longest first: a group takes the sum of its modules' recorded seconds, a
    module with none :data:`UNKNOWN_TEST_S` a test. Ties keep collection order."""
    def seconds(items: Sequence[pytest.Item]) -> float:
        counts: dict[str, int] = {}
        for item in items:
            module = module_of(item.nodeid)
            counts[module] = counts.get(module, 0) + 1
        return sum(durations.get(m, n * UNKNOWN_TEST_S) for m, n in counts.items())

    order = {name: i for i, name in enumerate(groups)}
    return sorted(groups, key=lambda name: (-seconds(groups[name]), order[name]))


def mark_groups(config: pytest.Config, items: list[pytest.Item],
                durations: Mapping[str, float] | None = None) -> None:  # fmt: skip
    """Give every test its module's ``xdist_group`` when the run distributes by group, and
    put the groups in :func:`longest_first` order (the workers take them in collection order:
    tests/conftest.py turns pytest-xdist's own reordering, by test count, off)."""
    if not by_group(config):
        return
    by_module: dict[types.ModuleType | None, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(getattr(item, "module", None), []).append(item)
    groups: dict[str, list[pytest.Item]] = {}
    for module, its in by_module.items():
        name = group_of(module, its) if module is not None else "no module"
        groups.setdefault(name, []).extend(its)
        for item in its:
            item.add_marker(pytest.mark.xdist_group(name))
    known = read_durations() if durations is None else durations
    items[:] = [item for name in longest_first(groups, known) for item in groups[name]]


class DurationRecorder:
    """``--record-durations``: each module's seconds (setup, call and teardown of its tests)
    written into tests/durations.json at the end of the run, the other modules' entries kept.
    Registered on the process that sees every report (pytest-xdist's controller, or the only
    process of a plain run)."""

    def __init__(self, path: Path = DURATIONS) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = module_of(report.nodeid)
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        merged = read_durations(self.path)
        merged.update({m: round(s, 1) for m, s in self.seconds.items()})
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
