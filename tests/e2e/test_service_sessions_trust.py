"""Sessions the kernel cannot keep by lying, and what other users see of them (issue 16, item 6).

"Why" #8: a kernel whose heartbeats always say "idle 0 s" kept its session past the idle
timeout and the admin's maximum. Here a real ipyparallel controller (started as a notebook
kernel starts it, on connection files hora chose) and a real service with one CPU slot: the
session's engine registers, computes for a while (the service sees its CPU time grow: the
session stays), then computes nothing while the kernel keeps saying "idle 0 s" - and the
service ends it at its idle timeout, under the admin's maximum. Meanwhile another user's
queued session sees who holds the slot but not that session's idle time (an admin does), and
once the session ends its engine's private directory (which held the controller's key) is
gone from ``/tmp``. And a docker session on ``hora:cpu`` (which carries ipyparallel) registers
its engine with the same kind of controller and runs a cell, as the job's unprivileged account.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ipyparallel as ipp
import psutil
import pytest
from helpers.docker_engine import Engine
from helpers.service_server import ServiceServer, free_port
from hora.engines import plan

pytestmark = pytest.mark.timeout(240)

BUSY_S = 10.0


@contextmanager
def controller(where: Path) -> Iterator[tuple[dict[str, Any], Path]]:
    """A real ipyparallel controller; yields the engines' connection info and the client file."""
    security = where / "security"
    security.mkdir(parents=True, mode=0o700)
    ports: set[int] = set()
    while len(ports) < plan.CONNECTION_PORTS:
        ports.add(free_port())
    keys = plan.curve_keys()  # as the kernel starts it: CurveZMQ on
    engine, client = plan.connection_files(
        sorted(ports), str(uuid.uuid4()), socket.gethostname(), curve_serverkey=keys[0]
    )
    for name, info in (("engine", engine), ("client", client)):
        (security / f"ipcontroller-{plan.CLUSTER_ID}-{name}.json").write_text(json.dumps(info))
    log = (where / "controller.log").open("wb")
    proc = subprocess.Popen(
        plan.controller_argv(where, reuse=True), stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, env=plan.controller_env(os.environ, keys),
    )  # fmt: skip
    try:
        yield engine, plan.client_file(where)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@contextmanager
def lying_heartbeats(srv: ServiceServer, user: str, sid: int) -> Iterator[None]:
    """The kernel says "idle 0 s" every 0.3 s, whatever its engines do."""
    stop = threading.Event()

    def run() -> None:
        with srv.client(user) as c:
            while not stop.wait(0.3):
                try:
                    c.post(f"/v1/sessions/{sid}/heartbeat", json={"idle_s": 0})
                except httpx.HTTPError:
                    pass  # a slow answer under load: the kernel keeps lying

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


# a cell that computes (the engine runs it, as a %%distributed cell would)
SPIN = f"import time\nend = time.monotonic() + {BUSY_S}\nwhile time.monotonic() < end:\n    pass"


def engine_dirs(srv: ServiceServer) -> set[str]:
    """The private directories of the service's session engines (their open stack files)."""
    found = set()
    for pid in srv.descendants():
        try:
            proc = psutil.Process(pid)
            if "session-engine" not in proc.cmdline():
                continue
            for f in proc.open_files():
                if "/hora-session-engine-" in f.path:
                    found.add(os.path.dirname(f.path))
        except psutil.Error:
            pass
    return found


def state_of(c: httpx.Client, sid: int) -> dict[str, Any]:
    return c.get(f"/v1/sessions/{sid}").json()


def wait_for(fn: Any, what: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := fn()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def test_a_lying_kernel_loses_its_idle_session_and_others_see_no_idle_time(
    tmp_path: Path,
) -> None:
    env = {
        # a lease long enough that a loaded machine's stall never ends the session for
        # silence: what ends it here must be its idleness (the lease has its own test)
        "HORA_SESSION_LEASE_S": "60",
        "HORA_SESSION_IDLE_TIMEOUT_MAX_S": "6",  # the admin's maximum
        "HORA_SESSION_IDLE_ACTION": "stop",  # no kernel here to park it
        "HORA_SESSION_BUSY_CPU": "0.05",
    }
    users = {"ann": False, "bob": False, "root": True}
    with (
        controller(tmp_path / "ctl") as (connection, client_file),
        ServiceServer(tmp_path, users, cpu_slots=1, env=env) as srv,
        srv.client("ann") as ann, srv.client("bob") as bob, srv.client("root") as root,
    ):  # fmt: skip
        made = ann.post("/v1/sessions", json={"workers": 1, "connection": connection})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert made.json()["idle_timeout_s"] == 6  # the service's 3600, capped by the admin
        with lying_heartbeats(srv, "ann", sid):
            rc = ipp.Client(str(client_file), timeout=60)
            try:
                rc.wait_for_engines(1, timeout=120)
                dirs = wait_for(lambda: engine_dirs(srv), "no engine directory seen")
                # another user waits for the slot: sees the holder, not its idle time
                queued = bob.post("/v1/sessions", json={"workers": 1, "connection": connection})
                holders = queued.json()["queue"]["holders"]
                assert [(h["id"], h["user"], h["idle_s"]) for h in holders] == [(sid, "ann", None)]
                seen = state_of(root, queued.json()["id"])["queue"]["holders"]
                assert seen[0]["idle_s"] is not None  # an admin sees it
                assert bob.delete(f"/v1/sessions/{queued.json()['id']}").status_code == 200
                # the engine computes for longer than the idle timeout: the session stays
                rc[:].execute(SPIN, block=True)
                assert state_of(ann, sid)["state"] == "running"
                # then it computes nothing; the kernel still says "idle 0 s"
                ended = wait_for(
                    lambda: (s := state_of(ann, sid))["state"] != "running" and s,
                    "the idle session was never stopped",
                )
            finally:
                rc.close()
        assert ended["state"] == "cancelled", ended
        assert ended["reason"].startswith("idle for") and "slots freed" in ended["reason"]
        wait_for(lambda: not any(os.path.exists(d) for d in dirs), f"{dirs} left in /tmp", 30)


def test_a_docker_session_on_the_cpu_image_runs_cells(
    tmp_path: Path, docker_engine: Engine
) -> None:
    """hora:cpu has what engines need (ipyparallel): a docker session's engine runs a cell."""
    env = {
        "HORA_DOCKER_HOST": docker_engine.host, "HORA_DOCKER_PULL": "never",
        "HORA_DOCKER_SHM_SIZE": "64m", "HORA_WORK_ROOT": str(tmp_path),
    }  # fmt: skip
    tmp_path.chmod(0o755)
    with (
        controller(tmp_path / "ctl") as (connection, client_file),
        ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=1, env=env) as srv,
        srv.client("ann") as ann,
    ):
        body = {"workers": 1, "connection": connection, "runtime": "docker", "image": "hora:cpu"}
        made = ann.post("/v1/sessions", json=body)
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        with lying_heartbeats(srv, "ann", sid):
            rc = ipp.Client(str(client_file), timeout=60)
            try:
                rc.wait_for_engines(1, timeout=150)
                uid = rc[:].apply_sync(os.getuid)
                assert uid == [65534], uid  # the container's ranks: never root
            finally:
                rc.close()
            job = ann.get(f"/v1/jobs/{sid}").json()
            assert job["state"] == "running" and job["container_id"], job
        assert ann.delete(f"/v1/sessions/{sid}").status_code == 200
        # its container goes before the service does (a service stopped mid-removal leaves it
        # to its own next start, and this service's data directory has no next start)
        label = {"label": f"hora.job={sid}"}
        wait_for(lambda: not docker_engine.client().containers.list(all=True, filters=label),
                 "the deleted session's container outlived it", 60)  # fmt: skip


def _engine_pids(srv: ServiceServer) -> list[int]:
    pids = []
    for pid in srv.descendants():
        try:
            if "session-engine" in psutil.Process(pid).cmdline():
                pids.append(pid)
        except psutil.Error:
            pass
    return pids


@pytest.mark.parametrize("killed", ["engine", "kernel"])
def test_a_sigkilled_session_leaves_no_private_directory(tmp_path: Path, killed: str) -> None:
    """The engines' private directories (the controller's key) go with the session, however
    it ends: its engine killed with SIGKILL (no handler of its own runs), or its kernel killed:
    heartbeats stop (the lease runs out and the service stops the engines)."""
    env = {"HORA_SESSION_LEASE_S": "4"}
    with (
        controller(tmp_path / "ctl") as (connection, client_file),
        ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=1, env=env) as srv,
        srv.client("ann") as ann,
    ):
        made = ann.post("/v1/sessions", json={"workers": 1, "connection": connection})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        with lying_heartbeats(srv, "ann", sid):
            rc = ipp.Client(str(client_file), timeout=60)
            try:
                rc.wait_for_engines(1, timeout=120)
                dirs = wait_for(lambda: engine_dirs(srv), "no engine directory seen")
            finally:
                rc.close()
            if killed == "engine":
                for pid in _engine_pids(srv):
                    os.kill(pid, signal.SIGKILL)
                ended = wait_for(
                    lambda: (s := state_of(ann, sid))["state"] != "running" and s,
                    "the session outlived its engine",
                )
        if killed == "kernel":  # no more heartbeats: the kernel is gone
            ended = wait_for(
                lambda: (s := state_of(ann, sid))["state"] != "running" and s,
                "the session outlived its lease",
            )
        assert ended["state"] in ("failed", "cancelled"), ended
        wait_for(lambda: not _engine_pids(srv), "the engine outlived its session", 30)
        wait_for(lambda: not any(os.path.exists(d) for d in dirs), f"{dirs} left in /tmp", 30)
