"""The job manager's waits, driven pass by pass with scripted ranks (no processes).

A runtime's posted reason shows on a starting job; a session's slots handed to a job go to it
before an older queued job; slot-hours and queue waits are counted per user.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hora.spec import JobSpec, JobState, QueueInfo
from hora_service.manager import JobManager
from hora_service.observability.queueview import job_queue
from hora_service.runtimes import AttemptPlan, Exit, RankProcess, Runtime
from hora_service.runtimes.base import RankStatus
from hora_service.scheduling.reasons import image_reason
from hora_service.settings import Settings


class Rank(RankProcess):
    def __init__(self) -> None:
        self.status: RankStatus = Exit.running

    def poll(self) -> RankStatus:
        return self.status

    def signal(self, sig: int) -> None:
        if self.status is Exit.running:
            self.status = -sig


class Pulling(Runtime):
    """Starts scripted ranks; while "pulling", looks at the job as the API would."""

    name = "scripted"

    def __init__(self) -> None:
        self.manager: JobManager | None = None
        self.seen: list[object] = []
        self.ranks: dict[int, list[Rank]] = {}

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        assert self.waits is not None and self.manager is not None
        self.waits.post(plan.job_id, image_reason("hora:cpu"))
        record = self.manager.get(plan.job_id)
        assert record is not None
        self.seen.append(job_queue(self.manager, record))
        self.waits.clear(plan.job_id)
        self.ranks[plan.job_id] = [Rank() for _ in range(plan.spec.workers)]
        return list(self.ranks[plan.job_id])

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        return []


@pytest.fixture
def rt() -> Pulling:
    return Pulling()


@pytest.fixture
def mgr(tmp_path: Path, rt: Pulling) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4,
        kill_grace_s=5, containment="tag",
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    rt.manager = m
    return m


def spec(workers: int) -> JobSpec:
    return JobSpec(command=["python", "train.py"], workers=workers)


def test_a_starting_job_shows_the_reason_its_runtime_posted(mgr: JobManager, rt: Pulling) -> None:
    job = mgr.submit("ann", spec(2))
    mgr.tick()
    (seen,) = rt.seen
    assert isinstance(seen, QueueInfo) and seen.why is not None
    assert seen.why.kind == "image" and seen.position == 0
    after = mgr.get(job.id)
    assert after is not None and after.state == JobState.running
    assert job_queue(mgr, after) is None  # cleared once the pull is over


def test_handoff_gives_the_session_slots_before_an_older_queued_job(
    mgr: JobManager, rt: Pulling
) -> None:
    session, _ = mgr.submit_or_find("ann", spec(2), kind="session")
    blocker = mgr.submit("bob", spec(2))
    mgr.tick()
    older = mgr.submit("bob", spec(2))  # queued first: no slot is free
    mgr.tick()
    held = mgr.get(session.id)
    assert held is not None and held.state == JobState.running
    handed = mgr.handoff(session.id, "ann", spec(2))
    for _ in range(3):
        mgr.tick()
    job = mgr.get(handed.id)
    assert job is not None and job.state == JobState.running and job.slots == held.slots
    waiting = mgr.get(older.id)
    assert waiting is not None and waiting.state == JobState.queued
    ended = mgr.get(session.id)
    assert ended is not None
    assert ended.reason == f"stopped: its slots were handed to job {handed.id}"
    assert blocker.id in rt.ranks


def test_handoff_refuses_a_bigger_job_and_a_session_not_running(mgr: JobManager) -> None:
    from hora.errors import HoraError, SpecError

    session, _ = mgr.submit_or_find("ann", spec(2), kind="session")
    with pytest.raises(HoraError, match="not running"):
        mgr.handoff(session.id, "ann", spec(2))  # still queued
    mgr.tick()
    with pytest.raises(SpecError) as e:
        mgr.handoff(session.id, "ann", spec(3))
    assert e.value.field == "workers"


def test_usage_counts_waits_and_slot_hours(mgr: JobManager, rt: Pulling) -> None:
    job = mgr.submit("ann", spec(2))
    mgr.tick()
    rt.ranks[job.id][0].status = 0
    rt.ranks[job.id][1].status = 0
    mgr.tick()
    snap = mgr.metrics()
    assert [(u, p, n) for u, p, _, n in snap.queue_wait] == [("ann", "normal", 1)]
    assert set(snap.slot_hours) == {"ann"} and snap.slot_hours["ann"] >= 0.0
