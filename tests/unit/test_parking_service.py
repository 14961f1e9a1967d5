"""The service's side of parking, driven pass by pass with scripted engines (issue 28).

A real :class:`JobManager` over a real SQLite store, with a scripted runtime (ranks that obey
SIGTERM, no processes): a session parks (its directory made private, its parts measured by
the service itself, the quota counted), stops, frees its slots and resumes with its
snapshot in the engines' environment; the snapshot goes once restored, at the end of a
session and past the retention; the idle timeout and a waiting higher priority ask the
kernel to park; a park that fails leaves the engines running (an idle one stops).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hora.errors import SpecError
from hora.session_wire import ParkAbort, ParkBegin, ResumeRequest
from hora.spec import JobState, ParkCommit, ParkedRank
from hora_service.manager import JobManager
from hora_service.sessions import parkdirs
from hora_service.sessions.park_manager import ParkConflict
from hora_service.sessions.session_manager import Heartbeat, SessionManager
from hora_service.settings import Settings
from hora_service.users.quotas import OverLimit
from test_service_core import ScriptedRuntime
from test_sessions import CONN, request
from test_sessions import job as job_spec


@pytest.fixture
def rt() -> ScriptedRuntime:
    return ScriptedRuntime()


def manager(tmp_path: Path, rt: ScriptedRuntime, **kw: object) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4, kill_grace_s=5,
        containment="tag", session_lease_s=30, session_idle_timeout_s=600,
        session_park_quota="1m", **kw,
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    return m


@pytest.fixture
def mgr(tmp_path: Path, rt: ScriptedRuntime) -> JobManager:
    return manager(tmp_path, rt)


@pytest.fixture
def sessions(mgr: JobManager) -> SessionManager:
    return SessionManager(mgr, mgr.settings)


def running(mgr: JobManager, sessions: SessionManager, user: str = "ann", **kw: object) -> int:
    s = sessions.create(user, request(**kw))
    mgr.tick()
    return s.id


def write_parts(directory: str, sizes: list[int]) -> ParkCommit:
    """What the engines do: each rank writes its part."""
    ranks = []
    for rank, size in enumerate(sizes):
        (Path(directory) / f"rank{rank}.pt").write_bytes(b"x" * size)
        ranks.append(ParkedRank(rank=rank, bytes=size, crc32=rank, names=["model"]))
    return ParkCommit(ticket=Path(directory).name.rsplit("-", 1)[1], ranks=ranks)


def park(mgr: JobManager, sessions: SessionManager, sid: int, sizes: list[int]) -> None:
    job = mgr.get(sid)
    assert job is not None
    ticket = sessions.parks.begin(job, ParkBegin(bytes=sum(sizes)))
    sessions.parks.commit(job, write_parts(ticket.directory, sizes))
    mgr.tick()  # the engines obey SIGTERM
    mgr.tick()


def test_a_park_is_recorded_frees_the_slots_and_resumes_with_its_snapshot(
    mgr: JobManager, sessions: SessionManager, rt: ScriptedRuntime, tmp_path: Path
) -> None:
    sid = running(mgr, sessions)
    job = mgr.get(sid)
    assert job is not None
    ticket = sessions.parks.begin(job, ParkBegin(bytes=2000))
    where = Path(ticket.directory)
    assert where.parent == tmp_path / ".hora-parked"
    assert stat.S_IMODE(where.stat().st_mode) == stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    assert (ticket.quota_bytes, ticket.used_bytes) == (1 << 20, 0)
    sessions.parks.commit(job, write_parts(ticket.directory, [1000, 1000]))
    mgr.tick()
    mgr.tick()
    parked = mgr.get(sid)
    assert parked is not None and parked.state == JobState.parked and parked.slots == []
    assert parked.park is not None and parked.park.phase == "parked" and parked.park.bytes == 2000
    assert parked.reason == "parked by its user (%dist_park)"
    assert all(s.job_id is None for s in mgr.slots())
    assert sessions.idle_of(sid) is None  # no lease: nothing heartbeats a parked session
    mgr.tick(now=time.time() + 3600)  # a parked session outlives any lease
    assert mgr.get(sid).state == JobState.parked  # type: ignore[union-attr]

    resumed = sessions.parks.resume(parked, ResumeRequest(connection=CONN))  # type: ignore[arg-type]
    assert resumed.state == JobState.queued
    mgr.tick()
    plan = rt.started[-1][0]
    assert plan.spec.env["HORA_RESTORE_DIR"] == ticket.directory
    assert plan.spec.env["HORA_RESTORE_SIZE"] == "2"
    now = mgr.get(sid)
    assert now is not None and now.state == JobState.running and now.park is not None
    assert now.park.phase == "resuming"
    sessions.parks.restored(now)
    gone = mgr.get(sid)
    assert gone is not None and gone.park is None and not where.exists()


def test_a_park_past_the_quota_is_refused_with_the_figures_and_nothing_stops(
    mgr: JobManager, sessions: SessionManager
) -> None:
    first = running(mgr, sessions, workers=1)
    park(mgr, sessions, first, [700 << 10])
    second = running(mgr, sessions, workers=1)
    job = mgr.get(second)
    assert job is not None
    with pytest.raises(OverLimit, match="parked sessions keep 700.0 KiB of your 1.0 MiB quota"):
        sessions.parks.begin(job, ParkBegin(bytes=500 << 10))
    ticket = sessions.parks.begin(job, ParkBegin(bytes=1000))  # the estimate was low
    with pytest.raises(OverLimit, match="the snapshot is 500.0 KiB"):
        sessions.parks.commit(job, write_parts(ticket.directory, [500 << 10]))
    assert not Path(ticket.directory).exists()
    mgr.tick()
    assert mgr.get(second).state == JobState.running  # type: ignore[union-attr]


def test_the_service_measures_the_parts_itself(
    mgr: JobManager, sessions: SessionManager
) -> None:
    sid = running(mgr, sessions)
    job = mgr.get(sid)
    assert job is not None
    ticket = sessions.parks.begin(job, ParkBegin())
    body = write_parts(ticket.directory, [10, 10])
    (Path(ticket.directory) / "rank1.pt").write_bytes(b"x" * 3)  # torn: the kernel's word is not
    with pytest.raises(SpecError, match="rank 1's part is 3 bytes on disk, not 10"):
        sessions.parks.commit(job, body)
    ticket = sessions.parks.begin(job, ParkBegin())
    body = write_parts(ticket.directory, [10, 10])
    (Path(ticket.directory) / "rank1.pt").unlink()
    os.symlink("/etc/passwd", Path(ticket.directory) / "rank1.pt")
    with pytest.raises(parkdirs.ParkDirError, match="not a regular file"):
        sessions.parks.commit(job, body)
    with pytest.raises(ParkConflict, match="no park of session"):
        sessions.parks.commit(job, body)  # its ticket is spent
    mgr.tick()
    assert mgr.get(sid).state == JobState.running  # type: ignore[union-attr]


def test_a_planted_link_is_never_followed(
    mgr: JobManager, sessions: SessionManager, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / ".hora-parked")
    sid = running(mgr, sessions)
    job = mgr.get(sid)
    assert job is not None
    with pytest.raises(parkdirs.ParkDirError, match="a link"):
        sessions.parks.begin(job, ParkBegin())
    assert os.listdir(elsewhere) == []


def test_a_parked_session_ended_by_its_user_or_past_the_retention_loses_its_snapshot(
    tmp_path: Path, rt: ScriptedRuntime
) -> None:
    mgr = manager(tmp_path, rt, session_park_retention_s=60)
    sessions = SessionManager(mgr, mgr.settings)
    kept, ended = running(mgr, sessions), running(mgr, sessions)
    park(mgr, sessions, kept, [1, 1])
    park(mgr, sessions, ended, [1, 1])
    dirs = {s: Path(mgr.get(s).park.directory) for s in (kept, ended)}  # type: ignore[union-attr]
    gone_now = sessions.delete(mgr.get(ended))  # type: ignore[arg-type]
    assert gone_now.reason == "ended by the user; its snapshot was deleted"
    mgr.tick()
    mgr.tick(now=mgr.get(kept).park.parked_at.timestamp() + 5)  # type: ignore[union-attr]
    assert not dirs[ended].exists() and dirs[kept].exists()
    assert mgr.get(ended) is None  # deleted: a 404 from then on
    mgr.tick(now=mgr.get(kept).park.parked_at.timestamp() + 61)  # type: ignore[union-attr]
    mgr.tick(now=mgr.get(kept).park.parked_at.timestamp() + 64)  # type: ignore[union-attr]
    gone = mgr.get(kept)
    assert gone is not None and gone.state == JobState.cancelled
    assert "without a resume" in (gone.reason or "") and not dirs[kept].exists()


def test_another_size_needs_elastic_state(mgr: JobManager, sessions: SessionManager) -> None:
    sid = running(mgr, sessions)
    park(mgr, sessions, sid, [1, 1])
    job = mgr.get(sid)
    assert job is not None
    with pytest.raises(SpecError, match="parked with 2 engines") as err:
        sessions.parks.resume(job, ResumeRequest(connection=CONN, workers=3))  # type: ignore[arg-type]
    assert err.value.field == "workers"
    running_now = running(mgr, sessions)
    with pytest.raises(ParkConflict, match="only a parked session resumes"):
        sessions.parks.resume(mgr.get(running_now), ResumeRequest(connection=CONN))  # type: ignore[arg-type]


def test_a_withdrawn_resume_is_parked_again_with_its_snapshot(
    mgr: JobManager, sessions: SessionManager
) -> None:
    sid = running(mgr, sessions)
    hog = mgr.submit("bob", job_spec(workers=4))
    park(mgr, sessions, sid, [1, 1])
    mgr.tick()
    assert mgr.get(hog.id).state == JobState.running  # type: ignore[union-attr]
    queued = sessions.parks.resume(mgr.get(sid), ResumeRequest(connection=CONN))  # type: ignore[arg-type]
    assert queued.state == JobState.queued
    sessions.parks.withdraw(queued)
    back = mgr.get(sid)
    assert back is not None and back.state == JobState.parked and back.park is not None
    assert back.park.phase == "parked" and Path(back.park.directory).exists()


def test_the_idle_timeout_asks_the_kernel_to_park_and_a_failed_park_stops_it(
    mgr: JobManager, sessions: SessionManager
) -> None:
    sid = running(mgr, sessions)
    sessions.heartbeat(mgr.get(sid), Heartbeat(idle_s=10**4))  # type: ignore[arg-type]
    mgr.tick()
    view = sessions.view(mgr.get(sid))  # type: ignore[arg-type]
    assert view.park_requested is not None and view.park_requested.startswith("idle for")
    record = mgr.get(sid)
    ticket = sessions.parks.begin(record, ParkBegin())  # type: ignore[arg-type]
    sessions.parks.abort(record, ParkAbort(ticket=ticket.ticket, why="over quota"))  # type: ignore[arg-type]
    mgr.tick()
    mgr.tick()
    ended = mgr.get(sid)
    assert ended is not None and ended.state == JobState.cancelled
    reason = ended.reason or ""
    assert "not parked (over quota)" in reason and "slots freed" in reason
    assert not Path(ticket.directory).exists()


def test_a_higher_priority_waiting_job_asks_an_idle_lower_session_to_park(
    tmp_path: Path, rt: ScriptedRuntime
) -> None:
    mgr = manager(tmp_path, rt, session_preempt_idle_s=60)
    sessions = SessionManager(mgr, mgr.settings)
    idle = running(mgr, sessions, workers=2)
    busy = running(mgr, sessions, user="bob", workers=2)
    sessions.heartbeat(mgr.get(idle), Heartbeat(idle_s=120))  # type: ignore[arg-type]
    sessions.heartbeat(mgr.get(busy), Heartbeat(idle_s=0))  # type: ignore[arg-type]
    urgent = mgr.submit("cat", job_spec(workers=2, priority="high"))
    mgr.tick()
    asked = sessions.view(mgr.get(idle)).park_requested  # type: ignore[arg-type]
    assert asked is not None and f"wanted by job {urgent.id} (cat, priority high)" in asked
    assert sessions.view(mgr.get(busy)).park_requested is None  # type: ignore[arg-type]
    sessions.heartbeat(mgr.get(idle), Heartbeat(idle_s=0))  # a cell runs: the ask is dropped
    mgr.tick()
    assert sessions.view(mgr.get(idle)).park_requested is None  # type: ignore[arg-type]


def test_a_running_cell_counts_as_active_until_the_next_heartbeat(
    mgr: JobManager, sessions: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the kernel beats every lease/3 seconds: a cell it said runs must not turn idle in the
    # gap (only the service's eye, the engines' CPU time, may say so)
    sid = running(mgr, sessions)
    used = iter(range(0, 10**6, 100))  # the engines compute: 100 CPU seconds per sample
    monkeypatch.setattr(mgr, "cpu_seconds", lambda job_id: float(next(used)))
    t0 = time.time()
    sessions.heartbeat(mgr.get(sid), Heartbeat(idle_s=0))  # type: ignore[arg-type]
    sessions.check(t0 + 5)
    sessions.check(t0 + 10)  # the service's eye: busy at t0 + 10
    idle = sessions.idle_of(sid, t0 + 20)
    assert idle is not None and idle < 11, idle
    sessions.heartbeat(mgr.get(sid), Heartbeat(idle_s=0.5))  # the cell ended: idle counts
    idle = sessions.idle_of(sid, time.time() + 20)
    assert idle is not None and idle >= 20, idle


def test_without_a_running_session_the_queue_is_not_looked_at_for_preemption(
    tmp_path: Path, rt: ScriptedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every submission wakes a monitor pass; with no session to park, the pass must not sort
    # the whole queue to find a head nobody could make room for
    mgr = manager(tmp_path, rt, session_preempt_idle_s=60)
    SessionManager(mgr, mgr.settings)
    looked: list[float | None] = []
    real = mgr.blocked_head
    monkeypatch.setattr(mgr, "blocked_head", lambda now=None: looked.append(now) or real(now))
    jobs = [mgr.submit("ann", job_spec(workers=2)) for _ in range(3)]
    mgr.tick()
    states = [got.state for j in jobs if (got := mgr.get(j.id)) is not None]
    assert states[0] == JobState.running and JobState.queued in states
    assert looked == []


def test_a_parks_parts_are_flushed_without_following_a_link(tmp_path: Path) -> None:
    where = parkdirs.make(tmp_path, 4, "0123456789abcdef", None)
    (where / "rank0.pt").write_bytes(b"x")
    os.symlink("/etc/passwd", where / "rank1.pt")
    parkdirs.flush(tmp_path, 4, "0123456789abcdef", ["rank0.pt", "rank1.pt", "rank2.pt"])
    assert parkdirs.measure(tmp_path, 4, "0123456789abcdef", ["rank0.pt"]) == {"rank0.pt": 1}
    assert parkdirs.remove(tmp_path, 4) == ["session-4-0123456789abcdef"]
    assert not where.exists() and Path("/etc/passwd").exists()
