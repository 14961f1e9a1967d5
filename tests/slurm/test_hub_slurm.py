"""A team's JupyterHub on a Slurm cluster: batchspawner's SlurmSpawner and hora, for real.

The hub runs in the machine's own namespace (the cluster's head, ``10.250.0.1``) with
``batchspawner.SlurmSpawner``: it submits alice's JupyterLab as a Slurm job with ``sudo -E
-u alice sbatch``, which runs on node ``n1`` as alice. hora is the hub's managed service
(``hora serve --hub``, started by the hub, ``hora_service.hub.configure``). A kernel of that
JupyterLab, driven through the hub's proxy (the Jupyter REST API and its websocket), runs
``%dist_start -n 2 --runtime slurm``: its controller listens on n1's address, and the
session's engines are one Slurm job on ``n1`` and ``n2``, as alice. Stopping the server
(``scancel``) ends the session and leaves nothing on either node.

Opt-in (``HORA_TEST_HUB_SLURM=1``; run it under ``flock /work/.slurm.lock`` where other
tests may start the cluster): it takes a few minutes. Its last run is recorded in
docs/team.md. Needs root, ``sudo`` and the test cluster.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.hub import Account, Hub, Kernel, accounts, user_python
from helpers.service_server import free_port, make_users
from helpers.slurm_cluster import Cluster

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("HORA_TEST_HUB_SLURM") != "1",
        reason="opt-in: HORA_TEST_HUB_SLURM=1 (a hub on the two-node cluster, minutes)",
    ),
]
HEAD = "10.250.0.1"  # the machine's address on the nodes' bridge (scripts/slurm-cluster.sh)
SLURM_HUB = """\
import batchspawner  # noqa: F401  (its API, where a server on a node reports its port)
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.SlurmSpawner.batchspawner_singleuser_cmd = "{bin}/batchspawner-singleuser"
c.SlurmSpawner.req_options = "--nodelist=n1"
c.SlurmSpawner.req_nprocs = "1"
c.SlurmSpawner.start_timeout = 300
c.Spawner.environment["SLURM_CONF"] = "{slurm_conf}"
configure(
    c, "http://{ip}:{hora_port}", command=["{hora}", "serve", "--hub"],
    environment={hora_env!r}, kernel_python="{python}",
)
"""


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


@pytest.fixture
def base() -> Iterator[Path]:
    assert shutil.which("sudo"), "batchspawner submits with sudo: apt-get install sudo"
    where = Path(tempfile.mkdtemp(prefix="hora-hub-slurm-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def hora_env(base: Path, slurm: Cluster, python: Path) -> dict[str, str]:
    env = {
        "HORA_DATA_DIR": str(base / "hora"), "HORA_WORK_ROOT": str(base / "work"),
        "HORA_USER_MODE": "multi", "HORA_GPUS": "0", "HORA_CPU_SLOTS": "1",
        "HORA_SESSION_PYTHON": str(python), "HORA_SLURM_CONF": str(slurm.conf),
        "HORA_SLURM_SLOTS_PER_NODE": "1", "HORA_SLURM_GPUS": "0",
        "HORA_MONITOR_INTERVAL_S": "0.2", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    for name in ("HORA_TEST_TAG", "HORA_LEASE_DIR"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def test_a_jupyterlab_on_a_node_gets_engines_on_both_nodes(slurm: Cluster, base: Path) -> None:
    t0 = time.monotonic()
    python = user_python(base)
    (base / "work").mkdir(mode=0o755)
    env = hora_env(base, slurm, python)
    root = make_users(base / "hora", {"root": True})["root"]  # hora's own admin, for checks
    hora_port = free_port()
    with accounts(["alice"]) as team:
        alice = team["alice"]
        hub = Hub(base, team, [], "", python, env.get("HORA_TEST_TAG", "t"), ip=HEAD)
        hub.hora_url = f"http://{HEAD}:{hora_port}"
        hub.hora = SLURM_HUB
        hub.fields.update(slurm_conf=slurm.conf, hora_port=hora_port, hora_env=env,
                          hora=shutil.which("hora") or "hora")  # fmt: skip
        hub.env["SLURM_CONF"] = str(slurm.conf)  # the hub's sbatch, squeue, scancel
        with hub:
            text = run_on_the_cluster(hub, alice, slurm, hora_port, root)
        assert slurm.leftovers() == {"n1": [], "n2": []}
    print(f"\n--- hub on Slurm, {time.monotonic() - t0:.0f}s ---\n{text}")


def run_on_the_cluster(hub: Hub, alice: Account, slurm: Cluster, hora_port: int, root: str) -> str:
    made = hub.api("POST", f"/users/{alice.name}/server")
    assert made.status_code in (201, 202), made.text
    wait_for("alice's server", lambda: (hub.server(alice) or {}).get("ready"), 360)
    jobs = slurm.run("squeue", "-h", "-o", "%u %N %j").split("\n")
    assert f"{alice.name} n1 spawner-jupyterhub" in jobs, (jobs, hub.output())
    scopes = [f"access:servers!user={alice.name}"]
    minted = hub.api("POST", f"/users/{alice.name}/tokens", json={"scopes": scopes})
    assert minted.status_code == 201, minted.text
    kernel = Kernel(f"{hub.url}/user/{alice.name}/", minted.json()["token"])
    try:
        where = kernel.run("import getpass, socket\nprint(socket.gethostname(), getpass.getuser())")
        assert where.strip() == f"n1 {alice.name}", where
        started = kernel.run("%dist_start -n 2 --runtime slurm --start-timeout 300")
        assert "2 engines ready" in started and "on Slurm nodes" in started, started
        kernel.run("%%distributed --all --out host\nimport getpass, socket\n"
                   "host = f'{socket.gethostname()}:{getpass.getuser()}'")  # fmt: skip
        hosts = kernel.run("print(sorted(host))")
        assert hosts.strip() == str([f"n1:{alice.name}", f"n2:{alice.name}"]), hosts
        hora = f"http://{HEAD}:{hora_port}"
        with httpx.Client(base_url=hora, headers={"Authorization": f"Bearer {root}"}) as c:
            (session,) = c.get("/v1/sessions").json()["items"]
            assert (session["user"], session["state"]) == (alice.name, "running"), session
            job = c.get(f"/v1/jobs/{session['id']}").json()
            assert job["spec"]["runtime"] == "slurm" and job["kind"] == "session", job
            stopped = hub.api("DELETE", f"/users/{alice.name}/server")
            assert stopped.status_code in (202, 204), stopped.text
            wait_for("the server to stop", lambda: hub.server(alice) is None, 180)
            ended = wait_for("the session to end", lambda: (
                s if (s := c.get(f"/v1/sessions/{session['id']}").json())["state"]
                in ("cancelled", "failed") else None), 120)  # fmt: skip
        slurm.wait_idle(timeout=60)
    finally:
        kernel.close()
    return f"{where}{started}{hosts}session {session['id']}: {ended['state']} ({ended['reason']})"
