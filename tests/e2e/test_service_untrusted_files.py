"""A job cannot make the service read, wait on or believe a file it plants (issue 16, item 2).

The reproductions of "Why" #2 (a rank swaps its log for a symlink to ``hora.db`` and reads it
through ``GET /logs``), #3 (a rank replaces its exit file with a FIFO: the monitor froze, across
restarts) and #7 (a docker rank writes ``0`` into its exit file and is recorded "succeeded"):

* as a hostile multi-user job, in both runtimes: every plant is refused by the kernel (the run
  directory is the service's; in docker the container's init and shims are the container's
  root, the ranks the job's account), and the job's outcome is what its command returned;
* with the plant made anyway (a job that runs as the service's account in shared mode does
  it itself; in docker the test plants it, as a job could before): the service refuses to
  read it, the job fails with a reason naming the file, other users' jobs, ``/v1/gpus`` and
  the monitor go on, before and after kill -9 and a restart of the service.

A real ``hora serve`` as root; job accounts made by hora's own useradd path; the docker tests
use the engine and ``hora:cpu`` of :mod:`helpers.docker_engine` (never skipped).
"""

from __future__ import annotations

import glob
import json
import os
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
import pytest
from helpers.docker_engine import Engine
from helpers.service_server import ServiceServer, wait_state
from hora_service import identity
from hora_service.runtimes.containment import instance_id

pytestmark = pytest.mark.timeout(300)

JOB_PY = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

# each rank tries to redirect or forge what the service reads, then exits 7
PLANT = """\
import json, os, sys, time
args = json.loads(sys.argv[1])
run, rank = args["run_dir"], os.environ["RANK"]
def attempt(name, fn):
    try:
        fn()
    except OSError as e:
        print("blocked", name, type(e).__name__, flush=True)
    else:
        print("PLANTED", name, flush=True)
def swap_log():
    os.unlink(f"{run}/rank{rank}.log")
    os.symlink(args["target"], f"{run}/rank{rank}.log")
def forge_exit():
    with open(f"{run}/rank{rank}.exit", "w") as f:
        f.write("0")
if rank == "1":
    attempt("log-symlink", swap_log)
    attempt("exit-fifo", lambda: os.mkfifo(f"{run}/rank1.exit"))
else:
    attempt("forge-exit", forge_exit)
print("attempts done", flush=True)
open(f"{args['barrier']}.{rank}", "w").close()  # both ranks have tried before either ends
deadline = time.monotonic() + 60
while not all(os.path.exists(f"{args['barrier']}.{r}") for r in "01"):
    assert time.monotonic() < deadline, "the other rank never got here"
    time.sleep(0.05)
time.sleep(args.get("linger", 1))  # a forged exit file would be read meanwhile
sys.exit(7)
"""


@pytest.fixture
def root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests run jobs as other OS accounts and need root (CI runs as root)")


@pytest.fixture
def base(root: None) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="hora-trust-"))
    where.chmod(0o755)
    work = where / "work"
    work.mkdir()
    work.chmod(0o777)
    (work / "plant.py").write_text(PLANT)
    (work / "plant.py").chmod(0o644)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def accounts(root: None) -> Iterator[dict[str, int]]:
    names = [f"tru{secrets.token_hex(3)}{who}" for who in "ab"]
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


def serve(base: Path, accounts: dict[str, int] | None, **env: str) -> ServiceServer:
    users = {**{name: False for name in (accounts or {"ann": 0, "bob": 0})}, "root": True}
    return ServiceServer(
        base, users=users, accounts=accounts, cpu_slots=4,
        env={"HORA_WORK_ROOT": str(base / "work"), **env},
    )  # fmt: skip


def docker_env(eng: Engine) -> dict[str, str]:
    return {
        "HORA_DOCKER_HOST": eng.host, "HORA_DOCKER_PULL": "never", "HORA_DOCKER_SHM_SIZE": "64m"
    }  # fmt: skip


def submit(c: httpx.Client, **body: Any) -> int:
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def plant_body(srv: ServiceServer, job_id: int, runtime: str, linger: float = 1) -> dict[str, Any]:
    args = {
        "run_dir": str(srv.data_dir / "logs" / str(job_id) / "1"),
        "target": str(srv.data_dir / "hora.db"),
        "linger": linger,
        "barrier": str(srv.data_dir.parent / "work" / f"barrier-{job_id}"),
    }
    py = "python" if runtime == "docker" else JOB_PY
    body: dict[str, Any] = {
        "command": [py, "plant.py", json.dumps(args)], "workers": 2,
        "working_dir": ".",  # the shared work root, not the user's own directory (the default)
    }  # fmt: skip
    if runtime == "docker":
        body.update(runtime="docker", image="hora:cpu")
    return body


def next_id(c: httpx.Client) -> int:
    items = c.get("/v1/jobs", params={"limit": 1}).json()["items"]
    return (items[0]["id"] if items else 0) + 1


def logs(c: httpx.Client, job_id: int, rank: int) -> str:
    return c.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank}).text


def check_hostile_job_is_refused(srv: ServiceServer, ann: str, runtime: str) -> None:
    with srv.client("root") as admin, srv.client(ann) as a:
        job_id = next_id(admin)
        assert submit(a, **plant_body(srv, job_id, runtime)) == job_id
        job = wait_state(a, job_id, ("succeeded", "failed"), timeout=120)
        out = logs(a, job_id, 0) + logs(a, job_id, 1)
        assert "PLANTED" not in out and out.count("attempts done") == 2, out
        blocked = {line.split()[1] for line in out.splitlines() if line.startswith("blocked")}
        assert blocked == {"log-symlink", "exit-fifo", "forge-exit"}, out
        # what the commands returned, not what they wrote ("Why" #7): 7, or SIGTERM for the
        # rank still ending when the other's 7 stopped the attempt
        codes = job["exit_codes"]
        assert job["state"] == "failed" and set(codes.values()) <= {7, -15}, job
        assert 7 in codes.values(), job
        assert "SQLite format" not in out  # the log route never served hora.db ("Why" #2)
    run_dir = srv.data_dir / "logs" / str(job_id) / "1"
    for name in ("rank0.exit", "rank1.exit", "rank1.log"):
        st = (run_dir / name).lstat()
        assert (st.st_uid, oct(st.st_mode)[:-3]) == (0, "0o100"), name  # the shim's, regular


def test_a_hostile_local_job_cannot_plant_in_its_run_directory(
    base: Path, accounts: dict[str, int]
) -> None:
    with serve(base, accounts) as srv:
        check_hostile_job_is_refused(srv, next(iter(accounts)), "local")


def test_a_hostile_docker_job_cannot_plant_or_forge_its_exit(
    base: Path, accounts: dict[str, int], docker_engine: Engine
) -> None:
    with serve(base, accounts, **docker_env(docker_engine)) as srv:
        check_hostile_job_is_refused(srv, next(iter(accounts)), "docker")
        # the container is the attempt's cgroup: hora makes none of its own ("Why" #9)
        instance = instance_id(srv.data_dir)
        found = glob.glob(f"/sys/fs/cgroup/*/hora/{instance}/*-*")
        found += glob.glob(f"/sys/fs/cgroup/hora/{instance}/*-*")
        left = [d for d in found if os.path.isdir(d)]  # <job>-<attempt> directories
        assert not left, left


def wait_planted_reason(c: httpx.Client, job_id: int, name: str) -> dict[str, Any]:
    job = wait_state(c, job_id, ("failed",), timeout=60)
    assert name in job["reason"] and "the service did not read it" in job["reason"], job
    return job


def others_unaffected(srv: ServiceServer, user: str, runtime: str) -> None:
    """Another user's job runs to the end and the read-only routes answer at once."""
    with srv.client(user, timeout=10) as c:
        assert len(c.get("/v1/gpus").json()) == 4
        body: dict[str, Any] = {"command": ["python", "-c", "print('fine')"]}
        if runtime == "docker":
            body.update(runtime="docker", image="hora:cpu")
        else:
            body["command"][0] = JOB_PY
        ok = submit(c, **body)
        assert wait_state(c, ok, ("succeeded", "failed"), timeout=60)["state"] == "succeeded"


def test_planted_files_in_shared_mode_are_refused_across_a_restart(base: Path) -> None:
    # shared mode: jobs run as the service's own account and can write their run directory
    with serve(base, None) as srv, srv.client("ann") as a:
        job_id = next_id(a)
        submit(a, **plant_body(srv, job_id, "local", linger=600))
        run_dir = srv.data_dir / "logs" / str(job_id) / "1"
        deadline = time.monotonic() + 60
        while not ((run_dir / "rank1.log").is_symlink() and (run_dir / "rank1.exit").exists()):
            assert time.monotonic() < deadline, "the planting job never planted"
            time.sleep(0.1)
        # the log is a symlink now: refused, never followed ("Why" #2)
        r = a.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1})
        assert r.status_code == 409 and "rank1.log" in r.json()["detail"], r.text
        assert "symbolic link" in r.json()["detail"]
        srv.crash()  # kill -9: the new service re-adopts the ranks and reads rank1.exit
        srv.restart()
        with srv.client("ann", timeout=10) as again:
            job = wait_planted_reason(again, job_id, "rank")
            assert "rank1.exit" in job["reason"] or "rank0.exit" in job["reason"], job
        others_unaffected(srv, "bob", "local")


def test_a_fifo_planted_in_a_docker_run_directory_freezes_nothing(
    base: Path, docker_engine: Engine
) -> None:
    with serve(base, None, **docker_env(docker_engine)) as srv, srv.client("ann") as a:
        sleeper = "import time; print('up', flush=True); time.sleep(600)"
        job_id = submit(a, command=["python", "-c", sleeper], runtime="docker", image="hora:cpu")
        deadline = time.monotonic() + 60
        while "up" not in logs(a, job_id, 0):
            assert time.monotonic() < deadline, "the docker job never started"
            time.sleep(0.1)
        srv.crash()
        # what a rank did before the run directory was the service's ("Why" #3)
        os.mkfifo(srv.data_dir / "logs" / str(job_id) / "1" / "rank0.exit")
        srv.restart()
        with srv.client("ann", timeout=10) as again:
            wait_planted_reason(again, job_id, "rank0.exit in the run directory is a named pipe")
        others_unaffected(srv, "bob", "docker")
