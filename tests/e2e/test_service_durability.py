"""kill -9 of the service while jobs run, then a restart on the same data dir.

No job is lost or duplicated; a job whose ranks kept running is re-adopted (its log keeps
growing, its exit codes are read from the shim's files); a job whose rank died while the
service was down is failed with a reason and retried; a queued job stays queued and runs
later; every slot is held by a live job or free.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state

PY = sys.executable
pytestmark = pytest.mark.timeout(240)

DURABLE = """\
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
i = 0
while not (d / "release").exists():
    print(f"tick {i}", flush=True)
    i += 1
    time.sleep(0.05)
print("released after", i, "ticks", flush=True)
"""


def submit(c: httpx.Client, **body: Any) -> int:
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def log_size(c: httpx.Client, job_id: int, rank: int = 0, attempt: int | None = None) -> int:
    params = {"rank": rank, "offset": 0, "limit": 1}
    if attempt is not None:
        params["attempt"] = attempt
    return int(c.get(f"/v1/jobs/{job_id}/logs", params=params).headers["X-Hora-Log-Size"])


def wait_growth(c: httpx.Client, job_id: int, above: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while (size := log_size(c, job_id)) <= above:
        assert time.monotonic() < deadline, f"log of job {job_id} stopped at {size} bytes"
        time.sleep(0.1)
    return size


def test_kill_9_then_restart_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    script = tmp_path / "durable.py"
    script.write_text(DURABLE)
    gates = {name: tmp_path / name for name in ("x", "y", "z")}
    for d in gates.values():
        d.mkdir()
    srv = ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=4)
    with srv:
        with srv.client("ann") as c:
            x = submit(c, command=[PY, str(script), str(gates["x"])], workers=2, name="adopt")
            y = submit(c, command=[PY, str(script), str(gates["y"])], max_retries=1, name="dies")
            z = submit(c, command=[PY, str(script), str(gates["z"])], workers=4, name="waits")
            for job_id in (x, y):
                wait_state(c, job_id, ("running",))
            assert c.get(f"/v1/jobs/{z}").json()["state"] == "queued"
            size = wait_growth(c, x, 0)
            before = c.get("/v1/jobs", params={"limit": 500}).json()
        srv.crash()
        # while the service is down, y's rank dies with no trace (shim and script together)
        y_pid = int((srv.data_dir / "logs" / str(y) / "1" / "rank0.pid").read_text())
        os.killpg(y_pid, signal.SIGKILL)
        srv.restart()
        with srv.client("ann") as c:
            after = c.get("/v1/jobs", params={"limit": 500}).json()
            assert after["total"] == before["total"] == 3
            assert sorted(j["id"] for j in after["items"]) == sorted([x, y, z])

            adopted = c.get(f"/v1/jobs/{x}").json()
            assert (adopted["state"], adopted["attempt"]) == ("running", 1)
            wait_growth(c, x, size)  # logs keep flowing

            retried = wait_state(c, y, ("running",), timeout=60)
            while retried["attempt"] < 2:
                retried = wait_state(c, y, ("running",), timeout=60)
                time.sleep(0.1)
            reasons = [t["reason"] for t in retried["transitions"] if t["state"] == "retrying"]
            lost = "rank 0 ended while the service was down; its exit status is unknown"
            assert reasons == [lost]
            assert c.get(f"/v1/jobs/{z}").json()["state"] == "queued"

            slots = c.get("/v1/gpus").json()
            holders = sorted(s["job_id"] for s in slots if s["job_id"] is not None)
            assert holders == sorted([x, x, y])  # every slot held by a live job, or free

            (gates["x"] / "release").touch()
            done = wait_state(c, x, ("succeeded", "failed"), timeout=60)
            assert done["state"] == "succeeded", done
            assert {int(k): v for k, v in done["exit_codes"].items()} == {0: 0, 1: 0}
            (gates["y"] / "release").touch()
            assert wait_state(c, y, ("succeeded", "failed"), timeout=60)["state"] == "succeeded"
            running_z = wait_state(c, z, ("running",), timeout=60)
            assert running_z["attempt"] == 1 and len(running_z["slots"]) == 4
            (gates["z"] / "release").touch()
            assert wait_state(c, z, ("succeeded", "failed"), timeout=60)["state"] == "succeeded"
            assert "released after" in c.get(f"/v1/jobs/{x}/logs", params={"rank": 1}).text
