"""The monitor's journal: state changes SQLite refuses wait, in order, and land later.

The manager runs with scripted ranks (no processes), as in test_service_core.py, over a real
SQLite file; another connection holds the real write lock (``BEGIN IMMEDIATE``) while the
loop decides things, then lets go.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hora.spec import JobSpec, JobState
from hora_service.manager import JobManager
from hora_service.runtimes import AttemptPlan, Exit, RankProcess, Runtime
from hora_service.runtimes.base import RankStatus
from hora_service.settings import Settings
from hora_service.store.db import StoreUnavailable
from hora_service.store.journal import Journal, Write, apply_writes
from hora_service.store.probe import StoreProbe
from sqlalchemy.exc import OperationalError


class Rank(RankProcess):
    def __init__(self) -> None:
        self.status: RankStatus = Exit.running

    def poll(self) -> RankStatus:
        return self.status

    def signal(self, sig: int) -> None:
        if self.status is Exit.running:
            self.status = -sig


class Scripted(Runtime):
    name = "scripted"

    def __init__(self) -> None:
        self.ranks: list[Rank] = []

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        ranks = [Rank() for _ in range(plan.spec.workers)]
        self.ranks += ranks
        return list(ranks)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        return self._start(plan, {})


@pytest.fixture
def rt() -> Scripted:
    return Scripted()


@pytest.fixture
def mgr(tmp_path: Path, rt: Scripted) -> Iterator[JobManager]:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2,
        kill_grace_s=5, containment="tag", store_write_timeout_s=0.2,
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    yield m
    m.close_store()


@contextmanager
def write_locked(m: JobManager) -> Iterator[None]:
    conn = sqlite3.connect(m.settings.db_path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def stored(m: JobManager, job_id: int) -> JobState:
    assert m.store is not None
    record = m.store.get(job_id)
    assert record is not None
    return record.state


def submit(m: JobManager) -> int:
    return m.submit("ann", JobSpec(command=["python", "x.py"])).id


def test_an_end_the_store_refuses_waits_and_lands(mgr: JobManager, rt: Scripted) -> None:
    job = submit(mgr)
    mgr.tick()
    assert stored(mgr, job) == JobState.running
    with write_locked(mgr):
        rt.ranks[0].status = 0
        mgr.tick()
        seen = mgr.get(job)
        assert seen is not None and seen.state == JobState.succeeded  # the monitor's truth
        assert seen.exit_codes == {0: 0} and seen.finished_at is not None
        assert [t.state for t in seen.transitions][-1] == JobState.succeeded
        assert stored(mgr, job) == JobState.running and len(mgr.journal) == 1
        assert all(s.job_id is None for s in mgr.slots())
        assert mgr.journal.error is not None and "locked" in mgr.journal.error
        assert mgr.metrics().store_pending_writes == 1  # /metrics: hora_store_pending_writes
        mgr.tick()  # still locked: still waiting, nothing lost
        assert len(mgr.journal) == 1
    mgr.tick()
    assert stored(mgr, job) == JobState.succeeded and len(mgr.journal) == 0
    assert mgr.journal.error is None


def test_nothing_starts_while_changes_wait(mgr: JobManager, rt: Scripted) -> None:
    first = submit(mgr)
    mgr.tick()
    with write_locked(mgr):
        rt.ranks[0].status = 0
        mgr.tick()  # first's end waits in the journal
        with pytest.raises((StoreUnavailable, OperationalError)):
            submit(mgr)  # a submit that cannot be stored is refused, never half-done
        mgr.tick()
        assert len(rt.ranks) == 1  # no process starts before the store knows
    second = submit(mgr)
    mgr.tick()
    mgr.tick()
    assert stored(mgr, first) == JobState.succeeded
    assert stored(mgr, second) == JobState.running and len(rt.ranks) == 2


def test_cancel_and_delete_while_the_store_is_locked(mgr: JobManager, rt: Scripted) -> None:
    job = submit(mgr)
    mgr.tick()
    with write_locked(mgr):
        assert mgr.cancel(job).state == JobState.running  # SIGTERM sent; the end comes next
        mgr.tick()
        assert state_of(mgr, job) == JobState.cancelled
        with pytest.raises(StoreUnavailable):
            mgr.delete(job)  # its end is not stored yet: the row stays
    mgr.tick()
    assert stored(mgr, job) == JobState.cancelled
    mgr.delete(job)
    assert mgr.get(job) is None


def state_of(m: JobManager, job_id: int) -> JobState:
    job = m.get(job_id)
    assert job is not None
    return job.state


def test_journal_keeps_order_and_overlays() -> None:
    j = Journal()
    j.add(Write(1, JobState.starting, 1.0, None, {"attempt": 1, "slots": [0]}))
    j.add(Write(1, JobState.running, 2.0, None, {"started_at": 2.0}))
    j.add(Write(2, None, 2.0, None, {"cancel_requested": 1}))
    seen: list[list[Write]] = []

    def refuse(batch: list[Write]) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        j.flush(refuse, now=5.0)
    assert len(j) == 3 and j.failing_since == 5.0 and j.error == "OSError: disk full"
    assert j.flush(seen.append, now=6.0) == [1, 2]
    assert [w.state for w in seen[0]] == [JobState.starting, JobState.running, None]
    assert len(j) == 0 and j.error is None and not j.pending(1)


def test_an_event_adds_a_transition_and_keeps_the_state(mgr: JobManager) -> None:
    job = mgr.submit("ann", JobSpec(command=["true"]))
    seen = apply_writes(job, [
        Write(job.id, JobState.running, 2.0, "went", {"attempt": 1}),
        Write(job.id, JobState.running, 3.0, "preflight (2 ranks ...)", event=True),
    ])  # fmt: skip
    assert (seen.state, seen.reason) == (JobState.running, "went")
    assert [t.reason for t in seen.transitions][-2:] == ["went", "preflight (2 ranks ...)"]
    mgr.state.write(Write(job.id, JobState.running, 3.0, "preflight (2 ranks ...)", event=True))
    stored = mgr.get(job.id)
    assert stored is not None and stored.state == JobState.queued and stored.reason is None
    assert stored.transitions[-1].reason == "preflight (2 ranks ...)"


def test_health_probe_says_why_the_store_is_not_usable(mgr: JobManager) -> None:
    probe = StoreProbe(mgr.settings.db_path, mgr.journal, interval_s=60)
    assert probe.check().status == "ok"
    with write_locked(mgr):
        sick = probe.check()
    assert (
        sick.status == "degraded"
        and sick.reason == "the store cannot take writes: database is locked"
    )
    mgr.journal.add(Write(1, JobState.failed, 1.0, None))
    mgr.journal.error = "OperationalError: database or disk is full"
    assert "1 job state change(s) have waited" in str(probe.check().reason)
    mgr.journal.discard(Write(1, JobState.failed, 1.0, None))
    mgr.close_store()
    with mgr.settings.db_path.open("r+b") as f:
        f.write(b"garbage" * 10)
    assert probe.check().reason == "the store cannot be read: file is not a database"
