"""`/v1/sessions` on a real server: create, list, get, heartbeat, delete, ownership, leases.

A real uvicorn service on 127.0.0.1 with 2 CPU slots and a real SQLite store; the sessions'
engine processes are started by the local runtime. Their connection info points at ports where
no controller listens (these tests are about the service; engines that connect to a real
kernel are in test_sessions_notebooks.py), so they wait until the service stops them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from helpers.service_server import ServiceServer

pytestmark = pytest.mark.timeout(120)

CONN = {
    "ssh": "",
    "interface": "tcp://127.0.0.1",
    "registration": 1,
    "control": 2,
    "mux": 3,
    "task": 4,
    "iopub": 5,
    "hb_ping": 6,
    "hb_pong": 7,
    "broadcast": [8, 9],
    "key": "00000000-0000-0000-0000-000000000000",
    "location": "vm",
    "pack": "json",
    "unpack": "json",
    "signature_scheme": "hmac-sha256",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    users = {"ann": False, "bob": False, "root": True}
    # the idle timeout stops engines here (no kernel parks them: test_sessions_park.py does)
    env = {"HORA_SESSION_LEASE_S": "2", "HORA_SESSION_IDLE_ACTION": "stop"}
    with ServiceServer(tmp_path_factory.mktemp("svc-sessions"), users, 2, env) as srv:
        yield srv


def wait_state(c: httpx.Client, sid: int, states: tuple[str, ...], timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = c.get(f"/v1/sessions/{sid}").json()
        if body["state"] in states or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def wait_free(c: httpx.Client, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        slots = c.get("/v1/gpus").json()
        if all(s["job_id"] is None for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.1)


def beat(c: httpx.Client, sid: int, idle: float = 0.0) -> httpx.Response:
    return c.post(f"/v1/sessions/{sid}/heartbeat", json={"idle_s": idle})


@contextmanager
def beating(srv: ServiceServer, user: str, sid: int) -> Iterator[None]:
    """Heartbeat the session every 0.3 s (the test server's lease is 2 s) while inside."""
    stop = threading.Event()

    def run() -> None:
        with srv.client(user) as c:
            while not stop.wait(0.3):
                beat(c, sid)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def test_session_lifecycle_ownership_and_holders(server: ServiceServer) -> None:
    with server.client("ann") as ann, server.client("bob") as bob, server.client("root") as root:
        made = ann.post("/v1/sessions", json={"workers": 2, "connection": CONN})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        with beating(server, "ann", sid):
            check_running_session(server, ann, bob, root, sid)


def check_running_session(
    server: ServiceServer, ann: httpx.Client, bob: httpx.Client, root: httpx.Client, sid: int
) -> None:
    assert beat(ann, sid).status_code == 200
    body = wait_state(ann, sid, ("running",))
    assert body["state"] == "running" and sorted(body["slots"]) == [0, 1]
    assert beat(ann, sid).json()["state"] == "running"
    holders = {(s["job_id"], s["holder_kind"], s["user"]) for s in ann.get("/v1/gpus").json()}
    assert holders == {(sid, "session", "ann")}
    kinds = {j["id"]: j["kind"] for j in ann.get("/v1/jobs").json()["items"]}
    assert kinds[sid] == "session"
    # the engines' connection key is never shown, not even to the owner or an admin
    for c in (ann, root):
        for text in (c.get(f"/v1/jobs/{sid}").text, c.get("/v1/jobs").text):
            assert CONN["key"] not in text and '"HORA_ENGINE_CONNECTION":"(hidden)"' in text
    # another user's session is a 404, like one that does not exist; an admin sees it
    assert bob.get(f"/v1/sessions/{sid}").status_code == 404
    assert beat(bob, sid).status_code == 404
    assert bob.delete(f"/v1/sessions/{sid}").status_code == 404
    assert bob.get("/v1/sessions").json()["total"] == 0
    assert root.get(f"/v1/sessions/{sid}").status_code == 200
    # a queued session sees its place and who holds the slots
    queued = bob.post("/v1/sessions", json={"workers": 1, "connection": CONN}).json()
    q = queued["queue"]
    assert queued["state"] == "queued" and q["position"] == 1 and q["free"] == 0
    assert [(h["kind"], h["id"], h["user"]) for h in q["holders"]] == [("session", sid, "ann")]
    assert bob.delete(f"/v1/sessions/{queued['id']}").json()["reason"] == ("withdrawn by the user")
    assert bob.get(f"/v1/sessions/{queued['id']}").status_code == 404  # deleted: gone
    assert beat(ann, sid).status_code == 200
    assert ann.delete(f"/v1/sessions/{sid}").json()["state"] == "running"  # as it stood
    assert ann.get(f"/v1/sessions/{sid}").status_code == 404
    assert all(s["job_id"] is None for s in wait_free(ann))
    # a job's id is not a session
    job = ann.post("/v1/jobs", json={"command": ["python", "-c", "pass"]}).json()
    assert ann.get(f"/v1/sessions/{job['id']}").status_code == 404


def test_a_deleted_session_is_gone_for_good(server: ServiceServer) -> None:
    """Schemathesis's finding: a session read back after its DELETE. It is a 404 at once for
    its owner and an admin, in no list, its heartbeat refused; its engines stop and free the
    slots; its record and logs go, and a restarted service (kill -9) does not bring it back."""
    with server.client("ann") as ann, server.client("root") as root:
        sid = ann.post("/v1/sessions", json={"workers": 2, "connection": CONN}).json()["id"]
        with beating(server, "ann", sid):
            assert wait_state(ann, sid, ("running",))["state"] == "running"
            queued = ann.post("/v1/sessions", json={"workers": 1, "connection": CONN}).json()
            for gone in (queued["id"], sid):
                assert ann.delete(f"/v1/sessions/{gone}").status_code == 200
                for c in (ann, root):
                    assert c.get(f"/v1/sessions/{gone}").status_code == 404
                    assert c.get(f"/v1/jobs/{gone}").status_code == 404
                    assert c.delete(f"/v1/sessions/{gone}").status_code == 404
                    assert gone not in [s["id"] for s in c.get("/v1/sessions").json()["items"]]
                    listed = c.get("/v1/jobs", params={"limit": 500}).json()["items"]
                    assert gone not in [j["id"] for j in listed]
                assert beat(ann, gone).status_code == 404
        assert all(s["job_id"] is None for s in wait_free(ann))
        logs = server.data_dir / "logs" / str(sid)
        deadline = time.monotonic() + 30
        while logs.exists():
            assert time.monotonic() < deadline, f"{logs} is still there"
            time.sleep(0.1)
    server.crash()
    server.restart()
    with server.client("ann") as ann:
        assert ann.get(f"/v1/sessions/{sid}").status_code == 404
        assert sid not in [s["id"] for s in ann.get("/v1/sessions").json()["items"]]


def test_a_session_without_heartbeats_frees_its_slots(server: ServiceServer) -> None:
    with server.client("ann") as ann:
        sid = ann.post("/v1/sessions", json={"workers": 2, "connection": CONN}).json()["id"]
        body = wait_state(ann, sid, ("cancelled", "failed", "succeeded"))
        assert body["state"] == "cancelled"
        assert "stopped heartbeating" in body["reason"]
        assert all(s["job_id"] is None for s in wait_free(ann))


def hora_user(srv: ServiceServer, *args: str) -> subprocess.CompletedProcess[str]:
    """``hora user ...`` on the running service's store, as an admin runs it."""
    argv = [sys.executable, "-m", "hora.cli", "user", *args, "--data-dir", str(srv.data_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_users_idle_timeout_culls_their_idle_session(server: ServiceServer) -> None:
    added = hora_user(server, "add", "cal", "--idle-timeout", "3")
    assert added.returncode == 0, added.stderr
    assert "cal  idle_timeout=3s" in hora_user(server, "list").stdout.splitlines()
    auth = {"Authorization": f"Bearer {added.stdout.strip()}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30) as cal:
        made = cal.post("/v1/sessions", json={"workers": 1, "connection": CONN})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert made.json()["idle_timeout_s"] == 3  # the user's, not the service's 3600
        assert beat(cal, sid).status_code == 200
        assert wait_state(cal, sid, ("running",))["state"] == "running"
        # the kernel keeps heartbeating (so the 2 s lease never runs out) but its engines
        # run nothing: the user's idle timeout is what ends the session
        since = time.monotonic()
        deadline = since + 30
        body = beat(cal, sid).json()
        while body["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.3)
            body = beat(cal, sid, idle=time.monotonic() - since).json()
        ended = wait_state(cal, sid, ("cancelled", "failed", "succeeded"))
        assert ended["state"] == "cancelled", ended
        assert ended["reason"].startswith("idle for") and "slots freed" in ended["reason"]
        # an admin takes the user's timeout away: new sessions get the service's default
        assert hora_user(server, "set", "cal", "--idle-timeout", "none").returncode == 0
        again = cal.post("/v1/sessions", json={"workers": 1, "connection": CONN}).json()
        assert again["idle_timeout_s"] == 3600
        assert cal.delete(f"/v1/sessions/{again['id']}").status_code == 200
        # a bad request of its own is a 422 naming the field
        bad = cal.post("/v1/sessions", json={"workers": 1, "connection": CONN, "idle_timeout_s": 0})
        assert bad.status_code == 422 and "idle_timeout_s" in bad.text
        assert all(s["job_id"] is None for s in wait_free(cal))
    refused = hora_user(server, "set", "cal", "--idle-timeout", "nan")
    assert refused.returncode == 1 and "idle_timeout_s" in refused.stderr
    assert hora_user(server, "remove", "cal").returncode == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"workers": 3, "connection": CONN}, "workers"),
        ({"workers": 1, "connection": {**CONN, "interface": "tcp://8.8.8.8"}}, "interface"),
        ({"workers": 1, "connection": {**CONN, "key": "`id`"}}, "key"),
        ({"workers": 1, "connection": CONN, "image": "x"}, "image"),
        ({"workers": 1}, "connection"),
    ],
)
def test_bad_requests_name_the_field(server: ServiceServer, body: dict, field: str) -> None:
    with server.client("ann") as ann:
        resp = ann.post("/v1/sessions", json=body)
    assert resp.status_code == 422, resp.text
    assert field in resp.text


# A Slurm whose controller cannot be reached (a real scontrol, a configuration that names a
# port nothing listens on, short timeouts); the wrapper counts how often the service runs it.
SLURM_CONF = (
    "ClusterName=hora-test\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=1\n"
    "TCPTimeout=1\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
def test_session_address_asks_slurm_once_and_words_its_error(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text(SLURM_CONF)
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    wrapper = bin_dir / "scontrol"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("scontrol")} "$@"\n')
    wrapper.chmod(0o755)
    env = {"HORA_SLURM_CONF": str(tmp_path / "slurm.conf"), "HORA_SLURM_BIN_DIR": str(bin_dir)}
    users = {"ann": False, "root": True}
    with ServiceServer(tmp_path, users, 1, env) as srv, srv.client("ann") as ann:
        answers = [ann.get("/v1/session-address", params={"runtime": "slurm"}) for _ in range(5)]
        assert ann.get("/v1/session-address").json()["address"] == "127.0.0.1"
        log = srv.output()
    assert {a.status_code for a in answers} == {422}
    detail = answers[0].json()["detail"][0]
    assert detail["loc"] == ["query", "runtime"]
    assert "Slurm's scontrol listed no node" in detail["msg"]
    assert "HORA_SLURM_SESSION_ADDRESS" in detail["msg"]
    for raw in ("slurm_load_node", "Unable to contact", "connect failure", str(bin_dir)):
        assert raw not in answers[0].text  # Slurm's own words stay in the service's log
    assert "Unable to contact slurm controller" in log
    assert calls.read_text().splitlines() == ["show node -o"]  # once for five requests
