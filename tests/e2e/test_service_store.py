"""The store cannot strand a job: a long write lock, blocked readers and a full disk.

Real service, real SQLite, real processes. Another process holds SQLite's write lock for
65 s (``BEGIN IMMEDIATE`` on its own connection), locks out readers (the read marks of the
``-shm`` file, as SQLite itself takes them), or the data directory is a small tmpfs (mounted
by the test; root) that the test fills up. Every job ends in its true state, its slots are
free, cancel works, submits answer 503 with ``Retry-After`` (never 500), ``/healthz`` says
``degraded`` with the reason while it lasts and keeps answering at once, and everything
that was held back reaches the store once it can.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state

PY = sys.executable
pytestmark = pytest.mark.timeout(240)

WAIT_FOR_FILE = (
    "import pathlib, sys, time\n"
    "p = pathlib.Path(sys.argv[1])\n"
    "while not p.exists():\n"
    "    time.sleep(0.05)\n"
    "print('released', flush=True)\n"
)
WRITE_LOCK = (
    "import sqlite3, sys, time\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN IMMEDIATE')\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "c.execute('ROLLBACK')\n"
)
# SQLite's WAL readers take a shared lock on one of the read marks of the -shm file (bytes
# 123..127, WALINDEX_LOCK_OFFSET 120 + 3): holding them all exclusively blocks every reader
READ_LOCK = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1] + '-shm', os.O_RDWR)\n"
    "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 123, 0)\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)
SETTINGS = {
    "HORA_STORE_WRITE_TIMEOUT_S": "1",
    "HORA_HEALTH_INTERVAL_S": "0.5",
}


@contextmanager
def holding(script: str, db: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [PY, "-c", script, str(db), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def submit(c: httpx.Client, release: Path) -> int:
    script = release.parent / "wait_for_file.py"
    if not script.exists():  # rewriting it could truncate it under a job that is reading it
        script.write_text(WAIT_FOR_FILE)
    r = c.post("/v1/jobs", json={"command": [PY, str(script), str(release)]})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def stored_state(db: Path, job_id: int) -> str:
    """The job's state as the store has it (read on a connection of the test's own)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return str(conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])


def until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.1)


def holders(c: httpx.Client) -> set[int]:
    return {s["job_id"] for s in c.get("/v1/gpus").json() if s["job_id"] is not None}


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/healthz", timeout=10)


def test_a_65s_write_lock_strands_nothing(tmp_path: Path) -> None:
    with ServiceServer(tmp_path, cpu_slots=3, env=SETTINGS) as srv, srv.client("ann") as c:
        db = srv.data_dir / "hora.db"
        done, cancelled = submit(c, tmp_path / "a"), submit(c, tmp_path / "c")
        for job_id in (done, cancelled):
            wait_state(c, job_id, ("running",))
        with holding(WRITE_LOCK, db, 65) as lock:
            t0 = time.monotonic()
            (tmp_path / "a").touch()
            assert wait_state(c, done, ("succeeded",), timeout=20)["exit_codes"] == {"0": 0}
            assert done not in holders(c)  # /v1/gpus agrees with the job
            assert c.post(f"/v1/jobs/{cancelled}/cancel").status_code == 200
            wait_state(c, cancelled, ("cancelled",), timeout=20)
            assert holders(c) == set()
            # the store did not take these ends yet: the service answered from memory
            assert stored_state(db, done) == "running"
            sick = until(lambda: (r := health(srv.url)).status_code == 503 and r, 10, "degraded")
            assert sick.json()["status"] == "degraded" and sick.json()["reason"]
            refused = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"]})
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) > 0
            assert c.delete(f"/v1/jobs/{done}").status_code == 503  # its end is not stored yet
            print(f"lock held; checks done {time.monotonic() - t0:.1f}s into it: {sick.json()}")
            lock.wait(timeout=90)
        until(lambda: stored_state(db, done) == "succeeded", 20, "the end of job done stored")
        assert stored_state(db, cancelled) == "cancelled"
        until(lambda: health(srv.url).status_code == 200, 20, "healthz ok again")
        after = submit(c, tmp_path / "d")
        (tmp_path / "d").touch()
        assert wait_state(c, after, ("succeeded", "failed"))["state"] == "succeeded"
        assert holders(c) == set()
        assert c.delete(f"/v1/jobs/{done}").status_code == 204


def test_healthz_answers_while_readers_are_blocked(tmp_path: Path) -> None:
    with ServiceServer(tmp_path, cpu_slots=1, env=SETTINGS) as srv, srv.client("ann") as c:
        job = submit(c, tmp_path / "a")
        wait_state(c, job, ("running",))
        (tmp_path / "a").touch()
        wait_state(c, job, ("succeeded",))
        answers: list[int] = []

        def read() -> None:
            with srv.client("ann", timeout=60) as reader:
                answers.append(reader.get("/v1/jobs").status_code)
                answers.append(reader.get(f"/v1/jobs/{job}").status_code)

        block_s = 8.0
        with holding(READ_LOCK, srv.data_dir / "hora.db", block_s) as lock:
            t0 = time.monotonic()
            readers = [threading.Thread(target=read) for _ in range(6)]
            for t in readers:
                t.start()
            time.sleep(1.0)  # the readers are waiting on SQLite now
            with httpx.Client(base_url=srv.url, timeout=10) as probe:
                probe.get("/metrics")  # connected (a 401): the timing is the answer alone
                t1 = time.monotonic()
                r = probe.get("/healthz")
                took = time.monotonic() - t1
            print(f"/healthz answered {r.status_code} in {took * 1000:.0f} ms, readers blocked")
            assert took < 2.0 and r.status_code in (200, 503)
            assert not answers  # the readers really were blocked meanwhile
            lock.wait(timeout=block_s + 10)
        for t in readers:
            t.join(timeout=60)
        print(f"blocked readers answered after {time.monotonic() - t0:.1f}s: {answers}")
        assert len(answers) == 12 and set(answers) <= {200, 503}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_strands_nothing_even_across_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(data)],
                   check=True)  # fmt: skip
    try:
        _full_disk(tmp_path, data)
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)


def fill(where: Path) -> Path:
    filler = where / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return filler


def _full_disk(tmp_path: Path, data: Path) -> None:
    with ServiceServer(tmp_path, cpu_slots=3, env=SETTINGS) as srv, srv.client("ann") as c:
        db = srv.data_dir / "hora.db"
        first, second = submit(c, tmp_path / "a"), submit(c, tmp_path / "b")
        for job_id in (first, second):
            wait_state(c, job_id, ("running",))
            # the shim sets aside its exit file's space as it starts: the disk fills after that
            reserve = data / "logs" / str(job_id) / "1" / "rank0.exit.reserve"
            until(reserve.exists, 10, "the exit file's space reserved")
        filler = fill(data)
        sick = until(lambda: (r := health(srv.url)).status_code == 503 and r, 10, "degraded")
        print("full disk:", sick.json())
        assert "full" in sick.json()["reason"]
        (tmp_path / "a").touch()
        ended = wait_state(c, first, ("succeeded", "failed"), timeout=20)
        assert ended["state"] == "succeeded", (ended["reason"], ended["exit_codes"])
        maybe = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"], "name": "on-full"})
        assert maybe.status_code in (201, 503), maybe.text  # never a 500
        if maybe.status_code == 503:
            assert int(maybe.headers["Retry-After"]) > 0
        # the service dies with the disk full; the second job ends while it is down
        srv.crash()
        (tmp_path / "b").touch()
        time.sleep(1.0)
        srv.restart()
        ended = wait_state(c, second, ("succeeded", "failed"), timeout=30)
        run_dir = data / "logs" / str(second) / "1"
        files = {f.name: f.read_bytes()[:40] for f in run_dir.iterdir() if f.is_file()}
        # from the exit file, not "ended while the service was down"
        assert ended["state"] == "succeeded", (ended["reason"], files, srv.output()[-3000:])
        filler.unlink()
        until(lambda: health(srv.url).status_code == 200, 20, "healthz ok again")
        for job_id in (first, second):
            until(lambda j=job_id: stored_state(db, j) == "succeeded", 20, f"job {job_id} stored")
        later = submit(c, tmp_path / "z")
        (tmp_path / "z").touch()
        assert wait_state(c, later, ("succeeded", "failed"))["state"] == "succeeded"
        until(lambda: not holders(c), 20, "every slot free")
        for j in c.get("/v1/jobs", params={"limit": 500}).json()["items"]:
            assert j["state"] in ("succeeded", "failed", "cancelled"), j


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_user_add_on_a_full_disk_says_so_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(data)], check=True)
    try:
        env = {**os.environ, "HORA_USER_MODE": "shared"}

        def add(name: str) -> subprocess.CompletedProcess[str]:
            argv = [PY, "-m", "hora.cli", "user", "add", name, "--data-dir", str(data)]
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

        assert add("ann").returncode == 0
        filler = fill(data)
        full = add("bob")
        print("hora user add on a full disk:", full.stderr.strip())
        assert full.returncode == 1 and "Traceback" not in full.stderr
        assert len(full.stderr.strip().splitlines()) == 1 and "error" in full.stderr
        filler.unlink()
        assert add("bob").returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)


def test_a_corrupted_store_is_degraded_never_a_500(tmp_path: Path) -> None:
    with ServiceServer(tmp_path, cpu_slots=1, env=SETTINGS) as srv, srv.client("ann") as c:
        assert c.post("/v1/jobs", json={"command": [PY, "-c", "pass"]}).status_code == 201
        db = srv.data_dir / "hora.db"
        with db.open("r+b") as f:
            header = f.read(100)
            f.seek(0)
            f.write(b"this is not a database" + bytes(78))
        try:
            sick = until(lambda: (r := health(srv.url)).status_code == 503 and r, 10, "degraded")
            print("corrupted store:", sick.json())
            assert "not a database" in sick.json()["reason"]
            for path in ("/v1/jobs", "/v1/jobs/1", "/v1/gpus", "/metrics"):
                assert c.get(path).status_code in (200, 503), path  # never a 500
            r = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"]})
            assert r.status_code in (201, 503), r.text
        finally:
            with db.open("r+b") as f:
                f.write(header)
        until(lambda: health(srv.url).status_code == 200, 20, "healthz ok again")
        until(lambda: (r := c.get("/v1/jobs")).status_code == 200 or print(r.text), 20, "reads")
