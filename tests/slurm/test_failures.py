"""``runtime: slurm`` when things go wrong, on the real cluster: kill -9 of the service and
re-adoption (never a second submission), USR2 preemption mapped to a retry, Slurm's pending
reason on a queued job, and clear errors when slurmctld is down or a node cannot see the job's
directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state
from helpers.slurm_cluster import Cluster, slurm_env
from helpers.slurm_jobs import SLEEPER, log, submit, wait_ready

PY = sys.executable
pytestmark = pytest.mark.timeout(180)

PREEMPTIBLE = """\
import os, pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)
rank, restart = os.environ["RANK"], os.environ["HORA_RESTART_COUNT"]
if restart != "0":
    print("attempt", restart, "resumes", flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR2, lambda *a: (d / f"usr2-{rank}").write_text("checkpointed"))
(d / rank).write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def server(slurm: Cluster, tmp_path: Path) -> Iterator[ServiceServer]:
    with ServiceServer(tmp_path, env=slurm_env(slurm)) as srv:
        yield srv
    slurm.wait_idle()


def slurm_id(c: httpx.Client, job_id: int) -> str:
    return str(c.get(f"/v1/jobs/{job_id}").json()["container_id"]).removeprefix("slurm:")


def names(slurm: Cluster) -> list[str]:
    """Job names of every batch job Slurm ran or runs (jobcomp has the finished ones)."""
    done = (slurm.dir / "log" / "jobcomp.txt").read_text(errors="replace").split()
    running = slurm.run("squeue", "-h", "-o", "%j").split()
    return [w.removeprefix("Name=") for w in done if w.startswith("Name=")] + running


def test_kill_9_of_the_service_re_adopts_the_slurm_job_and_never_submits_twice(
    server: ServiceServer, slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    ready = tmp_path / "ready"
    with server.client("ann") as c:
        job_id = submit(c, [PY, str(script), str(ready)], workers=4)
        wait_ready(ready, 4)
        first = slurm_id(c, job_id)
    server.crash()
    assert slurm.queue() == [first]  # the job runs on without the service
    server.restart()
    with server.client("ann") as c:
        assert wait_state(c, job_id, ("running",))["container_id"] == f"slurm:{first}"
        time.sleep(1.0)  # a few monitor passes of the new service
        assert slurm.queue() == [first]
        (ready / "release").write_text("")
        job = wait_state(c, job_id, ("succeeded", "failed", "cancelled"), timeout=30)
        assert job["state"] == "succeeded" and job["attempt"] == 1, job
        assert all("released" in log(c, job_id, r) for r in range(4))
    mine = [n for n in names(slurm) if n.endswith(f"-{job_id}.1")]
    assert len(mine) == 1, names(slurm)


def test_usr2_reaches_the_ranks_and_a_preemption_maps_to_a_retry(
    server: ServiceServer, slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "preemptible.py"
    script.write_text(PREEMPTIBLE)
    d = tmp_path / "marks"
    with server.client("ann") as c:
        job_id = submit(c, [PY, str(script), str(d)], workers=4, max_retries=1, timeout_s=600)
        wait_ready(d, 4)
        first = slurm_id(c, job_id)
        # what --signal=B:USR2@N does before the time limit: USR2 to the batch script, which
        # passes it to the step; the shims pass it on to the ranks, which checkpoint
        slurm.run("scancel", "--batch", "--signal=USR2", first)
        deadline = time.monotonic() + 20
        while len(list(d.glob("usr2-*"))) < 4:
            assert time.monotonic() < deadline, sorted(d.iterdir())
            time.sleep(0.05)
        # a job of a higher-priority partition needs the GPUs hora's job holds: Slurm
        # preempts it (this Slurm's PreemptMode=CANCEL sends SIGTERM to its steps)
        urgent = slurm.run(
            "sbatch", "--parsable", "-p", "urgent", "-N2", "--gres=gpu:2", "-o", "/dev/null",
            "--wrap", "sleep 1",
        ).strip()  # fmt: skip
        final = wait_state(c, job_id, ("succeeded", "failed"), timeout=60)
        history = str(c.get(f"/v1/jobs/{job_id}").json()["transitions"])
    assert final["state"] == "succeeded" and final["attempt"] == 2, final
    assert f"the Slurm job {first} was preempted by Slurm" in history, history
    assert urgent not in slurm.queue()


def hora_jobs(server: ServiceServer, user: str, tmp_path: Path) -> str:
    """``hora jobs`` as ``user`` sees it (the CLI, in a subprocess)."""
    env = {k: v for k, v in server.env.items() if not k.startswith("HORA_")}
    env |= {"HORA_URL": server.url, "HORA_TOKEN": server.tokens[user],
            "HORA_CONFIG": str(tmp_path / "no-config")}  # fmt: skip
    return subprocess.run(
        [PY, "-m", "hora.cli", "jobs"], env=env, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL, check=True,
    ).stdout  # fmt: skip


def test_a_job_slurm_holds_back_is_queued_with_slurms_reason_across_a_restart(
    slurm: Cluster, tmp_path: Path
) -> None:
    """Slurm's queue holds the job: it is ``queued`` (handed over, in Slurm's queue, not
    running) with Slurm's reason as its reason, in ``/v1/queue`` and ``hora jobs``; a kill -9
    of the service then re-adopts it, never submitting it twice, and it runs once Slurm lets
    it."""
    users = {"ann": False, "bob": False, "root": True}
    with ServiceServer(tmp_path, users=users, env=slurm_env(slurm)) as server:
        _held_by_slurm(server, slurm, tmp_path)
    slurm.wait_idle()


def _held_by_slurm(server: ServiceServer, slurm: Cluster, tmp_path: Path) -> None:
    blocker = slurm.run(
        "sbatch", "--parsable", "-N2", "--gres=gpu:2", "-o", "/dev/null", "--wrap", "sleep 60"
    ).strip()
    try:
        with server.client("ann") as c:
            job_id = submit(c, [PY, "-c", "pass"], workers=2)
            deadline = time.monotonic() + 20
            while True:
                job = c.get(f"/v1/jobs/{job_id}").json()
                why = (job.get("queue") or {}).get("why") or {}
                if why.get("source") == "slurm" and why.get("detail") == "Resources":
                    break
                assert time.monotonic() < deadline, job
                time.sleep(0.1)
            assert why["kind"] == "runtime" and why["text"] == "slurm: Resources", why
            while (job["state"], job["reason"]) != ("queued", "slurm: Resources"):
                assert time.monotonic() < deadline, job  # recorded in the same monitor pass
                time.sleep(0.1)
                job = c.get(f"/v1/jobs/{job_id}").json()
            assert job["started_at"] is None and job["attempt"] == 1, job
            first = slurm_id(c, job_id)
            name = slurm.run("squeue", "-h", "-j", first, "-o", "%j").strip()
            entries = [e for e in c.get("/v1/queue").json() if e.get("id") == job_id]
            assert len(entries) == 1 and entries[0]["position"] == 0, entries
            assert entries[0]["reason"]["text"] == "slurm: Resources", entries
        with server.client("bob") as c:  # another user sees nothing of it
            assert all(e.get("id") != job_id for e in c.get("/v1/queue").json())
        row = next(ln for ln in hora_jobs(server, "ann", tmp_path).splitlines()
                   if ln.split()[:1] == [str(job_id)])  # fmt: skip
        assert "queued" in row and "slurm: Resources" in row, row
        server.crash()
        server.restart()
        with server.client("ann") as c:
            time.sleep(1.0)  # a few monitor passes of the new service
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] == "queued" and job["container_id"] == f"slurm:{first}", job
    finally:
        slurm.run("scancel", blocker)
    with server.client("ann") as c:
        job = wait_state(c, job_id, ("succeeded", "failed"), timeout=30)
        assert job["state"] == "succeeded" and job.get("queue") is None, job
        assert job["attempt"] == 1 and job["started_at"] is not None, job
        moves = [t["state"] for t in job["transitions"]]
        assert moves[-4:] == ["starting", "queued", "running", "succeeded"], moves
    assert names(slurm).count(name) == 1, (name, names(slurm))


def test_a_node_that_cannot_see_the_jobs_directory_is_named(
    service: ServiceServer, slurm: Cluster, tmp_path: Path
) -> None:
    server = service
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with slurm.hidden_on("n2", server.data_dir), server.client("ann") as c:
        job_id = submit(c, [PY, str(script), str(tmp_path / "ready")], workers=4)
        job = wait_state(c, job_id, ("failed", "succeeded", "cancelled"), timeout=40)
    assert job["state"] == "failed", job
    assert "node n2 cannot read the job's directory" in job["reason"], job
    assert "filesystem the service and every node share" in job["reason"], job


def test_slurmctld_down_is_a_clear_error(slurm: Cluster, tmp_path: Path) -> None:
    down = tmp_path / "slurm.conf"  # the cluster's config with a port nobody listens on
    text = slurm.conf.read_text().replace("SlurmctldPort=6817", "SlurmctldPort=6899")
    down.write_text(text)
    (tmp_path / "gres.conf").write_text((slurm.conf.parent / "gres.conf").read_text())
    env = slurm_env(slurm, SLURM_CONF=str(down), HORA_SLURM_CONF=str(down))
    with ServiceServer(tmp_path, env=env) as srv:
        with srv.client("ann") as c:
            body = {"command": [PY, "-c", "pass"], "runtime": "slurm", "workers": 2}
            r = c.post("/v1/jobs", json=body)
    # refused at submission, naming the field and the setting, with Slurm's own words
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "runtime"], err
    assert "Unable to contact slurm controller" in err["msg"], err
    assert "HORA_SLURM_CONF" in err["msg"], err


def test_a_controller_that_stops_answering_ends_no_job(
    service: ServiceServer, slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    ready = tmp_path / "ready"
    ctld = int((slurm.dir / "run" / "slurmctld.pid").read_text())
    with service.client("ann") as c:
        job_id = submit(c, [PY, str(script), str(ready)], workers=2)
        wait_ready(ready, 2)
        wait_state(c, job_id, ("running",), timeout=20)  # hora saw Slurm run it
        os.kill(ctld, signal.SIGSTOP)  # squeue and scontrol time out meanwhile
        try:
            time.sleep(12)  # more than slurm.conf's MessageTimeout (10 s): squeue failed
            assert c.get(f"/v1/jobs/{job_id}").json()["state"] == "running"
        finally:
            os.kill(ctld, signal.SIGCONT)
        (ready / "release").write_text("")
        job = wait_state(c, job_id, ("succeeded", "failed", "cancelled"), timeout=40)
    assert job["state"] == "succeeded", job
