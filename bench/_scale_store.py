"""Stores and servers for ``bench/service_scale.py``: real rows, copied to any size.

A store of 100,000 jobs cannot be filled through the API on this machine in a benchmark's
time (about 100 submissions a second, and each job has to run), so the rows are copied:
:func:`record_templates` runs a few jobs through a real service (succeeded, failed, cancelled
while running, cancelled while queued) and keeps the rows the service wrote for them (the
``jobs`` row and its ``transitions``); :func:`fill` copies them into a store, spread over
the users and over the past, ids and times shifted, nothing else changed. Everything that
is not a finished job (queued jobs, running sessions) goes through the API of the running
service.

:class:`ScaleServer` is a real uvicorn serving the real app on 127.0.0.1, with two routes of
the benchmark's own (``POST /bench/passes``): they run the manager's scheduling pass
(``Monitor.schedule``, under the manager's lock, as a monitor pass does when the queue
changed) and its monitor pass (``JobManager.tick``) in the served process and time them.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from hora.net import free_port

USERS = [f"u{i}" for i in range(10)]  # owners of the history and of the sessions
ADMIN = "admin"
# of every 100 finished jobs copied: 85 succeeded, 10 failed, 3 cancelled running, 2 queued
MIX = (("succeeded", 85), ("failed", 10), ("cancelled_running", 3), ("cancelled_queued", 2))
STEP_S = 7.0  # the copied history: one job every STEP_S seconds, ending an hour ago
LEASE_S = 300.0  # the sessions' lease: longer than setting 100 of them up takes under load

SERVE = """
import time, uvicorn
from hora_service.settings import Settings
from hora_service.api.app import create_app
from hora_service.api.deps import CurrentUser

s = Settings()
app = create_app(s)

@app.post('/bench/passes')
def passes(user: CurrentUser, n: int = 10, gap_s: float = 0.0) -> dict:
    m = app.state.manager
    out = {'pass': [], 'tick': []}
    for _ in range(n):
        with m.state.lock:
            t0 = time.perf_counter()
            m.monitor.schedule(time.time())
            out['pass'].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.tick()
        out['tick'].append(time.perf_counter() - t0)
        time.sleep(gap_s)
    return out

uvicorn.run(app, host=s.host, port=s.port, log_level='warning')
"""

# stands in for a session's engine: holds its slot, computes nothing
ENGINE = "#!/bin/sh\nexec sleep 86400\n"


def make_users(data_dir: Path) -> dict[str, str]:
    """Create the benchmark's users (shared mode) in a new store; name -> token."""
    from hora_service.manager import JobManager
    from hora_service.settings import Settings

    manager = JobManager(Settings(data_dir=data_dir, user_mode="shared"))
    tokens = {ADMIN: manager.users.create(ADMIN, admin=True)}
    tokens.update({u: manager.users.create(u) for u in USERS})
    manager.close_store()
    return {k: str(v) for k, v in tokens.items()}


@dataclass
class ScaleServer:
    """A real uvicorn process serving the hora app on ``data_dir`` (see the module docstring)."""

    data_dir: Path
    slots: int
    tokens: Mapping[str, str]
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        """Where it answers."""
        return f"http://127.0.0.1:{self.port}"

    def headers(self, user: str) -> dict[str, str]:
        """The bearer header of ``user``."""
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def start(self) -> None:
        """Start it (its own lease directory, a stand-in engine for sessions)."""
        engine = self.data_dir / "engine.sh"
        engine.write_text(ENGINE)
        engine.chmod(0o755)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
        env.update(
            {
                "HORA_DATA_DIR": str(self.data_dir),
                "HORA_PORT": str(self.port),
                "HORA_GPUS": "0",
                "HORA_CPU_SLOTS": str(self.slots),
                "HORA_USER_MODE": "shared",
                "HORA_KILL_GRACE_S": "2",
                "HORA_LEASE_DIR": str(self.data_dir / "leases"),
                "HORA_SESSION_PYTHON": str(engine),
                "HORA_SESSION_LEASE_S": str(LEASE_S),
                "OMP_NUM_THREADS": "1",
            }
        )
        log = (self.data_dir / "server.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until ``/healthz`` answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited:\n{(self.data_dir / 'server.log').read_text()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"server did not start in {timeout_s:.0f}s")

    def rss_mb(self) -> float:
        """The server process's resident memory, MB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        """Stop the server and every rank it started (they run in sessions of their own)."""
        import psutil

        if self.proc is None:
            return
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for kid in kids:
            try:
                os.killpg(kid.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc = None


def _wait(c: httpx.Client, job_id: int, states: Sequence[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if c.get(f"/v1/jobs/{job_id}").json()["state"] in states:
            return
        time.sleep(0.05)
    raise SystemExit(f"template job {job_id} did not reach {states} in {timeout_s:.0f}s")


def record_templates(data_dir: Path, tokens: Mapping[str, str]) -> dict[str, int]:
    """Run one job of each kind in :data:`MIX` through a real service; kind -> its job id."""
    srv = ScaleServer(data_dir, slots=2, tokens=tokens)
    srv.start()
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, headers=srv.headers(USERS[0]), timeout=60) as c:
            ok = c.post("/v1/jobs", json={"command": ["true"]}).json()["id"]
            _wait(c, ok, ["succeeded"])
            bad = c.post("/v1/jobs", json={"command": ["false"]}).json()["id"]
            _wait(c, bad, ["failed"])
            run = c.post("/v1/jobs", json={"command": ["sleep", "600"], "workers": 2}).json()["id"]
            _wait(c, run, ["running"])
            queued = c.post("/v1/jobs", json={"command": ["true"]}).json()["id"]
            c.post(f"/v1/jobs/{queued}/cancel")
            c.post(f"/v1/jobs/{run}/cancel")
            _wait(c, run, ["cancelled"])
            _wait(c, queued, ["cancelled"])
    finally:
        srv.stop()
    shutil.rmtree(data_dir / "logs", ignore_errors=True)
    kinds = dict(zip([k for k, _ in MIX], (ok, bad, run, queued), strict=True))
    return kinds


def _rows(db: sqlite3.Connection, job_id: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    db.row_factory = sqlite3.Row
    job = dict(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
    moves = [dict(r) for r in db.execute(
        "SELECT * FROM transitions WHERE job_id = ? ORDER BY seq", (job_id,)
    )]  # fmt: skip
    db.row_factory = None
    return job, moves


def fill(
    db_path: Path, n: int, templates: Mapping[str, int], now: float
) -> Counter[tuple[str, str]]:
    """Copy the template jobs into the store until it holds ``n`` finished jobs.

    The copies are spread over :data:`USERS` in turn and over the past (one every
    :data:`STEP_S` seconds, the last an hour before ``now``), in the proportions of
    :data:`MIX`; ids and times are shifted, every other column is the service's own.

    Returns:
        How many jobs each user has in each state.
    """
    db = sqlite3.connect(db_path)
    try:
        rows = {kind: _rows(db, job_id) for kind, job_id in templates.items()}
        uids = dict(db.execute("SELECT name, id FROM users").fetchall())
        db.execute("DELETE FROM transitions")
        db.execute("DELETE FROM jobs")
        pattern = [kind for kind, weight in MIX for _ in range(weight)]
        jobs, moves, held = [], [], Counter[tuple[str, str]]()
        cols = list(rows[pattern[0]][0])
        seq = 0
        for i in range(n):
            job, trans = rows[pattern[(i * 37) % len(pattern)]]
            user = USERS[i % len(USERS)]
            held[(user, job["state"])] += 1
            shift = now - 3600 - (n - i) * STEP_S - job["created_at"]
            copy = {**job, "id": i + 1, "user": user, "user_id": uids[user]}
            for t in ("created_at", "started_at", "finished_at"):
                copy[t] = None if job[t] is None else job[t] + shift
            jobs.append(tuple(copy[c] for c in cols))
            for t in trans:
                seq += 1
                moves.append((seq, i + 1, t["state"], t["at"] + shift, t["reason"]))
        marks = ",".join("?" * len(cols))
        db.executemany(f"INSERT INTO jobs ({','.join(cols)}) VALUES ({marks})", jobs)
        db.executemany("INSERT INTO transitions VALUES (?, ?, ?, ?, ?)", moves)
        db.commit()
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return held
