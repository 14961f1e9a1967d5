"""Another user cannot read, join or disturb a session's controller and engines (issue 16, item 1).

A real ``hora serve`` runs as root in multi-user mode with two fresh OS accounts (the
fixtures of :mod:`test_service_isolation`). User A's notebook kernel runs an ipyparallel
controller on the host's loopback, chosen as hora's kernel chooses it
(:func:`hora.engines.plan.connection_files`), and A's session engine registers with it. The
hostile user B then tries what worked against a training's rendezvous: list the listening
sockets in ``/proc/net/tcp``, and on every port of A's controller (given to B outright, as a
guessed connection file would) subscribe to whatever it publishes, register as an engine and
send garbage, while A's engine prints a secret. B tries from two places:

* a job (its own network namespace): nothing of A's can even be reached;
* B's own session engine, which by design runs on the host's network so that it reaches B's
  controller: A's controller is reachable there, and CurveZMQ (the controller's secret key
  in its environment, its public key only in A's connection files) must keep B from
  reading or registering.

A's session must keep working afterwards. Needs root.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hora
import httpx
import ipyparallel as ipp
import pytest
import test_service_isolation as iso
import torch
from helpers.service_server import ServiceServer, free_port, wait_state
from hora.engines import plan

pytestmark = pytest.mark.timeout(300)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
# the accounts run the system's Python with this checkout's code and the venv's packages
PYTHONPATH = f"{Path(hora.__file__).parents[1]}:{Path(torch.__file__).parents[1]}"
SECRET = f"hora-session-secret-{secrets.token_hex(8)}"

ATTACK = """\
import json, os, pathlib, random, sys, time
import zmq

def attack(work, me):
    out = []
    ports = json.loads((work / "victim.ports").read_text())
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                listening.add(int(f[1].split(":")[1], 16))
    out.append(f"victim ports seen {len(listening & set(ports))} of {len(ports)}")
    ctx = zmq.Context()
    subs, dealers = [], []
    for port in ports:
        url = f"tcp://127.0.0.1:{port}"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(url)
        subs.append(sub)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(url)
        dealers.append(dealer)
    (work / f"listening.{me}").write_text("1")
    poller = zmq.Poller()
    for s in subs + dealers:
        poller.register(s, zmq.POLLIN)
    got, replies, step, unsent = b"", 0, 0, 0
    deadline = time.monotonic() + 120
    spoke = None
    while time.monotonic() < deadline:
        if spoke is None and (work / "victim.spoke").exists():
            spoke = time.monotonic()
        if spoke is not None and time.monotonic() > spoke + 3:
            break
        step += 1
        for d in dealers:  # a registration signed with a guessed key, then garbage
            header = json.dumps({"msg_id": str(step), "msg_type": "registration_request",
                                 "session": "x", "username": me, "version": "5.3"})
            try:
                d.send_multipart([b"<IDS|MSG>", b"0" * 64, header.encode(), b"{}", b"{}",
                                  json.dumps({"uuid": f"evil-{step}"}).encode()],
                                 zmq.NOBLOCK)
                d.send(random.randbytes(64), zmq.NOBLOCK)
            except zmq.Again:  # no peer took it (a handshake that never completed)
                unsent += 1
        for s, _ in poller.poll(200):
            frames = s.recv_multipart()
            if s in dealers:
                replies += 1
            got += b"".join(frames)
    secret = (work / "secret").read_text()
    out.append("LEAK read the victim's output" if secret.encode() in got else "read: nothing")
    out.append(f"LEAK replies {replies}" if replies else "replies: none")
    out.append(f"bytes received {len(got)}; sends no peer took {unsent}")
    ctx.destroy(linger=0)
    return out

if __name__ == "__main__":
    for line in attack(pathlib.Path(sys.argv[1]), sys.argv[2]):
        print(line, flush=True)
    print("attack done", flush=True)
"""

SPEAK = f"""\
import time
for _ in range(30):
    print({SECRET!r}, flush=True)
    time.sleep(0.1)
"""


@contextmanager
def controller(where: Path) -> Iterator[tuple[dict[str, Any], Path, list[int]]]:
    """A kernel's controller, started the way a notebook kernel does for a session.

    As :meth:`hora.engines.session_launcher.SessionLauncher._start_controller` does it: connection
    files chosen here, CurveZMQ keys made here (the public key in the files, the secret key
    in the controller's environment). Yields the engines' connection info, the client file
    and every port it listens on.
    """
    where.mkdir(mode=0o700)
    security = where / "security"
    security.mkdir(mode=0o700)
    ports: set[int] = set()
    while len(ports) < plan.CONNECTION_PORTS:
        ports.add(free_port())
    keys = plan.curve_keys()
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
        yield engine, plan.client_file(where), sorted(ports)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@contextmanager
def heartbeats(srv: ServiceServer, user: str, sid: int) -> Iterator[None]:
    """The kernel's heartbeats, from a thread (the lease stays renewed)."""
    stop = threading.Event()

    def run() -> None:
        with srv.client(user) as c:
            while not stop.wait(1.0):
                c.post(f"/v1/sessions/{sid}/heartbeat", json={"idle_s": 0})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextmanager
def session(
    srv: ServiceServer, c: httpx.Client, user: str, connection: dict[str, Any], client_file: Path
) -> Iterator[ipp.Client]:
    """A one-engine session of ``user``, registered with its controller."""
    made = c.post("/v1/sessions", json={"workers": 1, "connection": connection})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    with heartbeats(srv, user, sid):
        rc = ipp.Client(str(client_file), timeout=60)
        try:
            deadline = time.monotonic() + 150
            while len(rc.ids) < 1:
                job = c.get(f"/v1/jobs/{sid}").json()
                assert job["state"] in ("queued", "starting", "running"), job
                assert time.monotonic() < deadline, (job, srv.output()[-3000:])
                time.sleep(0.2)
            yield rc
        finally:
            rc.close()
            assert c.delete(f"/v1/sessions/{sid}").status_code == 200


def _serve(base: Path, accounts: dict[str, int]) -> ServiceServer:
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    return ServiceServer(
        base,
        users={**{name: False for name in accounts}, "root": True},
        accounts=accounts,
        cpu_slots=3,
        env={
            "HORA_WORK_ROOT": str(base / "work"),
            "HOME": str(home),
            "PYTHONPATH": PYTHONPATH,
            "HORA_SESSION_PYTHON": iso.JOB_PY,
            "HORA_SESSION_LEASE_S": "60",
        },
    )


def _wait(path: Path, what: str, failed: Any = None, timeout: float = 120) -> None:
    """Wait for ``path``; ``failed()`` says (raises) why it will never come."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, what
        if failed is not None:
            failed()
        time.sleep(0.1)


def test_another_user_cannot_read_join_or_disturb_a_session(
    base: Path, accounts: dict[str, int]
) -> None:
    ann, bob = accounts
    work = iso.work_dir(base)
    (work / "attack.py").write_text(ATTACK)
    (work / "secret").write_text(SECRET)
    (work / "secret").chmod(0o644)  # the attackers need it only to recognise a leak
    with (
        controller(base / "ctl-ann") as (conn_a, client_a, ports_a),
        controller(base / "ctl-bob") as (conn_b, client_b, _),
        _serve(base, accounts) as srv, srv.client(ann) as a, srv.client(bob) as b,
        session(srv, a, ann, conn_a, client_a) as rc_a,
        session(srv, b, bob, conn_b, client_b) as rc_b,
    ):  # fmt: skip
        (work / "victim.ports").write_text(json.dumps(ports_a))
        (work / "victim.ports").chmod(0o644)
        job = iso.submit(
            b, command=[iso.JOB_PY, str(work / "attack.py"), str(work), "job"],
            env={"PYTHONPATH": PYTHONPATH},
        )  # fmt: skip
        code = "import pathlib\nns = {'__name__': 'attack'}\n"
        code += f"exec(open({str(work / 'attack.py')!r}).read(), ns)\n"
        code += f"result = ns['attack'](pathlib.Path({str(work)!r}), 'engine')"
        engine_attack = rc_b[:].execute(code, block=False)

        def engine_failed() -> None:
            if engine_attack.ready():
                engine_attack.get()  # raises the engine's error

        def job_failed() -> None:
            state = b.get(f"/v1/jobs/{job}").json()
            assert state["state"] in ("queued", "starting", "running"), (
                state, b.get(f"/v1/jobs/{job}/logs", params={"rank": 0}).text
            )  # fmt: skip

        _wait(work / "listening.engine", "B's engine never listened", engine_failed)
        _wait(work / "listening.job", "B's job never listened", job_failed)
        spoke = rc_a[:].execute(SPEAK, block=True)
        assert spoke.stdout[0].count(SECRET) == 30  # A reads its own engine's output
        (work / "victim.spoke").write_text("1")
        engine_attack.get(timeout=120)
        from_engine = "\n".join(rc_b[:].pull("result", block=True)[0])
        done = wait_state(b, job, ("succeeded", "failed"), timeout=120)
        from_job = b.get(f"/v1/jobs/{job}/logs", params={"rank": 0}).text
        assert done["state"] == "succeeded" and "attack done" in from_job, from_job
        # the job is in its own network namespace: not one of A's ports is even there
        assert f"victim ports seen 0 of {len(ports_a)}" in from_job, from_job
        # B's engine shares the host's loopback with A's controller: it sees the ports ...
        assert f"victim ports seen {len(ports_a)} of {len(ports_a)}" in from_engine, from_engine
        for seen in (from_job, from_engine):
            assert "LEAK" not in seen, seen
            assert "read: nothing" in seen and "replies: none" in seen, seen
        # ... and A's session goes on as before (without CurveZMQ, B's registrations and
        # garbage left A's next cell hanging: tried before the fix)
        assert rc_a[:].apply_sync(pow, 2, 10) == [1024]
        assert len(rc_a.ids) == 1
        again = rc_a[:].execute(f"print({SECRET!r})", block=True)
        assert again.stdout[0].strip() == SECRET
