"""The service core without a server: the monitor loop driven by tick(), the store's
migrations, the pure parts of the local runtime, settings and GPU inventory.

The lifecycle tests script what the loop sees: their runtime's ranks report the exit codes
a test sets and record the signals they get (torch elastic's agent tests work this way), so
timeouts, SIGKILL escalation and retry backoff are checked without sleeping. Real processes
run in tests/e2e/test_service_runtime.py and the other service e2e tests.
"""

from __future__ import annotations

import dataclasses
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from hora.errors import HoraError, SpecError
from hora.inventory import detect_gpus, inventory, parse_nvidia_smi, torch_gpus
from hora.spec import JobSpec, JobState
from hora_service import identity, runtimes
from hora_service.identity import RunAs
from hora_service.manager import JobManager
from hora_service.runtimes import AttemptPlan, Exit, RankProcess, Runtime, shim
from hora_service.runtimes.base import RankStatus
from hora_service.runtimes.core import allowed_env, rank_environment
from hora_service.runtimes.local import SHIM, launch_file, rank_argv
from hora_service.settings import Settings
from hora_service.store.db import MIGRATIONS, SCHEMA_VERSION, Store, StoreError, token_hash


class ScriptedRank(RankProcess):
    def __init__(self, rank: int, obeys_term: bool) -> None:
        self.rank = rank
        self.status: RankStatus = Exit.running
        self.signals: list[int] = []
        self.obeys_term = obeys_term

    def poll(self) -> RankStatus:
        return self.status

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.status is Exit.running and (sig == signal.SIGKILL or self.obeys_term):
            self.status = -sig


class ScriptedRuntime(Runtime):
    name = "scripted"

    def __init__(self) -> None:
        self.started: list[tuple[AttemptPlan, list[ScriptedRank]]] = []
        self.obeys_term = True
        self.leftovers = 0  # passes for which processes are left in the attempt's container
        self.clears = 0

    def _clear(self, plan: AttemptPlan) -> bool:
        self.clears += 1
        if self.leftovers > 0:
            self.leftovers -= 1
            return False
        return super()._clear(plan)

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        ranks = [ScriptedRank(r, self.obeys_term) for r in range(plan.spec.workers)]
        self.started.append((plan, ranks))
        return list(ranks)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        ranks = [ScriptedRank(r, self.obeys_term) for r in range(plan.spec.workers)]
        self.started.append((plan, ranks))
        return list(ranks)


@pytest.fixture
def rt() -> ScriptedRuntime:
    return ScriptedRuntime()


@pytest.fixture
def mgr(tmp_path: Path, rt: ScriptedRuntime) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4,
        kill_grace_s=5, retry_backoff_s=2, containment="tag",  # scripted ranks: no processes
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    return m


def spec(**kw: object) -> JobSpec:
    return JobSpec.model_validate({"command": ["python", "train.py"], **kw})


def state(m: JobManager, job_id: int) -> JobState:
    job = m.get(job_id)
    assert job is not None
    return job.state


def test_success_frees_slots_and_records_codes(mgr: JobManager, rt: ScriptedRuntime) -> None:
    job = mgr.submit("ann", spec(workers=2))
    mgr.tick()
    plan, ranks = rt.started[0]
    assert state(mgr, job.id) == JobState.running and plan.slots == (0, 1)
    assert [s.job_id for s in mgr.slots()] == [job.id, job.id, None, None]
    for r in ranks:
        r.status = 0
    mgr.tick()
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.succeeded and done.exit_codes == {0: 0, 1: 0}
    assert [t.state for t in done.transitions] == ["queued", "starting", "running", "succeeded"]
    assert all(s.job_id is None for s in mgr.slots())


def test_one_failed_rank_stops_the_others(mgr: JobManager, rt: ScriptedRuntime) -> None:
    job = mgr.submit("ann", spec(workers=3))
    mgr.tick()
    _, ranks = rt.started[0]
    ranks[1].status = 3
    mgr.tick()  # rank 1 failed: the others get SIGTERM and exit from it
    mgr.tick()
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.failed
    assert done.reason == "rank 1 exited with code 3"
    assert ranks[0].signals == [signal.SIGTERM] and done.exit_codes == {0: -15, 1: 3, 2: -15}


def test_timeout_terminates_and_is_not_retried(mgr: JobManager, rt: ScriptedRuntime) -> None:
    job = mgr.submit("ann", spec(timeout_s=10, max_retries=3))
    mgr.tick()
    _, (rank,) = rt.started[0]
    mgr.tick(now=time.time() + 5)
    assert rank.signals == [] and state(mgr, job.id) == JobState.running
    mgr.tick(now=time.time() + 11)
    assert rank.signals == [signal.SIGTERM]
    mgr.tick(now=time.time() + 11)
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.failed
    assert done.reason == "timed out after 10s" and len(rt.started) == 1


def test_cancel_escalates_to_sigkill_and_holds_slots_until_gone(
    mgr: JobManager, rt: ScriptedRuntime
) -> None:
    rt.obeys_term = False
    job = mgr.submit("ann", spec(workers=2))
    mgr.tick()
    _, ranks = rt.started[0]
    t0 = time.time()
    mgr.cancel(job.id)
    assert all(r.signals == [signal.SIGTERM] for r in ranks)
    mgr.tick(now=t0 + 1)
    assert state(mgr, job.id) == JobState.running  # still stopping: slots stay held
    assert sum(s.job_id == job.id for s in mgr.slots()) == 2
    blocked = mgr.submit("bob", spec(workers=4))
    mgr.tick(now=t0 + 1)
    assert state(mgr, blocked.id) == JobState.queued
    mgr.tick(now=t0 + 6)  # grace of 5 s is over
    assert all(r.signals == [signal.SIGTERM, signal.SIGKILL] for r in ranks)
    mgr.tick(now=t0 + 6)
    assert state(mgr, job.id) == JobState.cancelled
    assert state(mgr, blocked.id) == JobState.running  # the freed slots went to the next job
    assert mgr.cancel(job.id).state == JobState.cancelled  # a no-op now


def test_slots_stay_held_until_no_process_of_the_attempt_is_left(
    mgr: JobManager, rt: ScriptedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    job = mgr.submit("ann", spec(workers=2))
    mgr.tick()
    _, ranks = rt.started[0]
    for r in ranks:
        r.status = 0  # both ranks exited 0, but a daemon of theirs lives on
    rt.leftovers = 10**6
    t0 = time.time()
    for dt in (0, 1, 31, 32):  # clear_timeout_s is 30
        mgr.tick(now=t0 + dt)
        assert state(mgr, job.id) == JobState.running
        assert sum(s.job_id == job.id for s in mgr.slots()) == 2
    assert "stay held until they are gone" in caplog.text
    assert caplog.text.count("stay held") == 1  # reported once, not every pass
    rt.leftovers = 0  # the kill worked at last
    mgr.tick(now=t0 + 40)
    assert state(mgr, job.id) == JobState.succeeded
    assert all(s.job_id is None for s in mgr.slots())


def test_retry_waits_for_backoff_then_starts_next_attempt(
    mgr: JobManager, rt: ScriptedRuntime
) -> None:
    job = mgr.submit("ann", spec(max_retries=2))
    mgr.tick()
    t0 = time.time()
    rt.started[0][1][0].status = 1
    mgr.tick(now=t0)
    first = mgr.get(job.id)
    assert first is not None and first.state == JobState.retrying and first.reason
    assert first.exit_codes == {0: 1}
    mgr.tick(now=t0 + 1.9)
    assert state(mgr, job.id) == JobState.retrying and len(rt.started) == 1
    mgr.tick(now=t0 + 2.1)
    assert state(mgr, job.id) == JobState.running
    assert [p.attempt for p, _ in rt.started] == [1, 2]
    rt.started[1][1][0].status = 1
    t1 = time.time()
    mgr.tick(now=t1)
    mgr.tick(now=t1 + 3.9)  # the second wait is twice as long
    assert len(rt.started) == 2
    mgr.tick(now=t1 + 4.1)
    rt.started[2][1][0].status = 1
    mgr.tick()
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.failed and done.attempt == 3


def test_cancel_of_queued_and_retrying_jobs(mgr: JobManager, rt: ScriptedRuntime) -> None:
    big = mgr.submit("ann", spec(workers=4))
    waiting = mgr.submit("ann", spec(workers=4))
    mgr.tick()
    assert mgr.cancel(waiting.id).state == JobState.cancelled
    assert mgr.metrics().queue_length == 0
    rt.started[0][1][0].status = 1
    mgr.tick()  # rank 0 failed: ranks 1-3 get SIGTERM
    mgr.tick()  # ... and are gone
    assert state(mgr, big.id) == JobState.failed  # max_retries 0
    flaky = mgr.submit("ann", spec(max_retries=1))
    mgr.tick()
    rt.started[1][1][0].status = 1
    mgr.tick()
    assert state(mgr, flaky.id) == JobState.retrying
    assert mgr.cancel(flaky.id).state == JobState.cancelled


def test_submission_checks_name_the_field(
    mgr: JobManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SpecError, match="asks for 6 slots .*has 4") as e:
        mgr.submit("ann", spec(workers=3, gpus_per_worker=2))
    assert e.value.field == "gpus_per_worker"
    with pytest.raises(SpecError, match="outside the work root") as e:
        mgr.submit("ann", spec(working_dir="../.."))
    assert e.value.field == "working_dir"
    with pytest.raises(SpecError, match="not an existing directory"):
        mgr.submit("ann", spec(working_dir="nope"))
    with pytest.raises(SpecError, match="docker") as e:
        mgr.submit("ann", spec(image="pytorch/pytorch"))
    assert e.value.field == "image"
    (tmp_path / "no-slurm").mkdir()
    no_slurm = mgr.settings.model_copy(update={"slurm_bin_dir": tmp_path / "no-slurm"})
    monkeypatch.setattr(mgr.state, "settings", no_slurm)  # a service where Slurm is not installed
    with pytest.raises(SpecError, match="sbatch not found") as e:
        mgr.submit("ann", spec(runtime="slurm"))
    assert e.value.field == "runtime"
    (tmp_path / "proj").mkdir()
    ok = mgr.submit("ann", spec(working_dir="proj"))
    assert mgr.workdir(ok.spec) == tmp_path / "proj"


def test_quota_rejects_impossible_and_queues_over_quota(mgr: JobManager) -> None:
    mgr.users.create("ann", quota=2)
    with pytest.raises(SpecError, match="your quota is 2"):
        mgr.submit("ann", spec(workers=3))
    first = mgr.submit("ann", spec(workers=2))
    second = mgr.submit("ann", spec(workers=1))
    other = mgr.submit("bob", spec(workers=2))
    mgr.tick()
    assert [state(mgr, j.id) for j in (first, second, other)] == [
        JobState.running,
        JobState.queued,  # over ann's quota: waits, and does not block bob
        JobState.running,
    ]


def test_submission_id_is_per_user_and_idempotent(mgr: JobManager) -> None:
    a, created = mgr.submit_or_find("ann", spec(submission_id="x1"))
    again, created_again = mgr.submit_or_find("ann", spec(submission_id="x1"))
    assert (again.id, created, created_again) == (a.id, True, False)
    assert mgr.submit("bob", spec(submission_id="x1")).id != a.id
    assert mgr.list_jobs(None, None, 50, 0)[1] == 2


def test_users_tokens_are_hashed(mgr: JobManager, tmp_path: Path) -> None:
    token = mgr.users.create("ann", admin=True)
    user = mgr.users.for_token(token)
    assert user is not None and user.is_admin and mgr.users.for_token(token + "x") is None
    with pytest.raises(StoreError, match="exists"):
        mgr.users.create("ann")
    with pytest.raises(SpecError):
        mgr.users.create("ann smith")
    raw = b"".join(p.read_bytes() for p in (tmp_path / "data").glob("hora.db*"))  # db + WAL
    assert token.encode() not in raw and token_hash(token).encode() in raw
    assert mgr.users.remove("ann") and mgr.users.for_token(token) is None


def test_a_recreated_name_does_not_inherit_the_old_users_jobs(mgr: JobManager) -> None:
    mgr.users.create("ann")
    old = mgr.submit("ann", spec(submission_id="s1"))
    first = mgr.users.for_token(mgr.users.create("bob"))
    assert mgr.users.remove("ann")
    token = mgr.users.create("ann")
    new = mgr.users.for_token(token)
    assert new is not None and first is not None and new.id > first.id  # ids are never reused
    assert mgr.list_jobs("ann", None, 50, 0) == ([], 0)
    again = mgr.submit("ann", spec(submission_id="s1"))  # the old submission id is free
    assert again.id != old.id and again.user_id == new.id
    assert mgr.get(old.id).user_id != new.id  # type: ignore[union-attr]


def test_single_user_mode_refuses_a_second_user(tmp_path: Path) -> None:
    single = JobManager(Settings(data_dir=tmp_path / "d", user_mode="single", gpus="0"))
    single.users.create("ann")
    with pytest.raises(SpecError, match="HORA_USER_MODE=shared") as e:
        single.users.create("bob")
    assert e.value.field == "name" and "single-user mode" in str(e.value)
    with pytest.raises(SpecError, match="multi-user mode"):
        single.users.create("ann2", uid=4321)
    single.close_store()
    shared = JobManager(Settings(data_dir=tmp_path / "d", user_mode="shared", gpus="0"))
    shared.users.create("bob")  # the admin opted in
    assert [u.name for u in shared.users.all()] == ["ann", "bob"]
    shared.close_store()
    later = JobManager(Settings(data_dir=tmp_path / "d", user_mode="single", gpus="0"))
    with pytest.raises(HoraError, match="has 2 users"):  # no silent downgrade at start
        later.start()
    later.close_store()


def test_multi_user_mode_needs_root_and_a_safe_account(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="needs a service running as root"):
        identity.resolve_mode("multi", euid=1000)
    with pytest.raises(SpecError, match="root"):
        identity.run_as(0)
    with pytest.raises(SpecError, match="service's own account"):
        identity.run_as(1000, service_uid=1000)
    nobody = 65534
    with pytest.raises(SpecError, match="unprivileged"):
        identity.run_as(nobody, service_uid=nobody)
    store = Store(tmp_path / "hora.db")
    store.add_user("ann", "h1", os_uid=nobody)
    with pytest.raises(StoreError, match="already runs the jobs of user 'ann'"):
        store.add_user("bob", "h2", os_uid=nobody)
    store.close()


def test_multi_user_mode_refuses_jobs_of_a_user_without_an_account(tmp_path: Path) -> None:
    mgr = JobManager(Settings(data_dir=tmp_path / "d", gpus="0", containment="tag"))
    mgr.users.mode = "multi"  # what a root service resolves to; no account is created here
    mgr.users.create("ann")
    with pytest.raises(SpecError, match="no OS account") as e:
        mgr.submit("ann", spec())
    assert e.value.field == "user"
    mgr.close_store()


def test_metrics_count_latency_and_slots(mgr: JobManager, rt: ScriptedRuntime) -> None:
    mgr.submit("ann", spec(workers=3))
    mgr.submit("ann", spec(workers=3))
    mgr.tick()
    snap = mgr.metrics()
    assert snap.jobs_by_state == {"running": 1, "queued": 1} and snap.queue_length == 1
    assert (snap.slots_total, snap.slots_allocated, snap.schedule_latency_count) == (4, 3, 1)
    assert snap.schedule_latency_p50_s is not None and snap.schedule_latency_p50_s >= 0


def test_log_paths_are_built_from_integers(mgr: JobManager, tmp_path: Path) -> None:
    path = mgr.log_path(7, 1, 2)
    assert path == tmp_path / "data" / "logs" / "7" / "2" / "rank1.log"
    with pytest.raises(SpecError):
        mgr.log_path(7, -1, 0)


# --- store -----------------------------------------------------------------------------


def test_old_database_is_migrated_in_place(tmp_path: Path) -> None:
    db = tmp_path / "hora.db"
    conn = sqlite3.connect(db)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO users VALUES ('ann', 'h', 1, 0)")
    conn.execute(
        "INSERT INTO jobs (user, spec, state, priority, need, created_at) "
        "VALUES ('ann', '{}', 'succeeded', 1, 1, 0)"
    )
    conn.commit()
    conn.close()
    store = Store(db)
    assert store.migrate() == SCHEMA_VERSION  # already current on a second open
    (user,) = store.users()
    assert (user.name, user.is_admin, user.gpu_quota) == ("ann", True, None)
    with sqlite3.connect(db) as c:  # v3: the job now belongs to ann's stable id
        assert c.execute("SELECT user_id FROM jobs").fetchall() == [(user.id,)]
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()


def test_v5_database_gains_per_user_idle_timeouts(tmp_path: Path) -> None:
    db = tmp_path / "hora.db"
    conn = sqlite3.connect(db)
    for version in range(5):
        for statement in MIGRATIONS[version]:
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    conn.execute(
        "INSERT INTO users (name, token_hash, is_admin, created_at, gpu_quota) "
        "VALUES ('ann', 'h', 0, 0, 3)"
    )
    conn.commit()
    conn.close()
    store = Store(db)
    assert store.migrate() == SCHEMA_VERSION  # v6 added users.idle_timeout_s
    (ann,) = store.users()
    assert (ann.name, ann.gpu_quota, ann.idle_timeout_s) == ("ann", 3, None)
    assert store.set_idle_timeout("ann", 120.0) and not store.set_idle_timeout("bob", 1.0)
    assert store.user_by_digest("h") == ann.model_copy(update={"idle_timeout_s": 120.0})
    bob = store.add_user("bob", token_hash("t"), idle_timeout_s=30.0)
    assert store.user_by_name("bob") == bob and bob.idle_timeout_s == 30.0
    store.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "hora.db"
    with sqlite3.connect(db) as c:
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="upgrade hora"):
        Store(db)


# --- local runtime, pure parts ---------------------------------------------------------

HOSTILE = ["train.py", "--name", "a b", "it's", '"q"', "$(rm -rf /)", "`id`", "x;y|z", "*"]


def plan(tmp_path: Path, kind: str = "gpu", **kw: object) -> AttemptPlan:
    return AttemptPlan(
        job_id=7, attempt=2, spec=spec(command=["python", *HOSTILE], **kw), slots=(4, 5, 6, 7),
        slot_kind=kind, run_dir=tmp_path / "run dir", workdir=tmp_path, master_port=29999,
    )  # fmt: skip


def test_rank_argv_passes_hostile_arguments_verbatim(tmp_path: Path) -> None:
    argv = rank_argv(plan(tmp_path, workers=2, gpus_per_worker=2), 1, python="/py")
    run_dir = str(tmp_path / "run dir")
    # -I: the shim ignores PYTHONPATH and user site dirs, so a job cannot replace its modules
    assert argv == ["/py", "-I", "-S", str(SHIM), run_dir, "1"]
    # the command is in the launch file only: the shim's argv is readable in /proc by anyone
    p = plan(tmp_path, workers=2, gpus_per_worker=2)
    assert launch_file(p, 1, {}).command == ("python", *HOSTILE)


def test_rank_environment_contract(tmp_path: Path) -> None:
    p = plan(tmp_path, workers=2, gpus_per_worker=2, env={"RANK": "99", "SEED": "$(id)"})
    service = {
        "PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "HORA_TOKEN": "s", "HORA_DATA_DIR": "/x",
        "CUDA_VISIBLE_DEVICES": "0", "AWS_SECRET_ACCESS_KEY": "k", "PYTHONPATH": "/svc",
        "LD_PRELOAD": "/x.so", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    base = allowed_env(service, passthrough=["OMP_NUM_THREADS"])
    assert base == {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "OMP_NUM_THREADS": "1"}
    env = rank_environment(p, 1, base)
    assert env["PATH"] == "/bin" and "HORA_TOKEN" not in env and "HORA_DATA_DIR" not in env
    assert not {"AWS_SECRET_ACCESS_KEY", "PYTHONPATH", "LD_PRELOAD"} & set(env)
    assert env["SEED"] == "$(id)"  # the job's env, as given
    world = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"])
    assert world == ("1", "2", "1", "2")  # hora's contract wins over the job's RANK=99
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29999")
    # every rank sees all the job's GPUs (NCCL's CUDA IPC needs that); HORA_SLOTS are its own
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["HORA_SLOTS"] == env["HORA_GPU"] == "6,7"
    assert rank_environment(p, 0, base)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["HORA_RESTART_COUNT"] == "1"
    assert env["HORA_JOB_ID"] == "7" and env["PYTHONUNBUFFERED"] == "1"
    assert rank_environment(plan(tmp_path, "cpu"), 0, {})["CUDA_VISIBLE_DEVICES"] == ""


def test_rank_environment_of_a_job_account(tmp_path: Path) -> None:
    who = RunAs(uid=1234, gid=1234, home=Path("/home/hora-ann"), user="hora-ann")
    p = dataclasses.replace(plan(tmp_path, env={"HOME": "/mine"}), run_as=who)
    env = rank_environment(p, 0, {"HOME": "/root", "USER": "root", "PATH": "/bin"})
    assert (env["USER"], env["LOGNAME"], env["PATH"]) == ("hora-ann", "hora-ann", "/bin")
    assert env["HOME"] == "/mine"  # the job's own env may set its HOME; never the service's
    assert rank_environment(dataclasses.replace(p, spec=spec()), 0, {})["HOME"] == str(who.home)


# --- settings and inventory ------------------------------------------------------------


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HORA_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("HORA_GPUS", " 0, 2 ")
    monkeypatch.setenv("HORA_USER_GPU_QUOTA", "3")
    s = Settings()
    assert s.db_path == tmp_path / "d" / "hora.db" and s.gpus == "0,2" and s.user_gpu_quota == 3


@pytest.mark.parametrize("gpus", ["two", "0,0", "1,-1", "0;1"])
def test_bad_gpu_lists_are_refused(gpus: str) -> None:
    with pytest.raises(ValueError, match="gpus"):
        Settings(gpus=gpus)


def test_inventory() -> None:
    assert [(s.index, s.kind) for s in inventory("2", 5)] == [(0, "gpu"), (1, "gpu")]
    assert [s.kind for s in inventory("0", 3)] == ["cpu"] * 3
    assert [s.index for s in parse_nvidia_smi("0, A100\n1, A100\nNo devices\n")] == [0, 1]


def test_job_cache_never_serves_a_stale_job(mgr: JobManager, rt: ScriptedRuntime) -> None:
    from hora_service.api.jobs import JobList

    job = mgr.submit("ann", spec(workers=2))
    assert mgr.get(job.id).state == JobState.queued  # type: ignore[union-attr]  # now cached
    mgr.tick()
    assert mgr.get(job.id).state == JobState.running  # type: ignore[union-attr]
    items, total = mgr.list_jobs(None, None, 10, 0)
    expected = JobList(items=items, total=total, limit=10, offset=0).model_dump_json()
    assert mgr.list_json(None, None, 10, 0).decode() == expected
    # a read that raced a write must not put what it read into the cache
    mgr.state.forget(job.id)
    store = mgr.open_store()
    read = store.records

    def read_then_write(ids: list[int]) -> dict[int, object]:
        found = read(ids)
        mgr.state.forget(job.id)  # the monitor wrote the job after this read
        return found  # type: ignore[return-value]

    store.records = read_then_write  # type: ignore[method-assign]
    assert mgr.get(job.id) is not None and job.id not in mgr.state.cache
    store.records = read  # type: ignore[method-assign]
    assert mgr.get(job.id) is not None and job.id in mgr.state.cache
    for r in rt.started[0][1]:
        r.status = 0
    mgr.tick()
    assert b'"state":"succeeded"' in mgr.list_json("ann", JobState.succeeded, 10, 0)
    before = mgr.list_jobs(None, None, 10, 0)  # this page is now memoized
    newer = mgr.submit("bob", spec())
    assert mgr.list_jobs(None, None, 10, 0)[1] == before[1] + 1
    assert mgr.list_jobs(None, None, 10, 0)[0][0].id == newer.id
    mgr.cancel(newer.id)
    mgr.delete(newer.id)
    mgr.delete(job.id)
    assert mgr.get(job.id) is None and mgr.list_jobs(None, None, 10, 0) == ([], 0)


@pytest.mark.parametrize(("says", "count"), [("2", 2), ("0", 0), ("not a number", 0)])
def test_torch_fallback_counts_gpus_in_a_child(tmp_path: Path, says: str, count: int) -> None:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho {says}\n")  # stands in for torch on a GPU machine
    fake.chmod(0o755)
    assert [s.name for s in torch_gpus(str(fake))] == [f"cuda:{i}" for i in range(count)]


def test_torch_fallback_only_where_nvidia_devices_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 4\n")
    fake.chmod(0o755)
    assert detect_gpus(str(fake), dev=tmp_path) == []  # no /dev/nvidia*: not asked
    (tmp_path / "nvidia0").touch()
    assert len(detect_gpus(str(fake), dev=tmp_path)) == 4


def test_a_launch_that_fails_is_a_failed_attempt(mgr: JobManager, tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    job = mgr.submit("ann", spec(working_dir="proj", max_retries=0))
    (tmp_path / "proj").rmdir()  # gone between submission and start
    mgr.tick()
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.failed
    assert done.reason is not None and done.reason.startswith("could not start the ranks")
    assert all(s.job_id is None for s in mgr.slots())


def test_a_runtime_gone_at_launch_fails_the_attempt_and_frees_slots(
    mgr: JobManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = mgr.submit("ann", spec(workers=2))
    monkeypatch.setattr(mgr.state, "runtimes", {})
    monkeypatch.setattr(runtimes, "REGISTRY", {})  # e.g. a runtime removed by an upgrade
    mgr.tick()
    done = mgr.get(job.id)
    assert done is not None and done.state == JobState.failed
    assert "is not available here" in (done.reason or "")
    assert all(s.job_id is None for s in mgr.slots())


def test_restart_finishes_a_cancel_that_was_under_way(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "d", work_root=tmp_path, gpus="0", cpu_slots=2, containment="tag"
    )
    before = ScriptedRuntime()
    before.obeys_term = False
    first = JobManager(settings, runtimes={"local": before})
    first.open_store()
    job = first.submit("ann", spec(workers=2))
    first.tick()
    first.cancel(job.id)  # the ranks ignore SIGTERM; then the service dies
    assert first.get(job.id).state == JobState.running  # type: ignore[union-attr]
    first.close_store()
    after = ScriptedRuntime()
    second = JobManager(settings, runtimes={"local": after})
    second.open_store()
    second.recovery.recover()
    _, ranks = after.started[0]
    assert [r.signals for r in ranks] == [[signal.SIGTERM], [signal.SIGTERM]]
    second.tick()
    done = second.get(job.id)
    assert done is not None and done.state == JobState.cancelled and done.attempt == 1


def test_shim_log_keeps_the_newest_half_past_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    log = shim.Log(str(path), 1 << 12)
    log.write(b"a" * 100)
    log.write(b"b" * 10_000)  # one write larger than the whole limit
    body = path.read_bytes()
    assert body == shim.MARK % (1 << 12) + b"b" * 2048 and log.size == len(body)
    log.write(b"c" * 1000)
    body = path.read_bytes()
    assert len(body) <= 1 << 12 and body.endswith(b"b" * 1048 + b"c" * 1000)
    assert body.count(b"[hora: log truncated") == 1 and log.size == len(body)


def test_engines_and_service_find_the_same_gpus_without_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hora.inventory import GpuInfo, visible_gpus

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 2\n")  # stands in for torch on a GPU machine
    fake.chmod(0o755)
    env = {"PATH": str(tmp_path)}
    assert visible_gpus(env, dev=tmp_path, python=str(fake)) == []  # no /dev/nvidia*
    (tmp_path / "nvidia0").touch()
    assert visible_gpus(env, dev=tmp_path, python=str(fake)) == [GpuInfo("0"), GpuInfo("1")]
    assert [s.index for s in detect_gpus(str(fake), dev=tmp_path)] == [0, 1]  # the service's
    env["CUDA_VISIBLE_DEVICES"] = "1"
    assert visible_gpus(env, dev=tmp_path, python=str(fake)) == [GpuInfo("1")]
    env["CUDA_VISIBLE_DEVICES"] = ""
    assert visible_gpus(env, dev=tmp_path, python=str(fake)) == []
