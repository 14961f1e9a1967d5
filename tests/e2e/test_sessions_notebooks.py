"""Notebooks whose engines are sessions of a real service, run with nbclient (CPU slots).

A real uvicorn service on 127.0.0.1 with 2 CPU slots (slots, not GPUs), real kernels started by
nbclient with ``HORA_URL``/``HORA_TOKEN`` set (so ``%dist_start`` goes through the service),
real ipyparallel engines started by the service's local runtime, and a real job competing with
them. The lease and the idle timeout are seconds long here so that the tests take seconds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e._notebook import Notebook, wait_for
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from helpers.service_server import ServiceServer, write_scripts

pytestmark = pytest.mark.timeout(180)

GATE = """import os, pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
print('job holds its slot', flush=True)
while not gate.exists():
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    env = {
        "HORA_SESSION_LEASE_S": "3",
        "HORA_SESSION_IDLE_TIMEOUT_S": "3600",
        "HORA_SESSION_IDLE_WARN_S": "3",
        "HORA_SESSION_IDLE_ACTION": "stop",  # parking: test_sessions_park.py
        # the engines import this checkout's hora
        "HORA_JOB_ENV_PASSTHROUGH": "PYTHONPATH,OMP_NUM_THREADS,PYTHONUNBUFFERED",
    }
    users = {"ann": False, "bob": False, "root": True}
    with ServiceServer(tmp_path_factory.mktemp("svc-nb"), users, 2, env) as srv:
        yield srv


@pytest.fixture
def notebooks(server: ServiceServer, tmp_path: Path) -> Iterator[dict[str, Notebook]]:
    tag = new_tag()
    opened: dict[str, Notebook] = {}

    def env(user: str) -> dict[str, str]:
        e = tagged_env(tag)
        e.update(
            HORA_URL=server.url,
            HORA_TOKEN=server.tokens[user],
            HORA_CONFIG=str(tmp_path / "no-config"),
        )
        return e

    class Opener(dict[str, Notebook]):
        def open(self, user: str) -> Notebook:
            nb = Notebook(env(user), tmp_path)
            nb.run("%load_ext hora")
            self[user] = nb
            return nb

    box = Opener()
    try:
        yield box
    finally:
        for nb in box.values():
            nb.close()
        left = wait_gone(tag, timeout=30)
        kill_tagged(tag)
        assert left == [], "processes left behind:\n" + describe(left)
        opened.clear()


def slots(c: httpx.Client) -> list[tuple[str | None, int | None, str | None]]:
    return [(s["holder_kind"], s["job_id"], s["user"]) for s in c.get("/v1/gpus").json()]


def test_two_notebooks_and_a_job_share_two_slots(
    server: ServiceServer, notebooks, tmp_path: Path
) -> None:
    ann = notebooks.open("ann")
    out = ann.run("%dist_start -n 1 --timeout 30")
    assert "1 engines ready" in out and f"from the hora service at {server.url}" in out, out
    gate = tmp_path / "gate"
    script = write_scripts(tmp_path / "scripts")["hello"].with_name("gate.py")
    script.write_text(GATE)
    with server.client("root") as root, server.client("bob") as bobc:
        job = root.post(
            "/v1/jobs", json={"command": [sys.executable, str(script), str(gate)]}
        ).json()
        wait_for(
            "the job to run", lambda: root.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
        )
        bob = notebooks.open("bob")
        started: dict[str, str] = {}
        thread = threading.Thread(
            target=lambda: started.update(out=bob.run("%dist_start -n 1 --timeout 30"))
        )
        thread.start()
        queued = wait_for(
            "bob's session to queue",
            lambda: [s for s in bobc.get("/v1/sessions").json()["items"] if s["state"] == "queued"],
        )
        assert queued[0]["queue"]["position"] == 1
        holders = {(h["kind"], h["user"]) for h in queued[0]["queue"]["holders"]}
        assert holders == {("session", "ann"), ("job", "root")}
        time.sleep(1.0)  # the cell shows the queue at least once more
        gate.write_text("go")  # the job ends by itself
        thread.join(timeout=90)
        assert not thread.is_alive()
        out = started["out"]
        assert f"session {queued[0]['id']} queued: position 1" in out, out
        assert f"job {job['id']} (root) holds slots" in out and "session" in out
        assert "slots granted after" in out and "1 engines ready" in out, out
        assert sorted(k for k, _, _ in slots(root)) == ["session", "session"]
        ran = bob.run("%%distributed\nprint('bob rank', hvd.rank(), 'of', hvd.size())")
        assert "bob rank 0 of 1" in ran
        bob.run("%dist_stop")
        ann.run("%dist_stop")
        wait_for("free slots", lambda: all(h is None for h, _, _ in slots(root)))


def test_a_killed_kernel_frees_its_slots_within_the_lease(server: ServiceServer, notebooks) -> None:
    ann = notebooks.open("ann")
    out = ann.run("%dist_start -n 2 --timeout 30")
    assert "2 engines ready" in out, out
    with server.client("ann") as c:
        (session,) = [s for s in c.get("/v1/sessions").json()["items"] if s["state"] == "running"]
        os.kill(ann.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for("the slots to be freed", lambda: all(h is None for h, _, _ in slots(c)), 30)
        freed_after = time.monotonic() - t0
        ended = c.get(f"/v1/sessions/{session['id']}").json()
    assert ended["state"] in ("cancelled", "failed")
    assert freed_after < 30  # the default lease; this server's is 3 s


def test_idle_engines_are_warned_then_stopped_and_the_next_cell_says_so(
    server: ServiceServer, notebooks
) -> None:
    ann = notebooks.open("ann")
    out = ann.run("%dist_start -n 1 --timeout 30 --idle-timeout 5")
    assert "1 engines ready" in out, out
    assert "x = 41" in ann.run("%%distributed\nx = 41\nprint('x = 41')")
    seen = ann.run("import time; time.sleep(3)") + ann.run("print('next cell')")
    assert "unless a %%distributed cell runs" in seen, seen
    with server.client("ann") as c:
        wait_for("the idle session to end", lambda: all(h is None for h, _, _ in slots(c)), 30)
    failed = ann.run("%%distributed\nprint(x)")
    assert "ended session" in failed and "idle for" in failed, failed
    assert "%dist_restart" in failed


def test_ctrl_c_while_queued_withdraws_the_request(
    server: ServiceServer, notebooks, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    script = tmp_path / "gate.py"
    script.write_text(GATE)
    with server.client("root") as root, server.client("ann") as c:
        job = root.post(
            "/v1/jobs", json={"command": [sys.executable, str(script), str(gate)], "workers": 2}
        ).json()
        try:
            ann = notebooks.open("ann")
            out: dict[str, str] = {}
            thread = threading.Thread(target=lambda: out.update(text=ann.run("%dist_start -n 1")))
            thread.start()
            (queued,) = wait_for(
                "ann's session to queue",
                lambda: [
                    s for s in c.get("/v1/sessions").json()["items"] if s["state"] == "queued"
                ],
            )
            os.kill(ann.pid, signal.SIGINT)  # what Jupyter's interrupt sends to a local kernel
            thread.join(timeout=60)
            assert not thread.is_alive()
            assert "withdrawn from the queue" in out["text"], out["text"]
            assert c.get(f"/v1/sessions/{queued['id']}").status_code == 404  # deleted
        finally:
            gate.write_text("go")
        assert root.get(f"/v1/jobs/{job['id']}").json()["state"] in ("running", "succeeded")


def test_a_configured_service_that_is_down_falls_back_to_kernel_local_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # in this process's IPython shell (as the magics tests do): the fallback is the magic's
    from _magics_util import wait_gone as pids_gone
    from e2e._notebooks_procs import free_port
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    monkeypatch.setenv("HORA_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("HORA_TOKEN", "t")
    monkeypatch.setenv("HORA_CONFIG", str(tmp_path / "no-config"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    try:
        with capture_output() as cap:
            shell.run_line_magic("dist_start", "-n 2 --timeout 30")
        from hora import magics

        pids = magics._MAGICS.cluster.pids
        out = "\n".join(o.data["text/plain"] for o in cap.outputs)
        assert "2 engines ready" in out, out
        assert "kernel-local engines (the configured hora service did not answer" in out, out
        with capture_output() as cap:
            shell.run_cell("%%distributed\nprint('rank', hvd.rank(), 'of', hvd.size())")
        assert "rank 0 of 2" in cap.stdout
    finally:
        shell.run_line_magic("unload_ext", "hora")
    assert pids_gone(pids) == []
