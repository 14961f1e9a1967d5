"""The job manager is composed, not mixed in: one typed state and collaborators that take it.

:class:`~hora_service.manager.JobManager` owns a
:class:`~hora_service.jobs.state.ManagerState` and hands it to its collaborators (admission,
the read views, elastic slots, launch, recovery, the monitor loop). No class of
:mod:`hora_service.jobs` or the manager inherits from another of them (no mixins), and none
reaches a private name of another object (only its own ``self._x``). The same structure is
described in docs/dev/architecture.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import hora_service.jobs
import hora_service.manager
from hora.spec import JobSpec, JobState
from hora_service.jobs.admission import Admission
from hora_service.jobs.reads import Reads
from hora_service.jobs.state import ManagerState
from hora_service.manager import JobManager
from hora_service.settings import Settings
from pydantic import BaseModel

MODULES = [
    importlib.import_module(f"hora_service.jobs.{m.name}")
    for m in pkgutil.iter_modules(hora_service.jobs.__path__)
] + [hora_service.manager]


def _ours(cls: type) -> bool:
    """A class of the manager's code; pydantic models (the preflight's rows, which share one
    strict base) are data, not collaborators."""
    if issubclass(cls, BaseModel):
        return False
    return cls.__module__ == "hora_service.manager" or cls.__module__.startswith(
        "hora_service.jobs."
    )


def test_no_class_of_the_manager_inherits_from_another() -> None:
    classes = {c for m in MODULES for _, c in inspect.getmembers(m, inspect.isclass) if _ours(c)}
    assert JobManager in classes and ManagerState in classes
    mixed = {c.__qualname__: [b.__qualname__ for b in c.__mro__[1:] if _ours(b)] for c in classes}
    assert {name: bases for name, bases in mixed.items() if bases} == {}


def test_the_manager_owns_its_collaborators_and_hands_them_one_state(tmp_path: Path) -> None:
    mgr = JobManager(Settings(data_dir=tmp_path / "d", gpus="0", lease_dir=tmp_path / "l"))
    parts = [mgr.reads, mgr.views, mgr.admission, mgr.elastic, mgr.launch, mgr.recovery]
    assert all(part.state is mgr.state for part in [*parts, mgr.monitor])


def test_a_collaborator_works_alone_on_a_state(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "d", work_root=tmp_path, gpus="0", cpu_slots=2,
                        lease_dir=tmp_path / "l", containment="tag")  # fmt: skip
    state = ManagerState(settings)
    job = Admission(state).submit("ann", JobSpec(command=["python", "train.py"]))
    assert list(state.pending) == [job.id] and state.wake.is_set()
    found = Reads(state).get(job.id)
    assert found is not None and found.state == JobState.queued
    state.close_store()


def test_no_module_of_the_manager_reaches_another_objects_private_names() -> None:
    reached = []
    for module in MODULES:
        source = Path(inspect.getfile(module)).read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own and not node.attr.startswith("__"):
                reached.append(f"{module.__name__}:{node.lineno} .{node.attr}")
    assert reached == []
