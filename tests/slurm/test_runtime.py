"""``runtime: slurm`` end to end on the real two-node cluster: a real service submits real
sbatch jobs; ranks run under srun on both nodes; state, logs, cancel, timeout and errors.

The service runs with the slurm runtime's defaults (tests/helpers/slurm_cluster.slurm_env
sets no ``HORA_SLURM_SLOTS_PER_NODE``): what a node holds is what Slurm reports of it (its
``Gres=gpu:2``), so 4 workers are 2 nodes of 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers.service_server import ServiceServer, wait_state
from helpers.slurm_cluster import Cluster
from helpers.slurm_jobs import SLEEPER, log, submit, wait_ready

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

SHOW = """\
import json, os, socket
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HORA_GPU", "HORA_JOB_ID",
        "HORA_SLURM_JOB_ID", "SLURM_JOB_ID", "WEIRD")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"host": socket.gethostname()}))
"""


def rank_envs(c: httpx.Client, job_id: int, workers: int) -> list[dict[str, Any]]:
    out = []
    for rank in range(workers):
        lines = [ln for ln in log(c, job_id, rank).splitlines() if ln.startswith("ENV ")]
        assert lines, f"rank {rank} printed nothing: {log(c, job_id, rank)!r}"
        out.append(json.loads(lines[0][4:]))
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie (init here reaps the ranks' orphans lazily)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_one_node_job_runs_every_rank_with_the_rank_contract(
    ann: httpx.Client, tmp_path: Path
) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    hostile = "a b'c\"$(touch /tmp/pwned-slurm)`x`;\n$HOME"
    job_id = submit(ann, [PY, str(script)], workers=2, env={"WEIRD": hostile})
    job = wait_state(ann, job_id, ("succeeded", "failed"), timeout=60)
    assert job["state"] == "succeeded", (job, log(ann, job_id, 0))
    envs = rank_envs(ann, job_id, 2)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["host"] for e in envs} == {envs[0]["host"]}  # one node: 2 ranks fit on it
    assert {e["MASTER_ADDR"] for e in envs} == {
        "10.250.0.11" if envs[0]["host"] == "n1" else "10.250.0.12"
    }
    assert [e["HORA_GPU"] for e in envs] == ["0", "1"]  # each rank its own GPU of the node
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1"}
    assert {e["WEIRD"] for e in envs} == {hostile}
    assert all(e["SLURM_JOB_ID"] is None for e in envs)  # the rank's env is hora's alone
    assert not Path("/tmp/pwned-slurm").exists()
    assert job["exit_codes"] == {"0": 0, "1": 0}


def test_two_by_two_digits_job_from_hora_submit_has_logs_from_both_nodes(
    service: ServiceServer, tmp_path: Path
) -> None:
    wrapper = tmp_path / "on_node.py"
    wrapper.write_text(
        "import os, socket, sys\n"
        "print('node', socket.gethostname(), 'rank', os.environ['RANK'], flush=True)\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    argv = [
        PY, "-m", "hora.cli", "submit", "--runtime", "slurm", "--workers", "4",
        "--name", "digits", "--env", "OMP_NUM_THREADS=1", "--wait", "--",
        PY, str(wrapper), PY, str(REPO / "examples" / "train_digits.py"), "--epochs", "2",
        "--checkpoint-dir", str(tmp_path),
    ]  # fmt: skip
    env = {"HORA_URL": service.url, "HORA_TOKEN": service.tokens["ann"], "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=170)
    with service.client("ann") as c:
        jobs = c.get("/v1/jobs", params={"limit": 5}).json()["items"]
        job = next(j for j in jobs if j["spec"]["name"] == "digits")
        logs = [log(c, job["id"], r) for r in range(4)]
    assert proc.returncode == 0 and job["state"] == "succeeded", (proc.stderr, logs[0][-2000:])
    nodes = [ln.split()[1] for lg in logs for ln in lg.splitlines() if ln.startswith("node ")]
    assert nodes == ["n1", "n1", "n2", "n2"], logs
    assert "epoch 2/2" in logs[0] and "trained on 4 process(es)" in logs[0]
    assert (tmp_path / "checkpoint.pt").exists()


def cancel_once_ready(ann: httpx.Client, slurm: Cluster, tmp_path: Path, source: str) -> None:
    """Run ``source`` as a 2x2 job, cancel it once every rank wrote its pid, see it cancelled."""
    script = tmp_path / "ranks.py"
    script.write_text(source)
    job_id = submit(ann, [PY, str(script), str(tmp_path / "ready")], workers=4)
    wait_ready(tmp_path / "ready", 4)
    assert all(slurm.task_pids(n) for n in slurm.nodes)
    assert ann.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    job = wait_state(ann, job_id, ("cancelled", "failed", "succeeded"), timeout=30)
    assert job["state"] == "cancelled", job


def test_cancel_leaves_no_process_on_either_node(
    ann: httpx.Client, slurm: Cluster, tmp_path: Path
) -> None:
    cancel_once_ready(ann, slurm, tmp_path, SLEEPER)
    # hora reports it cancelled only once Slurm has ended the job: nothing is left anywhere
    assert slurm.leftovers() == {"n1": [], "n2": []}
    pids = [int(p.read_text()) for p in (tmp_path / "ready").iterdir()]
    assert not [p for p in pids if alive(p)]


TERMINATED = """\
import os, pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1])
def saved(*_):
    (d / ("term-" + os.environ["RANK"])).write_text(os.environ["TMPDIR"])
    sys.exit(0)
signal.signal(signal.SIGTERM, saved)
d.mkdir(parents=True, exist_ok=True)
(d / os.environ["RANK"]).write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def test_cancel_gives_every_rank_sigterm_and_the_grace_period(
    ann: httpx.Client, slurm: Cluster, tmp_path: Path
) -> None:
    # not srun's "forcing job termination": an srun that gets SIGTERM SIGKILLs its tasks
    cancel_once_ready(ann, slurm, tmp_path, TERMINATED)
    saved = sorted(p.name for p in (tmp_path / "ready").glob("term-*"))
    assert saved == ["term-0", "term-1", "term-2", "term-3"], saved
    assert slurm.leftovers() == {"n1": [], "n2": []}
    # each rank had a TMPDIR of its own on its node, which its shim removed at its end
    tmps = [Path((tmp_path / "ready" / name).read_text()) for name in saved]
    assert len(set(tmps)) == 4 and all(t.name.startswith("hora-tmp-rank") for t in tmps), tmps
    assert not [t for t in tmps if t.exists()]


def test_gpus_lists_the_clusters_nodes_and_who_holds_them(
    ann: httpx.Client, slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job_id = submit(ann, [PY, str(script), str(tmp_path / "ready")], workers=2)
    wait_ready(tmp_path / "ready", 2)
    slurm_id = ann.get(f"/v1/jobs/{job_id}").json()["container_id"].removeprefix("slurm:")
    other = slurm.run(
        "sbatch", "--parsable", "-N1", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 30"
    ).strip()
    try:
        deadline = time.monotonic() + 20
        while True:
            rows = [g for g in ann.get("/v1/gpus").json() if g.get("node")]
            if any(g["slurm_job"] == other for g in rows):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
    finally:
        slurm.run("scancel", other)
        (tmp_path / "ready" / "release").write_text("")
    assert sorted(g["name"] for g in rows) == ["n1:gpu0", "n1:gpu1", "n2:gpu0", "n2:gpu1"]
    mine = [g for g in rows if g["job_id"] == job_id]
    assert len(mine) == 2 and {g["slurm_job"] for g in mine} == {slurm_id}, rows
    assert {g["user"] for g in mine} == {"ann"} and mine[0]["holder_kind"] == "job"
    theirs = [g for g in rows if g["slurm_job"] == other]
    assert len(theirs) == 1 and theirs[0]["job_id"] is None, rows
    assert theirs[0]["holder_kind"] == "slurm" and theirs[0]["user"] == "root"
    assert wait_state(ann, job_id, ("succeeded", "failed"), timeout=30)["state"] == "succeeded"


def test_timeout_ends_the_slurm_job(ann: httpx.Client, slurm: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job_id = submit(ann, [PY, str(script), str(tmp_path / "ready")], workers=2, timeout_s=2)
    job = wait_state(ann, job_id, ("cancelled", "failed", "succeeded"), timeout=40)
    assert job["state"] == "failed" and "timed out after 2s" in job["reason"], job
    assert slurm.leftovers() == {"n1": [], "n2": []}


def test_a_job_cancelled_outside_hora_is_reported_as_such(
    ann: httpx.Client, slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job_id = submit(ann, [PY, str(script), str(tmp_path / "ready")], workers=2)
    wait_ready(tmp_path / "ready", 2)
    slurm_id = ann.get(f"/v1/jobs/{job_id}").json()["container_id"].removeprefix("slurm:")
    slurm.run("scancel", slurm_id)
    job = wait_state(ann, job_id, ("cancelled", "failed", "succeeded"), timeout=30)
    assert job["state"] == "failed", job
    assert f"the Slurm job {slurm_id} was cancelled outside hora" in job["reason"], job


def test_image_with_the_slurm_runtime_is_refused_saying_why(ann: httpx.Client) -> None:
    r = ann.post("/v1/jobs", json={"command": ["true"], "runtime": "slurm", "image": "hora:cpu"})
    assert r.status_code == 422, r.text
    assert "image" in r.text and "slurm" in r.text, r.text


def test_uneven_workers_are_refused_naming_the_field(ann: httpx.Client) -> None:
    r = ann.post("/v1/jobs", json={"command": ["true"], "runtime": "slurm", "workers": 3})
    assert r.status_code == 422, r.text
    assert "workers" in r.text and "2 nodes" in r.text, r.text


def test_a_job_the_partition_can_never_hold_is_refused_naming_workers(ann: httpx.Client) -> None:
    # 6 workers are 3 nodes of 2 GPUs (what Slurm reports of a node); the partition has 2
    r = ann.post("/v1/jobs", json={"command": ["true"], "runtime": "slurm", "workers": 6})
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "workers"], detail
    assert detail["msg"] == (
        "asks for 6 workers x 1 GPU: 3 nodes of 2 GPUs; partition debug gives a job at most "
        "2 nodes"
    ), detail
