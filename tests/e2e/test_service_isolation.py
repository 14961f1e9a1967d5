"""Multi-user mode for real: a job cannot touch the service or another user's job, and no
process outlives its job (issue 7, items 1-3).

A real ``hora serve`` (uvicorn) runs as root in multi-user mode; two hora users get fresh
unprivileged OS accounts (``hora-...``, created with useradd and removed afterwards). A job of
one user tries every attack a hostile user tried against the old service; each must fail.
Jobs that leave children behind (one ignoring SIGTERM, a ``setsid()`` daemon, a plain child)
must lose every one of them on cancel, timeout, success and a cancel after a restart, and
the slot must not be free while any lives.

These tests need root (CI runs as root); without it they fail and say so.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers.checkout import require_reachable
from helpers.service_server import ServiceServer, wait_state
from hora.client_config import save_config
from hora_service import identity
from hora_service.runtimes import containment

pytestmark = pytest.mark.timeout(300)

# the job accounts cannot read the test's own interpreter when it lives under /root
JOB_PY = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
SECRET = f"hora-test-secret-{secrets.token_hex(8)}"

ATTACK = """\
import json, os, signal, sqlite3, sys
args = json.loads(sys.argv[1])
def attempt(name, fn):
    try:
        got = fn()
    except (OSError, sqlite3.Error) as e:
        print("blocked", name, type(e).__name__, flush=True)
    else:
        print("LEAK", name, repr(got)[:200], flush=True)
def read(path):
    with open(path, "rb") as f:
        return f.read()
def insert_admin():
    con = sqlite3.connect(args["db"], timeout=2)
    con.execute("INSERT INTO users (name, token_hash, is_admin, created_at) "
                "VALUES ('evil', 'x', 1, 0)")
    con.commit()
    return "inserted"
def secret_in_env():
    found = [k for k, v in os.environ.items() if args["secret"] in v]
    if found:
        return found
    raise PermissionError("not in this job's environment")
def kill_other():
    os.kill(args["victim_pid"], signal.SIGKILL)
    return "killed"
def forge_exit():
    with open(args["own_exit"], "w") as f:
        f.write("0")
    return "written"
attempt("other-log", lambda: read(args["other_log"]))
attempt("admin-config", lambda: read(args["admin_config"]))
attempt("service-environ", lambda: read(f"/proc/{args['service_pid']}/environ"))
attempt("env-secret", secret_in_env)
attempt("db-read", lambda: read(args["db"]))
attempt("db-insert-admin", insert_admin)
attempt("kill-other-rank", kill_other)
attempt("forge-own-exit", forge_exit)
print("attacks done", flush=True)
sys.exit(3)
"""

VICTIM = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
print("victim secret log line", flush=True)
time.sleep(600)
"""

# three kinds of descendants, then either wait (cancel / timeout) or exit 0 (success)
SPAWNER = """\
import os, pathlib, signal, subprocess, sys, time
out, then = pathlib.Path(sys.argv[1]), sys.argv[2]
stubborn = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
r, w = os.pipe()
if os.fork() == 0:  # a daemon: double fork and a session of its own
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode()); os.close(w)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    os._exit(0)
os.close(w)
daemon = int(os.read(r, 32))
out.write_text(f"{stubborn.pid} {plain.pid} {daemon}")
print("spawned", flush=True)
if then == "exit":
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


@pytest.fixture
def root() -> None:
    if os.geteuid() != 0:
        pytest.fail(
            "these tests run jobs as other OS accounts and need root (CI runs them as root); "
            "run them as root"
        )
    require_reachable()


@pytest.fixture
def base(root: None) -> Iterator[Path]:
    """A world-traversable directory (pytest's tmp is root's alone, which would hide too much)."""
    where = Path(tempfile.mkdtemp(prefix="hora-iso-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def accounts(root: None) -> Iterator[dict[str, int]]:
    """Two hora user names, each with a fresh OS account made by hora's own useradd path."""
    names = [f"iso{secrets.token_hex(3)}{who}" for who in "ab"]
    made: dict[str, int] = {}
    try:
        for name in names:
            made[name] = identity.create_account(name).uid
        yield made
    finally:
        for name in made:
            subprocess.run(
                ["userdel", "--remove", "--force", identity.account_name(name)], capture_output=True
            )


def serve(base: Path, accounts: dict[str, int], **env: str) -> ServiceServer:
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    users = {**{name: False for name in accounts}, "root": True}
    srv = ServiceServer(
        base,
        users=users,
        accounts=accounts,
        cpu_slots=2,
        env={
            "HORA_WORK_ROOT": str(base / "work"),
            "HOME": str(home),
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "HORA_JOB_ENV_PASSTHROUGH": "",
            **env,
        },
    )
    # what `hora up` leaves behind: the admin's token in the service account's ~/.hora/config
    save_config(srv.url, srv.tokens["root"], home / ".hora" / "config")
    return srv


def work_dir(base: Path) -> Path:
    work = base / "work"
    work.mkdir(exist_ok=True)
    work.chmod(0o777)  # jobs of both accounts write their pid files here
    return work


def submit(c: httpx.Client, **body: Any) -> int:
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def wait_file(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text().strip()


def test_a_job_cannot_reach_the_service_or_another_user(
    base: Path, accounts: dict[str, int]
) -> None:
    ann, bob = accounts
    work = work_dir(base)
    (work / "attack.py").write_text(ATTACK)
    (work / "victim.py").write_text(VICTIM)
    with serve(base, accounts) as srv, srv.client(ann) as a, srv.client(bob) as b:
        # the shared work root, not the users' own directories (the default)
        victim = submit(
            b, command=[JOB_PY, "victim.py", str(work / "victim.pid")], working_dir="."
        )
        victim_pid = int(wait_file(work / "victim.pid"))
        assert psutil.Process(victim_pid).uids().real == accounts[bob]
        run_dir = srv.data_dir / "logs" / str(victim)
        args = {
            "other_log": str(run_dir / "1" / "rank0.log"),
            "admin_config": str(base / "service-home" / ".hora" / "config"),
            "service_pid": srv.proc.pid if srv.proc else 0,
            "secret": SECRET,
            "db": str(srv.data_dir / "hora.db"),
            "victim_pid": victim_pid,
            "own_exit": "",  # filled in below once the job id is known
        }
        # its own exit file: the next job id's run dir (ids increase by one)
        args["own_exit"] = str(srv.data_dir / "logs" / str(victim + 1) / "1" / "rank0.exit")
        attacker = submit(
            a,
            command=[JOB_PY, "attack.py", json.dumps(args)],
            working_dir=".",
            env={"PYTHONPATH": str(work)},  # must not reach the shim
        )
        assert attacker == victim + 1
        job = wait_state(a, attacker, ("succeeded", "failed"))
        log = a.get(f"/v1/jobs/{attacker}/logs", params={"rank": 0}).text
        assert "attacks done" in log, log
        assert "LEAK" not in log, log
        blocked = {line.split()[1] for line in log.splitlines() if line.startswith("blocked")}
        assert blocked == {
            "other-log", "admin-config", "service-environ", "env-secret", "db-read",
            "db-insert-admin", "kill-other-rank", "forge-own-exit",
        }, log  # fmt: skip
        # the job's own outcome stands: it exited 3, and that is what was recorded
        assert job["state"] == "failed" and job["exit_codes"] == {"0": 3}, job
        assert wait_state(b, victim, ("running",))["state"] == "running"
        assert psutil.Process(victim_pid).is_running()
        assert a.get(f"/v1/jobs/{victim}").status_code == 404
        with srv.client("root") as admin:
            names = [u for u in admin.get("/v1/jobs").json()["items"]]
            assert {j["user"] for j in names} == {ann, bob}
    # the files stay the service's: data dir, store and logs
    assert (srv.data_dir.stat().st_mode & 0o777) == 0o700
    assert (srv.data_dir / "hora.db").stat().st_mode & 0o077 == 0
    log_file = srv.data_dir / "logs" / str(victim) / "1" / "rank0.log"
    st = log_file.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, _gid(accounts[bob]), 0o640)


def _gid(uid: int) -> int:
    return identity.run_as(uid).gid


def _all_gone(pids: list[int], timeout: float = 0.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["cancel", "timeout", "success", "restart-then-cancel"])
def test_no_descendant_outlives_its_job(base: Path, accounts: dict[str, int], how: str) -> None:
    ann = next(iter(accounts))
    work = work_dir(base)
    (work / "spawner.py").write_text(SPAWNER)
    pid_file = work / f"{how}.pids"
    then = "exit" if how == "success" else "wait"
    body: dict[str, Any] = {
        "command": [JOB_PY, "spawner.py", str(pid_file), then], "working_dir": "."
    }
    if how == "timeout":
        body["timeout_s"] = 3
    with serve(base, accounts, HORA_KILL_GRACE_S="1") as srv, srv.client(ann) as a:
        job_id = submit(a, **body)
        pids = [int(p) for p in wait_file(pid_file).split()]
        assert len(pids) == 3
        if how != "success":
            slots = a.get("/v1/gpus").json()
            assert [s["job_id"] for s in slots].count(job_id) == 1, slots
        if how == "restart-then-cancel":
            srv.crash()
            srv.restart()
            a.post(f"/v1/jobs/{job_id}/cancel")
        elif how == "cancel":
            a.post(f"/v1/jobs/{job_id}/cancel")
        job = wait_state(a, job_id, ("succeeded", "failed", "cancelled"), timeout=60)
        # once the job is over (and its slot free) none of its processes is left
        alive = _all_gone(pids)
        slots = a.get("/v1/gpus").json()
        assert not alive, f"{how}: {alive} outlived job {job_id} ({job['state']})"
        assert all(s["job_id"] is None for s in slots), slots
        expected = {"cancel": "cancelled", "restart-then-cancel": "cancelled"}
        assert job["state"] == expected.get(how, "succeeded" if how == "success" else "failed")


DAEMON = """\
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["cgroup1", "cgroup2", "tag"])
def test_each_containment_kills_a_setsid_daemon(root: None, tmp_path: Path, kind: str) -> None:
    try:
        box = containment.detect(kind, tmp_path).container(1, 1)
    except OSError as e:
        pytest.skip(f"{kind} is not available on this machine: {e}")
    box.create()
    env = {"PATH": "/usr/bin:/bin", containment.TAG_VAR: box.tag}
    join = f"for d in {' '.join(map(str, box.dirs))}; do echo $$ > $d/cgroup.procs; done; "
    proc = subprocess.Popen(
        ["/bin/sh", "-c", join + f"exec {JOB_PY} -c '{DAEMON}'"], env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        while len(box.pids()) < 2:  # the rank and the daemon (its middle parent exits)
            assert time.monotonic() < deadline, box.pids()
            time.sleep(0.05)
        pids = sorted(box.pids())
        assert not box.dirs or not box.remove()  # not while a process is in it
        deadline = time.monotonic() + 10
        while not box.clear():
            assert time.monotonic() < deadline, f"{kind}: {box.pids()} survived"
            time.sleep(0.05)
        assert _all_gone(pids, timeout=5) == []
        assert all(not d.exists() for d in box.dirs)
    finally:
        box.kill()  # never leak a daemon into other tests, whatever failed
        box.remove()
        proc.kill()
        proc.wait(timeout=10)


def hora_user(data_dir: Path, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
    env["HORA_USER_MODE"] = mode
    env["HORA_WORK_ROOT"] = str(data_dir)  # users' working directories: never under ~
    return subprocess.run(
        [sys.executable, "-m", "hora.cli", "user", *args, "--data-dir", str(data_dir)],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_user_add_creates_and_guards_os_accounts(root: None, tmp_path: Path) -> None:
    name = f"iso{secrets.token_hex(3)}c"
    account = identity.account_name(name)
    try:
        done = hora_user(tmp_path, "multi", "add", name)
        assert done.returncode == 0, done.stderr
        uid = identity.run_as(int(re.search(r"uid (\d+)", done.stderr).group(1))).uid  # type: ignore[union-attr]
        assert identity.run_as(uid).user == account
        assert f"{name}  uid={uid}" in hora_user(tmp_path, "multi", "list").stdout
        # the same uid for a second user would let one user touch the other's files
        taken = hora_user(tmp_path, "multi", "add", name + "x", "--uid", str(uid))
        assert taken.returncode == 1 and "already runs the jobs of user" in taken.stderr
        for bad in ("0", str(os.geteuid())):
            refused = hora_user(tmp_path, "multi", "add", name + "y", "--uid", bad)
            assert refused.returncode == 1 and "unprivileged" in refused.stderr
        assert hora_user(tmp_path, "multi", "remove", name).returncode == 0
        # re-adding the name does not silently reuse the account (it may hold the old files)
        again = hora_user(tmp_path, "multi", "add", name)
        assert again.returncode == 1 and f"userdel -r {account}" in again.stderr
        assert len(again.stderr.splitlines()) == 1, again.stderr
    finally:
        subprocess.run(["userdel", "--remove", "--force", account], capture_output=True)


def test_single_user_mode_refuses_a_second_user_with_the_reason(tmp_path: Path) -> None:
    assert hora_user(tmp_path, "single", "add", "ann").returncode == 0
    second = hora_user(tmp_path, "single", "add", "bob")
    assert second.returncode == 1
    assert "single-user mode" in second.stderr and "HORA_USER_MODE=shared" in second.stderr
    assert hora_user(tmp_path, "shared", "add", "bob").returncode == 0


def test_a_removed_users_token_stops_at_the_next_request(tmp_path: Path) -> None:
    from hora_service.manager import JobManager
    from hora_service.settings import Settings

    with ServiceServer(tmp_path) as srv, srv.client("ann") as ann:
        assert ann.get("/v1/jobs").status_code == 200
        other = JobManager(Settings(data_dir=srv.data_dir))  # as `hora user remove` does
        assert other.users.remove("ann")
        other.close_store()
        assert ann.get("/v1/jobs").status_code == 401
        assert ann.post("/v1/jobs", json={"command": ["true"]}).status_code == 401


NOISY = """\
import time
for i in range(20000):
    print(f"line {i:06d}", flush=True)
    if i % 2000 == 0:
        time.sleep(0.3)  # let the follower catch up, so that it is past the cut when it comes
print("END", flush=True)
"""


def test_a_followed_log_past_its_limit_goes_on_after_the_marker(tmp_path: Path) -> None:
    (tmp_path / "noisy.py").write_text(NOISY)
    limit = 1 << 16
    env = {"HORA_LOG_BYTES_PER_ATTEMPT": str(limit)}
    with ServiceServer(tmp_path, env=env) as srv, srv.client("ann") as ann:
        job_id = submit(ann, command=[sys.executable, str(tmp_path / "noisy.py")])
        wait_state(ann, job_id, ("running", "succeeded"))
        text, cur, end = "", "", None
        params = {"follow": "true"}
        with ann.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("event: end"):
                    end = line
                elif line.startswith("data: ") and end is None:
                    cur = json.loads(line[6:])
                    text += cur
                elif line.startswith("data: "):
                    break
        assert end is not None
        assert "[hora: log truncated here" in text and text.endswith("line 019999\nEND\n")
        stored = ann.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text
        assert len(stored.encode()) <= limit and stored.endswith("END\n")
        assert "line 000000" not in stored
