"""The docker runtime on a real Docker engine, through a real service (uvicorn, SQLite).

One container per attempt holds every rank, started by the rank shim as in ``local``: the
digits example as a 2-rank job from the CLI with per-rank logs; the environment each rank
gets; cancel and timeout (SIGTERM, then the container is removed); the allowed-images policy
(422 on ``image``); a missing image; the engine stopped mid-job; kill -9 of the service with
docker jobs running or finishing, restart, re-adoption. No container is left after the suite.
The engine and the CPU image come from :mod:`helpers.docker_engine` (reused when CI started
them); where no engine can run, these tests fail and say why.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.docker_engine import Engine
from helpers.service_server import ServiceServer, wait_state

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = pytest.mark.timeout(600)
DOCKER_NONE_LEFT = True  # the docker_engine fixture checks no container is left (conftest)

SLEEPER = (
    "import os, time; print('ready', os.environ['RANK'], flush=True); "
    "[time.sleep(0.05) for _ in range(12000)]"
)
SHOW_ENV = (
    "import json, os; keys = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_SIZE', 'MASTER_ADDR', "
    "'HORA_RESTART_COUNT', 'HORA_JOB_ID', 'CUDA_VISIBLE_DEVICES', 'HOME', 'PATH', 'SECRET', "
    "'HORA_SLOTS']; print('ENV', json.dumps({k: os.environ.get(k) for k in keys}), "
    "os.getuid(), os.getcwd(), flush=True)"
)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The jobs' working directory: readable by the unprivileged account the containers use."""
    d = tmp_path / "work"
    (d / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "train_digits.py", d / "examples")
    for p in (d, d / "examples"):
        p.chmod(0o777)
    return d


def server(tmp_path: Path, eng: Engine, **env: str) -> ServiceServer:
    settings = {
        "HORA_DOCKER_HOST": eng.host,
        "HORA_DOCKER_PULL": "never",
        "HORA_DOCKER_SHM_SIZE": "256m",
        "HORA_WORK_ROOT": str(tmp_path / "work"),
        "HORA_JOB_ENV_PASSTHROUGH": "OMP_NUM_THREADS",
        **env,
    }
    return ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=4, env=settings)


def submit(c: httpx.Client, command: list[str], **body: Any) -> int:
    body = {"runtime": "docker", "image": "hora:cpu", "command": command, **body}
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def log_of(c: httpx.Client, job_id: int, rank: int = 0) -> str:
    return c.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank}).text


def wait_log(c: httpx.Client, job_id: int, text: str, rank: int = 0, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := log_of(c, job_id, rank)):
        assert time.monotonic() < deadline, f"{text!r} not in rank {rank}'s log: {log!r}"
        time.sleep(0.1)
    return log


def containers_of(eng: Engine, job_id: int) -> list[Any]:
    return eng.client().containers.list(all=True, filters={"label": f"hora.job={job_id}"})


def wait_no_container(eng: Engine, job_id: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while found := containers_of(eng, job_id):
        assert time.monotonic() < deadline, f"containers of job {job_id} left: {found}"
        time.sleep(0.2)


def test_digits_two_ranks_from_the_cli(docker_engine: Engine, tmp_path: Path, work: Path) -> None:
    with server(tmp_path, docker_engine) as srv:
        env = {k: v for k, v in srv.env.items() if not k.startswith("HORA_")}
        env.update(HORA_URL=srv.url, HORA_TOKEN=srv.tokens["ann"], HORA_CONFIG=str(tmp_path / "x"))
        argv = ["submit", "--image", "hora:cpu", "--workers", "2", "--wait", "--"]
        out = subprocess.run(
            [PY, "-m", "hora.cli", *argv, "python", "examples/train_digits.py", "--epochs", "2"],
            env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "final test accuracy" in out.stdout
        job_id = int(re.search(r"submitted job (\d+)", out.stderr).group(1))  # type: ignore[union-attr]
        with srv.client("ann") as c:
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] == "succeeded" and job["exit_codes"] == {"0": 0, "1": 0}
            assert job["spec"]["image"] == "hora:cpu" and job["spec"]["runtime"] == "docker"
            assert re.fullmatch(r"[0-9a-f]{64}", job["container_id"] or ""), job
            assert "trained on 2 process(es)" in log_of(c, job_id, 0)
            assert "epoch 2/2" in log_of(c, job_id, 0)
        run_dir = srv.data_dir / "logs" / str(job_id) / "1"
        assert (run_dir / "rank1.log").exists()  # each rank has a log of its own (rank 1: quiet)
        assert [(run_dir / f"rank{r}.exit").read_text().strip() for r in (0, 1)] == ["0", "0"]
        wait_no_container(docker_engine, job_id)


def test_each_rank_gets_the_local_contract_as_the_jobs_account(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    with server(tmp_path, docker_engine, SECRET="from-the-service") as srv, srv.client("ann") as c:
        job_id = submit(c, ["python", "-c", SHOW_ENV], workers=2, env={"A": "1"})
        assert wait_state(c, job_id, ("succeeded", "failed"))["state"] == "succeeded"
        for rank in (0, 1):
            line = next(x for x in log_of(c, job_id, rank).splitlines() if x.startswith("ENV"))
            _, payload, uid, cwd = line.split(" ", 1)[0], *line.split(" ", 1)[1].rsplit(" ", 2)
            env = json.loads(payload)
            assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
            assert (env["LOCAL_RANK"], env["LOCAL_SIZE"]) == (str(rank), "2")
            assert env["HORA_RESTART_COUNT"] == "0" and env["HORA_JOB_ID"] == str(job_id)
            assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU slots: no GPU
            assert env["PATH"].startswith("/opt/hora/bin")  # the image's, not the host's
            assert env["SECRET"] is None and env["HOME"] == "/tmp"
            assert uid == "65534" and cwd == str(work)  # unprivileged, in the job's directory


def test_cancel_and_timeout_stop_and_remove_the_container(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    with server(tmp_path, docker_engine) as srv, srv.client("ann") as c:
        cancelled = submit(c, ["python", "-c", SLEEPER], workers=2)
        timed = submit(c, ["python", "-c", SLEEPER], timeout_s=4)
        wait_log(c, cancelled, "ready 1", rank=1)
        c.post(f"/v1/jobs/{cancelled}/cancel")
        job = wait_state(c, cancelled, ("cancelled",), timeout=30)
        assert job["exit_codes"] == {"0": -15, "1": -15}  # SIGTERM reached every rank
        job = wait_state(c, timed, ("failed",), timeout=60)
        assert job["reason"] == "timed out after 4s" and job["exit_codes"] == {"0": -15}
        wait_no_container(docker_engine, cancelled)
        wait_no_container(docker_engine, timed)


def test_image_policy_and_a_missing_image(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    with server(tmp_path, docker_engine) as srv, srv.client("ann") as c:
        r = c.post("/v1/jobs", json={"runtime": "docker", "image": "evil/miner", "command": ["x"]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "image", r.text
        assert "not allowed" in r.json()["detail"][0]["msg"]
        r = c.post("/v1/jobs", json={"runtime": "docker", "command": ["x"]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "image", r.text
        # "Why" #5: names that only looked like hora's, even as tags on this engine
        hora_cpu = docker_engine.client().images.get("hora:cpu")
        evils = ("hora:5000/evil/miner", "hora-evil.example.com:443/evil/miner", "hora-x/miner")
        for evil in evils:
            hora_cpu.tag(evil)
            r = c.post("/v1/jobs", json={"runtime": "docker", "image": evil, "command": ["x"]})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "image", r.text
            docker_engine.client().images.remove(evil)
        # a digest the engine does not have: a 422, not an engine's 500 at start
        bad = "hora:cpu@sha256:" + "0" * 64
        r = c.post("/v1/jobs", json={"runtime": "docker", "image": bad, "command": ["x"]})
        assert r.status_code == 422 and "not on the Docker engine" in r.text, r.text
        r = c.post("/v1/jobs", json={"runtime": "docker", "image": "hora:\x00", "command": ["x"]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "image", r.text
        missing = submit(c, ["python", "-c", "pass"], image="hora:missing")
        job = wait_state(c, missing, ("failed",), timeout=30)
        assert "hora:missing" in job["reason"] and "not on the Docker engine" in job["reason"]
        assert httpx.get(srv.url + "/healthz").status_code == 200
        ok = submit(c, ["python", "-c", "print('fine')"])
        assert wait_state(c, ok, ("succeeded", "failed"))["state"] == "succeeded"


def test_a_failed_pull_fails_the_attempt(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    # if-not-present pulls an image the engine lacks when its pattern names a registry; the
    # registry here is a closed port on the loopback. hora:* names none: never pulled.
    env = {
        "HORA_DOCKER_PULL": "if-not-present",
        "HORA_DOCKER_ALLOWED_IMAGES": "hora:*,localhost:1/*",
    }
    with server(tmp_path, docker_engine, **env) as srv:
        with srv.client("ann") as c:
            job_id = submit(c, ["python", "-c", "pass"], image="localhost:1/hora:not-anywhere")
            job = wait_state(c, job_id, ("failed",), timeout=120)
            assert "cannot pull image 'localhost:1/hora:not-anywhere'" in job["reason"], job
            assert "500 Server Error" not in job["reason"], job["reason"]
            local = submit(c, ["python", "-c", "pass"], image="hora:not-anywhere")
            job = wait_state(c, local, ("failed",), timeout=60)
            assert "names no registry: such images are never pulled" in job["reason"], job


def test_kill_9_of_the_service_then_restart_readopts_and_reaps(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    gate = work / "gate"
    loop = (
        "import os, pathlib, time\n"
        f"gate = pathlib.Path({str(gate)!r})\n"
        "i = 0\n"
        "while not gate.exists():\n"
        "    print('tick', i, flush=True); i += 1; time.sleep(0.05)\n"
        "print('released', flush=True)\n"
    )
    srv = server(tmp_path, docker_engine)
    with srv:
        with srv.client("ann") as c:
            adopted = submit(c, ["python", "-c", loop], workers=2)
            ends = submit(c, ["python", "-c", "import time; time.sleep(3); raise SystemExit(3)"])
            wait_log(c, adopted, "tick 5", rank=1)
            wait_state(c, ends, ("running",))
            box = c.get(f"/v1/jobs/{adopted}").json()["container_id"]
        srv.crash()
        time.sleep(4)  # `ends` finishes while the service is down
        before = (srv.data_dir / "logs" / str(adopted) / "1" / "rank0.log").stat().st_size
        srv.restart()
        with srv.client("ann") as c:
            job = wait_state(c, ends, ("failed",), timeout=30)
            assert job["exit_codes"] == {"0": 3} and job["reason"] == "rank 0 exited with code 3"
            job = c.get(f"/v1/jobs/{adopted}").json()
            assert job["state"] == "running" and job["container_id"] == box
            deadline = time.monotonic() + 30
            while len(log_of(c, adopted, 0).encode()) < before + 200:  # still flowing
                assert time.monotonic() < deadline, "the adopted job's log stopped growing"
                time.sleep(0.1)
            gate.write_text("go")
            job = wait_state(c, adopted, ("succeeded", "failed"), timeout=30)
            assert job["state"] == "succeeded" and job["exit_codes"] == {"0": 0, "1": 0}
            assert "released" in log_of(c, adopted, 1)
        wait_no_container(docker_engine, adopted)
        wait_no_container(docker_engine, ends)


def test_engine_stopped_mid_job_fails_the_attempt_and_the_service_keeps_serving(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    with server(tmp_path, docker_engine) as srv, srv.client("ann") as c:
        running = submit(c, ["python", "-c", SLEEPER])
        wait_log(c, running, "ready 0")
        docker_engine.stop()
        try:
            job = wait_state(c, running, ("failed",), timeout=60)
            assert "rank 0" in job["reason"], job["reason"]
            refused = submit(c, ["python", "-c", "pass"])
            job = wait_state(c, refused, ("failed",), timeout=60)
            assert "Docker engine" in job["reason"], job["reason"]
            assert httpx.get(srv.url + "/healthz").status_code == 200
        finally:
            docker_engine.start()
        after = submit(c, ["python", "-c", "print('back')"])
        assert wait_state(c, after, ("succeeded", "failed"))["state"] == "succeeded"
        wait_no_container(docker_engine, running)  # removed by the next start


LISTENER = """\
import pathlib, socket, sys, time
work = pathlib.Path(sys.argv[1])
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
s.settimeout(0.1)
(work / "docker.port.tmp").write_text(str(s.getsockname()[1]))
(work / "docker.port.tmp").rename(work / "docker.port")  # whole: the test reads it at once
came = 0
deadline = time.monotonic() + 60
while not (work / "docker.stop").exists() and time.monotonic() < deadline:
    try:
        s.accept()[0].close()
        came += 1
    except socket.timeout:
        pass
print("connections", came, flush=True)
"""


def test_a_docker_jobs_ports_are_its_own(docker_engine: Engine, tmp_path: Path, work: Path) -> None:
    """Issue 16: a job's listener (its rendezvous store, gloo) is on the container's own
    loopback (``--network none``): neither the host nor another job can connect to it."""
    (work / "listen.py").write_text(LISTENER)
    with server(tmp_path, docker_engine) as srv, srv.client("ann") as c:
        job_id = submit(c, ["python", "listen.py", str(work)])
        deadline = time.monotonic() + 60
        while not (work / "docker.port").exists():
            assert time.monotonic() < deadline, log_of(c, job_id)
            time.sleep(0.1)
        port = int((work / "docker.port").read_text())
        with pytest.raises(ConnectionRefusedError):  # from the host, as root
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        other = submit(c, ["python", "-c", probe])  # another job, in its own container
        assert wait_state(c, other, ("succeeded", "failed"))["state"] == "failed"
        assert "ConnectionRefusedError" in log_of(c, other)
        (work / "docker.stop").write_text("1")
        assert wait_state(c, job_id, ("succeeded", "failed"))["state"] == "succeeded"
        assert "connections 0" in log_of(c, job_id)
        wait_no_container(docker_engine, job_id)


FILL = (
    "import errno, os\n"
    "for d in ('/tmp', '/var/tmp'):\n"
    "    open(os.path.join(d, 'small'), 'wb').write(b'x' * (2 << 20))\n"
    "    try:\n"
    "        with open(os.path.join(d, 'big'), 'wb') as f:\n"
    "            for _ in range(16):\n"
    "                f.write(b'x' * (1 << 20)); f.flush()\n"
    "        print('LEAK unlimited', d, flush=True)\n"
    "    except OSError as e:\n"
    "        print('full', d, errno.errorcode.get(e.errno), flush=True)\n"
)


def test_job_disk_limit_bounds_a_containers_tmp(
    docker_engine: Engine, tmp_path: Path, work: Path
) -> None:
    """No disk limit per job (the red team): with job_disk_limit the container's /tmp (its
    HOME) and /var/tmp are tmpfs of that size; 2 MiB fit, 16 more are ENOSPC."""
    with server(tmp_path, docker_engine, HORA_JOB_DISK_LIMIT="8m") as srv, srv.client("ann") as c:
        job_id = submit(c, ["python", "-c", FILL])
        state = wait_state(c, job_id, ("succeeded", "failed"))["state"]
        got = log_of(c, job_id)
    assert state == "succeeded", got
    assert [x for x in got.splitlines() if x.startswith(("full", "LEAK"))] == [
        "full /tmp ENOSPC",
        "full /var/tmp ENOSPC",
    ], got
    wait_no_container(docker_engine, job_id)
