"""Private by default and bounded, in the docker runtime (issue 16, items 3 and 5).

A real ``hora serve`` as root in multi-user mode with a real Docker engine and ``hora:cpu``
(:mod:`helpers.docker_engine`, never skipped): a ``working_dir`` only another account can
reach is a 422 (the bind mount would otherwise hand the container a directory its account
could never enter on the host); a job without one runs in the user's own directory, with
umask 077, in a container whose memory, pids and CPU share are set; a job allocating past
its memory limit is killed, and one forking past its pids limit fails, each with a reason
naming the limit.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.docker_engine import Engine
from helpers.service_server import ServiceServer, wait_state
from hora_service import identity

pytestmark = pytest.mark.timeout(600)
DOCKER_NONE_LEFT = True  # the docker_engine fixture checks no container is left (conftest)

DONE = ("succeeded", "failed", "cancelled")
WAIT = (
    "import os, sys, time\n"
    "open('out.txt', 'w').write('mine')\n"
    "print('umask', oct(os.umask(0)), 'cwd', os.getcwd(), flush=True)\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
)
ALLOCATE = "chunks = [b'x' * (64 << 20) for _ in range(16)]"


@pytest.fixture(scope="module")
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests run jobs as other OS accounts and need root (CI runs as root)")


@pytest.fixture
def world(
    as_root: None, docker_engine: Engine
) -> Iterator[tuple[ServiceServer, Path, dict[str, int]]]:
    base = Path(tempfile.mkdtemp(prefix="hora-private-docker-"))
    base.chmod(0o755)
    work = base / "work"
    work.mkdir(mode=0o755)
    names = [f"pd{secrets.token_hex(3)}{who}" for who in "ab"]
    made: dict[str, int] = {}
    try:
        for name in names:
            made[name] = identity.create_account(name).uid
        env = {
            "HORA_WORK_ROOT": str(work),
            "HORA_DOCKER_HOST": docker_engine.host,
            "HORA_DOCKER_PULL": "never",
            "HORA_DOCKER_SHM_SIZE": "64m",
            "HORA_JOB_MEMORY_LIMIT": "256m",
            "HORA_JOB_PIDS_LIMIT": "500",
            "HORA_JOB_ENV_PASSTHROUGH": "",
        }
        users = {**{n: False for n in names}, "root": True}
        with ServiceServer(base, users, cpu_slots=2, env=env, accounts=made) as srv:
            yield srv, work, made
    finally:
        for name in made:
            subprocess.run(
                ["userdel", "--remove", "--force", identity.account_name(name)], capture_output=True
            )
        shutil.rmtree(base, ignore_errors=True)


def docker_job(command: list[str], **body: Any) -> dict[str, Any]:
    return {"runtime": "docker", "image": "hora:cpu", "command": command, **body}


def test_working_dir_only_another_account_reaches_is_a_422(
    world: tuple[ServiceServer, Path, dict[str, int]],
) -> None:
    srv, work, accounts = world
    ann, bob = accounts
    who = identity.run_as(accounts[ann])
    proj = work / "apriv" / "proj"
    proj.mkdir(parents=True)
    (proj / "data.txt").write_text("ann's data")
    for p in (proj.parent, proj, proj / "data.txt"):
        os.chown(p, who.uid, who.gid)
    proj.parent.chmod(0o700)
    read = ["python", "-c", "print(open('data.txt').read())"]
    with srv.client(bob) as b, srv.client(ann) as a:
        r = b.post("/v1/jobs", json=docker_job(read, working_dir="apriv/proj"))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"][0]
        assert detail["loc"][-1] == "working_dir" and str(proj) in detail["msg"], detail
        r = a.post("/v1/jobs", json=docker_job(read, working_dir="apriv/proj"))
        assert r.status_code == 201, r.text
        job = wait_state(a, r.json()["id"], DONE, timeout=120)
        log = a.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
        assert job["state"] == "succeeded" and "ann's data" in log, (job, log)


def test_a_container_runs_in_the_users_directory_within_its_limits(
    docker_engine: Engine, world: tuple[ServiceServer, Path, dict[str, int]]
) -> None:
    srv, work, accounts = world
    ann, bob = accounts
    release = work / ann / "release"  # in the container: only the working dir is mounted
    with srv.client(ann) as a, srv.client(bob) as b:
        job_id = int(a.post("/v1/jobs", json=docker_job(["python", "-c", WAIT, str(release)]))
                     .json()["id"])  # fmt: skip
        wait_state(a, job_id, ("running",), timeout=120)
        deadline = time.monotonic() + 60
        while "umask" not in (log := a.get(f"/v1/jobs/{job_id}/logs").text):
            assert time.monotonic() < deadline, log
            time.sleep(0.1)
        own = work / ann
        assert f"umask 0o77 cwd {own}" in log, log
        found = docker_engine.client().containers.list(filters={"label": f"hora.job={job_id}"})
        host = found[0].attrs["HostConfig"]
        assert (host["Memory"], host["MemorySwap"], host["PidsLimit"]) == (256 << 20,) * 2 + (500,)
        assert host["CpuShares"] == 1024, host
        release.touch()
        assert wait_state(a, job_id, DONE, timeout=120)["state"] == "succeeded"
        out = own / "out.txt"
        assert (out.stat().st_uid, out.stat().st_mode & 0o777) == (accounts[ann], 0o600)
        # bob's container is killed at the memory limit, and the reason says so
        r = b.post("/v1/jobs", json=docker_job(["python", "-c", ALLOCATE]))
        job = wait_state(b, r.json()["id"], DONE, timeout=120)
        assert job["state"] == "failed", job
        assert "the memory limit (256 MiB per attempt)" in job["reason"], job


FORKS = """\
import os
n = 0
try:
    while n < 1500:
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "60"])
        n += 1
except OSError as e:
    print(f"fork failed after {n} processes: {e}", flush=True)
    raise SystemExit(1)
print(f"forked {n} processes", flush=True)
"""


def test_a_container_forking_past_its_pids_limit_fails_naming_the_limit(
    world: tuple[ServiceServer, Path, dict[str, int]],
) -> None:
    """As in the local runtime: the container's pids limit stops the forks, and the job's
    reason names it (read from the container's cgroup before the container is removed)."""
    srv, _, accounts = world
    ann, _ = accounts
    with srv.client(ann) as a:
        r = a.post("/v1/jobs", json=docker_job(["python", "-c", FORKS]))
        assert r.status_code == 201, r.text
        job = wait_state(a, r.json()["id"], DONE, timeout=180)
        log = a.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
    assert job["state"] == "failed", (job, log)
    assert "fork failed after" in log and "Resource temporarily unavailable" in log, log
    assert int(log.split("fork failed after ")[1].split()[0]) < 500, log
    assert "pids limit (500 processes and threads per attempt)" in job["reason"], job
    # the engine removes the container's cgroup once its init exits (often before the service
    # reads it): the init recorded the counters on its way out
    recorded = list(srv.data_dir.rglob(f"logs/{job['id']}/*/container.hits"))
    assert len(recorded) == 1, recorded
    assert json.loads(recorded[0].read_text())["pids_max"] >= 1, recorded[0].read_text()
