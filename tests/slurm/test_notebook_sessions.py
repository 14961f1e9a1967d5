"""Notebook engines on Slurm: ``%dist_start --runtime slurm`` in a real kernel, against a real
service whose session becomes one Slurm job on the real two-node cluster.

The kernel's controller listens on the host's bridge address (10.250.0.1), which the nodes
reach; the engines run under one ``srun`` on n1 and n2 and run ``%%distributed`` cells,
``--out``, ``%dist_push`` and ``%dist_pull`` across both. While Slurm holds the job back,
``%dist_start`` shows Slurm's pending reason; the notebook's interrupt stops a cell on both
nodes, and a stall report shows the stack of a rank on n2. ``%dist_stop``, an engine that
dies, and a kernel killed with -9 (the lease runs out)
end the Slurm job: nothing is left on either node.

Engines on n2 start late: a ``sitecustomize`` on the engines' ``PYTHONPATH`` sleeps
``SKEW_S`` seconds there, longer than the collective timeout the notebook asks for, so the
engines on n1 must wait for them at the rendezvous within the start timeout.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e._notebook import Notebook
from helpers.service_server import ServiceServer
from helpers.slurm_cluster import Cluster, slurm_env

pytestmark = pytest.mark.timeout(180)
BRIDGE = "10.250.0.1"  # the host's address on the nodes' bridge (scripts/slurm-cluster.sh)
SKEW_S = 15  # how late the engines on n2 start
SKEW = f"""\
import socket, time
if socket.gethostname() == "n2":
    time.sleep({SKEW_S})
"""


@pytest.fixture(scope="module")
def server(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    tmp = tmp_path_factory.mktemp("svc-slurm-nb")
    (tmp / "skew").mkdir()
    (tmp / "skew" / "sitecustomize.py").write_text(SKEW)
    path = os.pathsep.join(p for p in (str(tmp / "skew"), os.environ.get("PYTHONPATH")) if p)
    # a short lease, so that a killed kernel's session ends within the test; not under 6 s:
    # CI runs this suite beside the gates and an install on 2 cores, where a kernel's
    # heartbeat (every lease / 3) once went unheard for 4 s and a 3 s lease ended a healthy
    # session mid-cell
    env = slurm_env(slurm, HORA_SESSION_LEASE_S="6", PYTHONPATH=path)
    with ServiceServer(tmp, {"ann": False, "root": True}, 2, env) as srv:
        yield srv
    slurm.wait_idle()


def sessions(c: httpx.Client) -> list[dict]:
    return list(c.get("/v1/sessions").json()["items"])


def wait_for(what: str, check, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def engine_dirs() -> set[Path]:
    """What session engines leave in the nodes' /tmp (this machine's: they share it).

    The ranks' own temporary directories (``hora-tmp-rank*``, where the engines make their
    private ones) and any engine directory made outside them.
    """
    tmps = {Path("/tmp"), Path(tempfile.gettempdir())}  # noqa: S108  (where the engines' go)
    return {d for t in tmps for pat in ("hora-tmp-rank*", "hora-session-engine-*")
            for d in t.glob(pat)}


def wait_ended(c: httpx.Client, session_id: int) -> dict:
    """The session once it ended: hora says so only when Slurm no longer runs its job."""

    def ended() -> dict | None:
        s = c.get(f"/v1/sessions/{session_id}").json()
        return s if s["state"] in ("cancelled", "failed", "succeeded") else None

    return dict(wait_for(f"session {session_id} to end", ended, timeout=40))


def test_engines_on_both_nodes_wait_in_slurms_queue_run_cells_and_stop(
    server: ServiceServer, slurm: Cluster, notebook: Notebook, tmp_path: Path
) -> None:
    engines_before = engine_dirs()
    blocker = slurm.run(
        "sbatch", "--parsable", "-N2", "--gres=gpu:2", "-o", "/dev/null", "--wrap", "sleep 60"
    ).strip()
    out: dict[str, str] = {}
    start = threading.Thread(
        target=lambda: out.update(
            text=notebook.run(
                "%dist_start -n 4 --runtime slurm --no-preflight --timeout 10 --start-timeout 90"
            )
        )
    )
    with server.client("ann") as c:
        try:
            start.start()
            held = wait_for(
                "Slurm to hold the session back",
                lambda: [s for s in sessions(c) if (s.get("queue") or {}).get("reason")],
            )
            assert held[0]["state"] == "queued", held
            assert held[0]["queue"]["why"]["source"] == "slurm", held
            time.sleep(1.0)  # the cell shows Slurm's reason
        finally:
            slurm.run("scancel", blocker)
        start.join(timeout=120)
        assert not start.is_alive()
        text = out["text"]
        assert "waits in the runtime's queue: slurm: " in text, text  # Resources, Priority
        assert "4 engines ready" in text and "on Slurm nodes" in text, text
        took = float(re.search(r"engines ready in ([0-9.]+)s", text)[1])  # type: ignore[index]
        assert took >= SKEW_S, text  # n1's engines waited for n2's at the rendezvous
        assert f"the controller listens on {BRIDGE}" in text, text
        (session,) = [s for s in sessions(c) if s["state"] == "running"]

    cell = "import socket\nhost = socket.gethostname()\nprint('rank', hvd.rank(), 'on', host)"
    ran = notebook.run(f"%%distributed --all --out host\n{cell}")
    assert all(f"rank {r} on {h}" in ran for r, h in enumerate(["n1", "n1", "n2", "n2"])), ran
    assert "['n1', 'n1', 'n2', 'n2']" in notebook.run("print(host)")
    notebook.run("x = 20")
    notebook.run("%dist_push x")
    # a stall report shows the stack of a rank on n2 (asked on its control channel); the
    # blocked rank is released and the process group rebuilt across both nodes
    stall = notebook.run(
        "%%distributed --timeout 3\ndef stuck_here():\n    hvd.allreduce(torch.ones(1))\n"
        "if hvd.rank() == 3:\n    stuck_here()"
    )
    assert "--- rank 3 is here" in stall and "in stuck_here" in stall, stall
    assert "process group rebuilt; engines usable, variables kept" in stall, stall

    status = notebook.run("%dist_status")
    assert status.count("alive") >= 4, status  # engines on other nodes are watched by the service
    ran = notebook.run(
        "%%distributed\ny = hvd.allreduce(torch.tensor([x + hvd.rank()]), op=hvd.Sum).item()"
    )
    assert "Error" not in ran, ran
    notebook.run("%dist_pull y")
    assert "[86, 86, 86, 86]" in notebook.run("print(y)")  # 4 * 20 + 0+1+2+3

    # the notebook's interrupt reaches engines on other nodes through their control channel
    marks = tmp_path / "marks"
    marks.mkdir()
    sleeper = f"import pathlib, time\npathlib.Path({str(marks)!r}, str(hvd.rank())).touch()\n"
    ran: dict[str, str] = {}
    cell = threading.Thread(
        target=lambda: ran.update(text=notebook.run(f"%%distributed\n{sleeper}time.sleep(120)"))
    )
    cell.start()
    wait_for("every rank to run the cell", lambda: len(list(marks.iterdir())) == 4)
    os.kill(notebook.pid, signal.SIGINT)  # what Jupyter's interrupt sends to a local kernel
    cell.join(timeout=60)
    assert not cell.is_alive()
    assert "interrupted on ranks 0-3" in ran["text"], ran["text"]
    assert "rank 3 still here" in notebook.run(
        "%%distributed --rank 3\nprint('rank', hvd.rank(), 'still here')"
    )

    notebook.run("%dist_stop")  # deletes the session: gone at once, its Slurm job ended
    with server.client("ann") as c:
        assert c.get(f"/v1/sessions/{session['id']}").status_code == 404
    wait_for("Slurm to end the job", lambda: slurm.queue() == [], timeout=30)
    assert slurm.leftovers() == {"n1": [], "n2": []}
    # the engines got SIGTERM (not srun's SIGKILL), and the shims removed the ranks' own
    # temporary directories, where the engines' private ones were
    assert engine_dirs() - engines_before == set()


def test_a_dead_engine_or_a_killed_kernel_ends_the_slurm_job(
    server: ServiceServer, slurm: Cluster, notebook: Notebook
) -> None:
    engines_before = engine_dirs()
    text = notebook.run("%dist_start -n 2 --runtime slurm --no-preflight")
    assert "2 engines ready" in text, text
    with server.client("ann") as c:
        first = sessions(c)[0]
    # an engine that dies ends the session (the Slurm job with it); the cell says why
    died = notebook.run("%%distributed\nimport os\nif hvd.rank() == 1:\n    os._exit(3)")
    assert f"the hora service ended session {first['id']}" in died, died
    assert "rank 1" in died and "%dist_restart" in died, died
    with server.client("ann") as c:
        ended = wait_ended(c, first["id"])
    assert ended["state"] == "failed" and "rank 1" in ended["reason"], ended
    assert slurm.leftovers() == {"n1": [], "n2": []}
    # the engine that died ran no handler; its shim removed its temporary directory
    assert engine_dirs() - engines_before == set()
    # fresh engines; then the kernel is killed: the lease runs out and the job ends
    assert "2 engines ready" in notebook.run("%dist_restart")
    assert slurm.queue() and any(slurm.task_pids(n) for n in slurm.nodes)
    os.kill(notebook.pid, signal.SIGKILL)
    with server.client("ann") as c:
        session = sessions(c)[0]  # newest first
        gone = wait_ended(c, session["id"])
    assert "stopped heartbeating" in (gone["reason"] or ""), gone
    wait_for("Slurm to end the job", lambda: slurm.queue() == [], timeout=30)
    assert slurm.leftovers() == {"n1": [], "n2": []}
    assert engine_dirs() - engines_before == set()


def test_a_slurm_session_needs_an_address_the_nodes_reach(server: ServiceServer) -> None:
    conn = {
        "interface": "tcp://127.0.0.1", "registration": 1, "control": 2, "mux": 3, "task": 4,
        "iopub": 5, "hb_ping": 6, "hb_pong": 7, "key": "k",
    }  # fmt: skip
    with server.client("ann") as c:
        assert c.get("/v1/session-address", params={"runtime": "slurm"}).json()["address"] == (
            BRIDGE
        )
        loop = c.post("/v1/sessions", json={"runtime": "slurm", "connection": conn})
        away = c.post(
            "/v1/sessions",
            json={"runtime": "slurm", "connection": {**conn, "interface": "tcp://198.51.100.7"}},
        )
        local = c.post(
            "/v1/sessions", json={"connection": {**conn, "interface": f"tcp://{BRIDGE}"}}
        )
    assert loop.status_code == 422 and "loopback" in loop.text, loop.text
    assert away.status_code == 422, away.text
    assert "not an address of the service's machine or of a Slurm node" in away.text
    assert local.status_code == 422 and "127.0.0.1 only" in local.text, local.text
