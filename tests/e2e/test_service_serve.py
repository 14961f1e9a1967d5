"""`hora user` and `hora serve` as a user runs them: real subprocesses, a real SQLite file."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers.service_server import free_port, wait_state

PY = sys.executable
pytestmark = pytest.mark.timeout(180)


def hora(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hora.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_user_add_list_remove(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    added = hora("user", "add", "ann", "--admin", "--quota", "2", "--data-dir", data)
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert len(token) >= 32 and "shown only once" in added.stderr
    assert hora("user", "add", "ann", "--data-dir", data).returncode == 1
    bad = hora("user", "add", "a b", "--data-dir", data)
    assert bad.returncode == 1 and "not a user name" in bad.stderr
    listed = hora("user", "list", "--data-dir", data).stdout
    assert listed.strip() == "ann  (admin)  quota=2"
    assert token not in b"".join(
        p.read_bytes() for p in (tmp_path / "data").glob("hora.db*")
    ).decode(errors="replace")
    assert hora("user", "remove", "ann", "--data-dir", data).returncode == 0
    assert hora("user", "remove", "ann", "--data-dir", data).returncode == 1


def test_serve_runs_jobs_enforces_timeout_and_stops(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    token = hora("user", "add", "ann", "--data-dir", data).stdout.strip()
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    argv = [PY, "-m", "hora.cli", "serve", "--port", str(port), "--data-dir", data]
    argv += ["--gpus", "0", "--cpu-slots", "3", "--work-root", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "hora serve did not start"
            time.sleep(0.2)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            assert [s["name"] for s in c.get("/v1/gpus").json()] == ["cpu0", "cpu1", "cpu2"]
            body = {"command": [PY, "-c", "import time; time.sleep(60)"], "timeout_s": 1,
                    "max_retries": 2}  # fmt: skip
            job = c.post("/v1/jobs", json=body).json()
            done = wait_state(c, job["id"], ("failed", "succeeded"), timeout=60)
            assert done["state"] == "failed" and done["reason"] == "timed out after 1s"
            assert done["attempt"] == 1  # a timeout is final, not retried
            outside = c.post("/v1/jobs", json={"command": ["true"], "working_dir": "/"})
            assert (
                outside.status_code == 422
                and outside.json()["detail"][0]["loc"][-1] == "working_dir"
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    leftovers = [
        p for p in psutil.process_iter(["cmdline"]) if data in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers
