"""The job manager and the machine-wide leases: foreign holders, re-adoption, the data dir.

The manager runs scripted ranks (no processes); the other holders are real forked processes
holding real locks in the test's own lease directory (tests/conftest.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.lease_holder import Holder
from hora.errors import HoraError
from hora.leases import LeaseDir
from hora.spec import JobSpec, JobState
from hora_service.manager import JobManager
from hora_service.runtimes import AttemptPlan, Exit, RankProcess, Runtime
from hora_service.runtimes.base import RankStatus
from hora_service.runtimes.containment import instance_id
from hora_service.settings import Settings


class Rank(RankProcess):
    def __init__(self) -> None:
        self.status: RankStatus = Exit.running

    def poll(self) -> RankStatus:
        return self.status

    def signal(self, sig: int) -> None:
        self.status = -sig


class Scripted(Runtime):
    name = "scripted"

    def __init__(self) -> None:
        self.started: list[tuple[AttemptPlan, list[Rank]]] = []

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        ranks = [Rank() for _ in range(plan.spec.workers)]
        self.started.append((plan, ranks))
        return list(ranks)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        return self._start(plan, {})


@pytest.fixture
def settings(tmp_path: Path, _own_lease_dir: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2,
        containment="tag", lease_dir=_own_lease_dir, port=8123,
    )  # fmt: skip


@pytest.fixture
def leases(_own_lease_dir: Path) -> LeaseDir:
    return LeaseDir(_own_lease_dir)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.kill()


@pytest.fixture
def managers() -> Iterator[list[JobManager]]:
    made: list[JobManager] = []
    yield made
    for m in made:
        m.stop()


def manager(settings: Settings, managers: list[JobManager], rt: Scripted) -> JobManager:
    m = JobManager(settings, runtimes={"local": rt})
    m.start()
    managers.append(m)
    return m


def spec(workers: int) -> JobSpec:
    return JobSpec.model_validate({"command": ["python", "x.py"], "workers": workers})


def test_a_slot_held_elsewhere_is_not_handed_out_and_the_wait_names_the_holder(
    settings: Settings, leases: LeaseDir, holders: list[Holder], managers: list[JobManager]
) -> None:
    kernel = Holder(leases, "cpu1", {"kind": "kernel", "what": "train.ipynb"})
    holders.append(kernel)
    rt = Scripted()
    m = manager(settings, managers, rt)
    one = m.submit("bob", spec(1))  # one slot is free: a job that fits runs there
    m.tick()
    assert [p.slots for p, _ in rt.started] == [(0,)]
    job = m.submit("ann", spec(2))
    m.tick()
    assert len(rt.started) == 1 and m.get(job.id).state == JobState.queued  # type: ignore[union-attr]
    why = m.queue_view(job.id)
    assert [(h.kind, h.id) for h in why.holders] == [("job", one.id), ("kernel", kernel.pid)]
    user = why.holders[1].user
    assert why.holders[1].what == f"notebook kernel pid {kernel.pid} (train.ipynb, user {user})"
    assert why.free == 0
    shown = {s.name: s for s in m.slots()}
    assert shown["cpu0"].job_id == one.id and shown["cpu0"].holder is None
    assert shown["cpu1"].holder_kind == "kernel" and shown["cpu1"].holder == why.holders[1].what
    kernel.kill()  # kill -9: the kernel's lease is gone with it
    rt.started[0][1][0].status = 0
    m.tick()
    assert [p.slots for p, _ in rt.started] == [(0,), (0, 1)]
    assert m.get(job.id).state == JobState.running  # type: ignore[union-attr]


def test_the_leases_follow_the_attempts(
    settings: Settings, leases: LeaseDir, managers: list[JobManager]
) -> None:
    rt = Scripted()
    m = manager(settings, managers, rt)
    job = m.submit("ann", spec(2))
    m.tick()
    plan, ranks = rt.started[0]
    held = leases.held(["cpu0", "cpu1"])
    assert {n: (h.pid, h.kind, h.job, h.attempt, h.url) for n, h in held.items()} == {
        n: (os.getpid(), "service", job.id, 1, "http://127.0.0.1:8123") for n in ("cpu0", "cpu1")
    }
    assert len(plan.leases) == 2 and plan.rank_leases(1) == plan.leases[1:]
    for r in ranks:
        r.status = 0
    m.tick()
    assert leases.held(["cpu0", "cpu1"]) == {}


def test_a_restarted_service_knows_the_leases_its_ranks_kept(
    settings: Settings,
    leases: LeaseDir,
    holders: list[Holder],
    managers: list[JobManager],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = Scripted()
    first = manager(settings, managers, rt)
    job = first.submit("ann", spec(2))
    first.tick()
    plan, _ = rt.started[0]
    for fd in plan.leases:  # each rank's shim inherited its slot's lease
        holders.append(Holder(leases, "", fd=fd))
    first.stop()  # the service goes; the shims hold on
    managers.remove(first)
    assert set(leases.held(["cpu0", "cpu1"])) == {"cpu0", "cpu1"}
    with caplog.at_level(logging.ERROR):
        second = manager(settings, managers, Scripted())
        second.tick()
    assert not [r for r in caplog.records if "two holders" in r.getMessage()]  # its own
    assert second.get(job.id).state == JobState.running  # type: ignore[union-attr]
    held = leases.held(["cpu0", "cpu1"])
    assert {(h.job, h.attempt, h.kind) for h in held.values()} == {(job.id, 1, "service")}
    other = second.submit("bob", spec(1))
    second.tick()
    assert second.get(other.id).state == JobState.queued  # type: ignore[union-attr]
    assert second.queue_view(other.id).holders[0].id == job.id  # its own job, not "elsewhere"


def test_a_slot_taken_while_the_service_was_down_is_reported(
    settings: Settings,
    leases: LeaseDir,
    holders: list[Holder],
    managers: list[JobManager],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = Scripted()
    first = manager(settings, managers, rt)
    job = first.submit("ann", spec(1))
    first.tick()
    first.stop()  # no shim held the lease (docker): it went with the service
    managers.remove(first)
    thief = Holder(leases, "cpu0", {"kind": "service", "instance": instance_id(Path("/x"))})
    holders.append(thief)
    with caplog.at_level(logging.ERROR):
        second = manager(settings, managers, Scripted())
        second.tick()
        second.tick()
    said = [r.getMessage() for r in caplog.records if "two holders" in r.getMessage()]
    assert len(said) == 1 and f"job {job.id} runs on cpu0" in said[0], said
    assert f"pid {thief.pid}" in said[0]


def test_one_service_per_data_directory(
    settings: Settings, managers: list[JobManager]
) -> None:
    first = manager(settings, managers, Scripted())
    second = JobManager(settings, runtimes={"local": Scripted()})
    with pytest.raises(HoraError) as e:
        second.start()
    said = str(e.value)
    assert f"pid {os.getpid()}" in said and "http://127.0.0.1:8123" in said
    assert str(settings.data_dir) in said and "--data-dir" in said
    first.stop()
    managers.remove(first)
    manager(settings, managers, Scripted())  # free again once the first stopped


def test_an_unsafe_lease_directory_stops_the_service_from_starting(
    settings: Settings, tmp_path: Path, managers: list[JobManager]
) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    bad = settings.model_copy(update={"lease_dir": tmp_path / "open"})
    m = JobManager(bad, runtimes={"local": Scripted()})
    with pytest.raises(HoraError, match="HORA_LEASE_DIR"):
        m.start()
    manager(settings, managers, Scripted())  # it let the data directory go
