"""Job helpers of the slurm e2e tests: submit to a real service, read logs, wait for ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

SLEEPER = """\
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)
(d / os.environ["RANK"]).write_text(str(os.getpid()))
print("ready", flush=True)
while not (d / "release").exists():
    time.sleep(0.05)
print("released", flush=True)
"""


def submit(c: httpx.Client, command: list[str], **body: Any) -> int:
    r = c.post("/v1/jobs", json={"command": command, "runtime": "slurm", **body})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def log(c: httpx.Client, job_id: int, rank: int) -> str:
    return c.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank}).text


def wait_ready(d: Path, ranks: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len([p for p in d.glob("[0-9]*")]) < ranks:
        assert time.monotonic() < deadline, f"only {sorted(d.iterdir())} ranks ready"
        time.sleep(0.05)
