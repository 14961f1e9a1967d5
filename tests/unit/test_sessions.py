"""Sessions in the service without a server: scheduling with jobs, leases, idle culling.

The job manager's monitor loop is driven by ``tick()`` and the session manager's checks by
``check(now)`` with scripted times; the ranks are the scripted ranks of test_service_core
(no processes). Real engines, a real server and notebooks are in tests/e2e/test_sessions*.py.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hora.errors import EngineRunning, HoraError, SpecError
from hora.spec import JobSpec, JobState
from hora_service.manager import JobManager
from hora_service.models import User
from hora_service.sessions.session_manager import (
    CONNECTION_VAR,
    EngineConnection,
    Heartbeat,
    SessionManager,
    SessionRequest,
    effective_idle_timeout,
    session_spec,
)
from hora_service.settings import Settings
from pydantic import ValidationError
from test_service_core import ScriptedRuntime

CONN = {
    "ssh": "",
    "interface": "tcp://127.0.0.1",
    "registration": 40001,
    "control": 40002,
    "mux": 40003,
    "task": 40004,
    "iopub": 40005,
    "hb_ping": 40006,
    "hb_pong": 40007,
    "broadcast": [40008, 40009],
    "key": "0f1e2d3c-aaaa-bbbb-cccc-000000000000",
    "location": "vm",
    "pack": "json",
    "unpack": "json",
    "signature_scheme": "hmac-sha256",
}


def request(**kw: object) -> SessionRequest:
    return SessionRequest.model_validate({"workers": 2, "connection": CONN, **kw})


@pytest.fixture
def rt() -> ScriptedRuntime:
    return ScriptedRuntime()


@pytest.fixture
def mgr(tmp_path: Path, rt: ScriptedRuntime) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4, kill_grace_s=5,
        containment="tag", session_lease_s=30, session_idle_timeout_s=600,
        session_idle_warn_s=60,
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    return m


@pytest.fixture
def sessions(mgr: JobManager) -> SessionManager:
    return SessionManager(mgr, mgr.settings)


def state(m: JobManager, job_id: int) -> JobState:
    job = m.get(job_id)
    assert job is not None
    return job.state


def job(**kw: object) -> JobSpec:
    return JobSpec.model_validate({"command": ["python", "train.py"], **kw})


def test_a_session_is_a_job_of_kind_session_with_the_engines_command(
    mgr: JobManager, sessions: SessionManager, rt: ScriptedRuntime
) -> None:
    s = sessions.create("ann", request())
    mgr.tick()
    record = mgr.get(s.id)
    assert record is not None and record.kind == "session"
    assert record.state == JobState.running and len(record.slots) == 2
    plan, ranks = rt.started[0]
    assert plan.spec.command[1:] == ["-m", "hora.engines._child", "session-engine"]
    assert EngineConnection.model_validate_json(plan.spec.env[CONNECTION_VAR]).registration == (
        40001
    )
    assert plan.spec.env["HORA_BACKEND"] == "gloo"  # CPU slots
    held = {s.index: s.holder_kind for s in mgr.slots() if s.job_id is not None}
    assert sorted(held) == record.slots and set(held.values()) == {"session"}


def test_sessions_and_jobs_share_one_quota(mgr: JobManager, sessions: SessionManager) -> None:
    mgr.users.create("ann", quota=2)
    s = sessions.create("ann", request())
    mgr.tick()
    mine = mgr.submit("ann", job(workers=1))
    other = mgr.submit("bob", job(workers=2))
    mgr.tick()
    assert state(mgr, s.id) == JobState.running
    assert state(mgr, mine.id) == JobState.queued  # ann's session holds her quota
    assert state(mgr, other.id) == JobState.running
    view = sessions.view(mgr.get(mine.id))  # type: ignore[arg-type]
    assert view.queue is not None and "quota" in view.queue.reason
    with pytest.raises(SpecError, match="quota is 2") as err:
        sessions.create("ann", request(workers=3))
    assert err.value.field == "workers"


def test_a_queued_session_sees_its_position_and_who_holds_the_slots(
    mgr: JobManager, sessions: SessionManager, rt: ScriptedRuntime
) -> None:
    running = mgr.submit("bob", job(workers=3, timeout_s=600))
    first = sessions.create("ann", request())
    second = sessions.create("cat", request(workers=3))
    mgr.tick()
    assert state(mgr, running.id) == JobState.running
    a = sessions.view(mgr.get(first.id))  # type: ignore[arg-type]
    b = sessions.view(mgr.get(second.id))  # type: ignore[arg-type]
    assert a.queue is not None and b.queue is not None
    assert (a.queue.position, b.queue.position) == (1, 2)
    assert a.queue.free == 1 and a.queue.need == 2
    (holder,) = a.queue.holders
    assert (holder.kind, holder.id, holder.user) == ("job", running.id, "bob")
    assert a.queue.estimate_at is not None  # the job's timeout says when its slots free up
    rt.started[0][1][0].status = rt.started[0][1][1].status = rt.started[0][1][2].status = 0
    mgr.tick()
    mgr.tick()
    assert state(mgr, first.id) == JobState.running
    b = sessions.view(mgr.get(second.id))  # type: ignore[arg-type]
    assert b.queue is not None and b.queue.position == 1
    assert [(h.kind, h.id) for h in b.queue.holders] == [("session", first.id)]
    assert b.queue.estimate_at is None  # a session has no time limit
    # another user's session: who holds the slots, not how long it has idled (issue 16)
    assert b.queue.holders[0].idle_s is None
    admin = User(name="root", is_admin=True)
    seen = sessions.view(mgr.get(second.id), viewer=admin).queue  # type: ignore[arg-type]
    assert seen is not None and seen.holders[0].idle_s is not None


def test_a_session_never_shares_a_slot_with_a_job(
    mgr: JobManager, sessions: SessionManager
) -> None:
    ids = [sessions.create("ann", request()).id, mgr.submit("bob", job(workers=2)).id]
    ids += [sessions.create("cat", request(workers=1)).id, mgr.submit("dan", job(workers=1)).id]
    mgr.tick()
    held = [s.job_id for s in mgr.slots()]
    assert sorted(h for h in held if h is not None) == sorted(ids[:2] * 2)
    assert state(mgr, ids[2]) == state(mgr, ids[3]) == JobState.queued


def test_a_silent_kernel_loses_its_session_after_the_lease(
    mgr: JobManager, sessions: SessionManager, rt: ScriptedRuntime
) -> None:
    s = sessions.create("ann", request())
    mgr.tick()
    now = time.time()
    sessions.check(now + 20)
    assert state(mgr, s.id) == JobState.running  # within the lease
    sessions.heartbeat(mgr.get(s.id), Heartbeat(idle_s=0))  # type: ignore[arg-type]
    sessions.check(time.time() + 29)
    assert state(mgr, s.id) == JobState.running  # the heartbeat renewed it
    sessions.check(time.time() + 31)
    mgr.tick()
    record = mgr.get(s.id)
    assert record is not None and record.state == JobState.cancelled
    assert record.reason is not None and "stopped heartbeating" in record.reason
    assert all(s.job_id is None for s in mgr.slots())


def test_a_queued_session_whose_kernel_died_leaves_the_queue(
    mgr: JobManager, sessions: SessionManager
) -> None:
    mgr.submit("bob", job(workers=4))
    s = sessions.create("ann", request())
    mgr.tick()
    sessions.check(time.time() + 31)
    assert state(mgr, s.id) == JobState.cancelled


def test_idle_engines_are_warned_then_stopped(mgr: JobManager, sessions: SessionManager) -> None:
    mgr.settings.session_idle_action = "stop"  # the admin's choice (parking: test_parking_service)
    s = sessions.create("ann", request(idle_timeout_s=300))
    mgr.tick()
    record = mgr.get(s.id)
    assert record is not None
    quiet = sessions.heartbeat(record, Heartbeat(idle_s=100))
    assert quiet.warning is None and quiet.idle_s is not None and quiet.idle_s >= 100
    near = sessions.heartbeat(record, Heartbeat(idle_s=280))  # warned 60 s before 300
    assert near.warning is not None and "unless a %%distributed cell runs" in near.warning
    assert near.stop_in_s is not None and near.stop_in_s <= 20
    sessions.check(time.time() + 10)
    assert state(mgr, s.id) == JobState.running
    sessions.check(time.time() + 21)  # within the lease: the idle timeout is what ends it
    mgr.tick()
    ended = sessions.heartbeat(mgr.get(s.id), Heartbeat(idle_s=0))  # type: ignore[arg-type]
    assert ended.state == JobState.cancelled
    assert ended.reason is not None and ended.reason.startswith("idle for")


def test_a_busy_session_is_not_idle(mgr: JobManager, sessions: SessionManager) -> None:
    s = sessions.create("ann", request(idle_timeout_s=300))
    mgr.tick()
    for _ in range(3):
        sessions.heartbeat(mgr.get(s.id), Heartbeat(idle_s=0))  # type: ignore[arg-type]
    sessions.check(time.time() + 29)
    assert state(mgr, s.id) == JobState.running


def test_idle_timeout_is_capped_by_the_admin(mgr: JobManager, tmp_path: Path) -> None:
    capped = Settings(
        data_dir=tmp_path / "d2", work_root=tmp_path, gpus="0", session_idle_timeout_max_s=60
    )
    s = SessionManager(mgr, capped)
    with pytest.raises(SpecError) as err:
        s.create("ann", request(idle_timeout_s=120))
    assert err.value.field == "idle_timeout_s"


@pytest.mark.parametrize(
    ("requested", "user_s", "default_s", "max_s", "expected"),
    [
        (120.0, 900.0, 3600.0, None, 120.0),  # the session's own request wins
        (None, 900.0, 3600.0, None, 900.0),  # else the user's
        (None, None, 3600.0, None, 3600.0),  # else the admin's default
        (None, None, None, None, None),  # no idle timeout at all
        (None, 900.0, 3600.0, 600.0, 600.0),  # the user's, capped by the admin's maximum
        (None, None, 3600.0, 600.0, 600.0),  # the default, capped
        (None, None, None, 600.0, 600.0),  # with a maximum, nothing idles forever
        (300.0, 900.0, 3600.0, 600.0, 300.0),  # a request within the maximum stands
    ],
)
def test_effective_idle_timeout_request_then_user_then_default_capped(
    requested: float | None,
    user_s: float | None,
    default_s: float | None,
    max_s: float | None,
    expected: float | None,
) -> None:
    assert effective_idle_timeout(requested, user_s, default_s, max_s) == expected


@pytest.mark.parametrize("requested", [0.0, -5.0, float("nan"), float("inf"), 1200.0])
def test_effective_idle_timeout_refuses_bad_or_too_long_requests(requested: float) -> None:
    with pytest.raises(SpecError) as err:
        effective_idle_timeout(requested, 900.0, 3600.0, 600.0)
    assert err.value.field == "idle_timeout_s"


def test_a_users_idle_timeout_applies_to_their_new_sessions(
    mgr: JobManager, sessions: SessionManager
) -> None:
    mgr.users.create("cal", idle_timeout_s=45)
    assert sessions.create("cal", request()).idle_timeout_s == 45
    assert sessions.create("cal", request(idle_timeout_s=90)).idle_timeout_s == 90
    assert mgr.users.set_idle_timeout("cal", None)
    assert sessions.create("cal", request()).idle_timeout_s == 600  # the service's default
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(SpecError) as err:
            mgr.users.set_idle_timeout("cal", bad)
        assert err.value.field == "idle_timeout_s"
    with pytest.raises(SpecError):
        mgr.users.create("dee", idle_timeout_s=float("nan"))
    assert not mgr.users.set_idle_timeout("nobody", 60)


def test_deleting_withdraws_a_queued_session(mgr: JobManager, sessions: SessionManager) -> None:
    mgr.submit("bob", job(workers=4))
    s = sessions.create("ann", request())
    mgr.tick()
    gone = sessions.delete(mgr.get(s.id))  # type: ignore[arg-type]
    assert gone.state == JobState.cancelled and gone.reason == "withdrawn by the user"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"interface": "tcp://10.0.0.1"}, "interface"),
        ({"registration": 70000}, "registration"),
        ({"key": "$(rm -rf ~)"}, "key"),
        ({"location": "a b; c"}, "location"),
        ({"pack": "eval"}, "pack"),
        ({"extra": 1}, "extra"),
    ],
)
def test_hostile_connection_info_is_refused(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        request(connection={**CONN, **change})
    assert field in str(err.value)


def test_session_spec_is_an_argument_list_and_an_env() -> None:
    spec = session_spec(request(backend="gloo", timeout_s=12, threads=3), "nccl", "/py")
    assert spec.command == ["/py", "-m", "hora.engines._child", "session-engine"]
    assert spec.env["HORA_BACKEND"] == "gloo" and spec.env["HORA_TIMEOUT"] == "12"
    assert spec.env["OMP_NUM_THREADS"] == "3"
    assert spec.env["HORA_START_TIMEOUT"] == "60"  # the engines' rendezvous waits this long
    assert spec.workers == 2 and spec.timeout_s is None
    boxed = session_spec(request(runtime="docker", image="hora:latest"), "nccl", "/py")
    assert boxed.command[0] == "python" and boxed.image == "hora:latest"  # the image's python


def test_connection_files_match_what_the_controller_writes() -> None:
    from hora.engines.plan import CONNECTION_PORTS, connection_files

    engine, client = connection_files(list(range(41000, 41000 + CONNECTION_PORTS)), "k-1", "vm")
    assert engine["registration"] == client["registration"] == 41000
    assert engine["broadcast"] == [41007, 41008] and client["broadcast"] == 41014
    # the service accepts the engine file as it is
    assert EngineConnection.model_validate(engine).hb_pong == 41006
    ports = [v for k, v in client.items() if k in ("control", "mux", "task", "iopub")]
    assert len(set(ports)) == 4 and not set(ports) & {41001, 41002, 41003, 41004}
    with pytest.raises(SpecError):
        connection_files([1] * CONNECTION_PORTS, "k", "vm")


def test_the_queue_display_names_place_holders_and_estimate() -> None:
    from datetime import UTC, datetime, timedelta

    from hora.engines.session import render_queue
    from hora.spec import SessionInfo

    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    info = SessionInfo.model_validate(
        {
            "id": 14, "user": "ann", "name": "s", "state": "queued", "workers": 1, "slots": [],
            "created_at": now, "lease_s": 30,
            "queue": {
                "position": 2, "need": 1, "free": 0, "reason": "waiting for 1 slot(s); 0 free",
                "estimate_at": now + timedelta(minutes=30),
                "holders": [
                    {"kind": "session", "id": 12, "user": "ann", "slots": [0],
                     "since": now - timedelta(minutes=14), "idle_s": 180},
                    {"kind": "job", "id": 13, "user": "bob", "slots": [1],
                     "since": now - timedelta(seconds=20), "ends_at": now + timedelta(minutes=30)},
                ],
            },
        }
    )  # fmt: skip
    text = render_queue(info, now, waited_s=6)
    assert text.splitlines()[0] == (
        "session 14 queued: position 2; waiting for 1 slot(s); 0 free (waited 6s; Ctrl-C withdraws)"
    )
    assert "session 12 (ann) holds slots 0 since" in text and "(14 min, idle 3 min)" in text
    assert "job 13 (bob) holds slots 1" in text and "ends by" in text
    assert "estimate: slots free by" in text and "(~30 min)" in text
    no_limit = info.model_copy(
        update={"queue": info.queue.model_copy(update={"estimate_at": None})}  # type: ignore[union-attr]
    )
    assert "no estimate: what holds the slots has no time limit" in render_queue(no_limit, now)


@pytest.mark.parametrize(
    ("runtime", "interface", "refused"),
    [
        ("local", "tcp://127.0.0.1", None),
        ("local", "tcp://10.250.0.1", "127.0.0.1 only"),
        ("docker", "tcp://10.250.0.1", "127.0.0.1 only"),
        ("slurm", "tcp://10.250.0.1", None),
        ("slurm", "tcp://127.0.0.1", "loopback"),
        ("slurm", "tcp://localhost", "loopback"),
        ("slurm", "tcp://999.1.1.1", "not an IPv4 address"),
    ],
)
def test_a_controller_off_the_loopback_is_for_slurm_sessions_only(
    runtime: str, interface: str, refused: str | None
) -> None:
    def make() -> SessionRequest:
        return request(runtime=runtime, connection={**CONN, "interface": interface})

    if refused is None:
        assert make().connection.interface == interface
        return
    with pytest.raises(ValidationError) as err:
        make()
    assert "connection.interface" in str(err.value) and refused in str(err.value)


def test_a_slurm_session_whose_controller_is_not_on_this_machine_is_refused(
    sessions: SessionManager,
) -> None:
    far = request(runtime="slurm", connection={**CONN, "interface": "tcp://198.51.100.7"})
    with pytest.raises(SpecError) as err:
        sessions.create("ann", far)
    assert err.value.field == "connection.interface"


def test_a_session_slurm_holds_back_shows_its_reason_in_the_cell() -> None:
    from hora.engines.session import render_queue
    from hora.spec import QueueInfo, SessionInfo

    queue = QueueInfo(position=0, need=4, free=0, holders=[], reason="slurm: Resources")
    now = datetime.now(UTC)
    info = SessionInfo(
        id=7, user="ann", name="s", state="starting", workers=4, slots=[], created_at=now,
        lease_s=30, queue=queue,
    )  # fmt: skip
    text = render_queue(info, now, 40)
    assert text == (
        "session 7 waits in the runtime's queue: slurm: Resources (waited 40s; Ctrl-C withdraws)"
    )


class ReplacingRuntime(ScriptedRuntime):
    """Scripted ranks whose runtime starts one rank again, as the local runtime does."""

    replaces_ranks = True

    def __init__(self) -> None:
        super().__init__()
        self.replaced: list[tuple[int, int]] = []

    def replace_rank(self, plan, rank, base_env, master_port):  # type: ignore[no-untyped-def]
        from test_service_core import ScriptedRank

        self.replaced.append((rank, master_port))
        return ScriptedRank(rank, self.obeys_term)


def test_a_dead_engine_ends_a_session_whose_runtime_cannot_replace_it(
    mgr: JobManager, sessions: SessionManager, rt: ScriptedRuntime
) -> None:
    s = sessions.create("ann", request())
    mgr.tick()
    rt.started[0][1][1].status = -9
    mgr.tick()
    mgr.tick()
    record = mgr.get(s.id)
    assert record is not None and record.state == JobState.failed
    assert record.reason == "rank 1 was killed by SIGKILL"
    with pytest.raises(HoraError, match="not running"):
        mgr.replace_engine(s.id, 1, 40000)


def test_a_dead_engine_keeps_its_slot_until_the_kernel_asks_for_a_new_one(
    tmp_path: Path,
) -> None:
    rt = ReplacingRuntime()
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=3, kill_grace_s=5,
        containment="tag",
    )  # fmt: skip
    mgr = JobManager(settings, runtimes={"local": rt})
    mgr.open_store()
    sessions = SessionManager(mgr, settings)
    s = sessions.create("ann", request(workers=3))
    mgr.tick()
    ranks = rt.started[0][1]
    with pytest.raises(EngineRunning, match="rank 1's engine of session .* is running") as e:
        mgr.replace_engine(s.id, 1, 40000)
    assert e.value.code == "engine_running"  # what the kernel's retry acts on, not the text
    ranks[1].status = -9
    for _ in range(3):
        mgr.tick()
    record = mgr.get(s.id)
    assert record is not None and record.state == JobState.running
    assert [h.job_id for h in mgr.slots()] == [s.id] * 3  # the dead engine's slot is kept
    kept = [t.reason for t in record.transitions if t.reason and "slot is kept" in t.reason]
    assert kept == ["engine rank 1 was killed by SIGKILL; its slot is kept for the new engine "
                    "the notebook asks for"]  # fmt: skip
    with pytest.raises(SpecError, match="rank"):
        mgr.replace_engine(s.id, 3, 40000)
    mgr.replace_engine(s.id, 1, 40001)
    assert rt.replaced == [(1, 40001)]
    mgr.tick()
    assert state(mgr, s.id) == JobState.running
    # the new engine is watched like the first: when every engine is gone the session ends
    for r in (0, 2):
        ranks[r].status = 3
    mgr.tick()
    assert state(mgr, s.id) == JobState.running  # rank 1's new engine still runs
    new = mgr.state.attempts[s.id].ranks[1]  # the runtime's rank, as the monitor sees it
    new.status = 1  # type: ignore[attr-defined]
    for _ in range(3):
        mgr.tick()
    record = mgr.get(s.id)
    assert record is not None and record.state == JobState.failed
    assert record.reason == "rank 0 exited with code 3"
