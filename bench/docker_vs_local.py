"""Docker runtime vs local runtime: submit -> running latency and digits training throughput.

One real service (uvicorn on 127.0.0.1, SQLite in a temp dir) with both runtimes; jobs are
submitted in pairs, local then docker, the order alternating between pairs (BENCH.md rule 1),
after one warm-up pair:

* **latency**: submit -> running of a 1-rank job (from the service's own transition times:
  ``queued`` -> ``running``); the docker side includes creating and starting the container.
  Target: the container adds <= 1.5 s (median of the per-pair differences).
* **throughput**: ``examples/train_digits.py`` as a 2-rank job (gloo, 1 thread per rank),
  samples/s from the script's own training time; both sides must reach the same final test
  accuracy (same seed, same torch). Target: docker >= 0.98x local (median per-pair ratio).

Needs a Docker engine in ``DOCKER_HOST`` (``scripts/dockerd.sh start DIR``) with ``hora:cpu``
(``hora image build --cpu``), and root (the containers run as ``nobody``).

Usage: python bench/docker_vs_local.py [--pairs 5] [--epochs 20] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "hora:cpu"
TARGETS = {"added_latency_s": 1.5, "throughput_ratio": 0.98}
TRAIN_SAMPLES = 1437  # the example's seeded 80/20 split of scikit-learn's 1,797 digits


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


svc = _load("service")


def run_job(c: httpx.Client, runtime: str, command: list[str], workers: int) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "workers": workers, "runtime": runtime}
    if runtime == "docker":
        body["image"] = IMAGE
    r = c.post("/v1/jobs", json=body)
    if r.status_code != 201:
        raise SystemExit(f"submit failed: {r.text}")
    job_id = r.json()["id"]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            if job["state"] != "succeeded":
                raise SystemExit(f"{runtime} job {job_id} {job['state']}: {job['reason']}")
            job["log"] = c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text
            return dict(job)
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} did not finish")


def latency_s(job: dict[str, Any]) -> float:
    at = {t["state"]: datetime.fromisoformat(t["at"]) for t in job["transitions"]}
    return (at["running"] - at["queued"]).total_seconds()


def train_result(job: dict[str, Any], epochs: int) -> tuple[float, float]:
    """Samples/s and final accuracy from train_digits.py's rank-0 log."""
    secs = float(re.search(r"trained on \d+ process\(es\) in ([\d.]+)s", job["log"]).group(1))  # type: ignore[union-attr]
    acc = float(re.search(r"final test accuracy: ([\d.]+)", job["log"]).group(1))  # type: ignore[union-attr]
    return TRAIN_SAMPLES * epochs / secs, acc


def pairs(n: int) -> list[tuple[str, str]]:
    """A B, B A, ... so that neither side always runs first."""
    return [("local", "docker") if i % 2 == 0 else ("docker", "local") for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="3 pairs, 4 epochs (about two minutes)")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.epochs = 3, 4
    tmp = Path(tempfile.mkdtemp(prefix="hora-bench-docker-"))
    work = tmp / "work"
    (work / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "train_digits.py", work / "examples")
    for d in (tmp, work, work / "examples"):
        d.chmod(0o777)
    # both runtimes enabled: the engine of DOCKER_HOST, images never pulled
    server = svc.Server(tmp / "data", slots=2, settings={
        "HORA_WORK_ROOT": str(work), "HORA_MONITOR_INTERVAL_S": "0.05",
        "HORA_DOCKER_HOST": os.environ.get("DOCKER_HOST", ""), "HORA_DOCKER_PULL": "never",
        "HORA_DOCKER_SHM_SIZE": "512m",
    })  # fmt: skip
    started = [sys.executable, "-c", "pass"]
    commands = {
        "local": {
            "lat": started,
            "train": [sys.executable, "examples/train_digits.py", "--epochs", str(args.epochs),
                      "--checkpoint-dir", str(work / "ckpt-local")],
        },
        "docker": {
            "lat": ["python", "-c", "pass"],
            "train": ["python", "examples/train_digits.py", "--epochs", str(args.epochs),
                      "--checkpoint-dir", "/tmp/ckpt"],
        },
    }  # fmt: skip
    lat: dict[str, list[float]] = {"local": [], "docker": []}
    thr: dict[str, list[float]] = {"local": [], "docker": []}
    acc: dict[str, set[float]] = {"local": set(), "docker": set()}
    try:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
            for i, order in enumerate(pairs(args.pairs + 1)):
                for side in order:
                    job = run_job(c, side, commands[side]["lat"], 1)
                    if i:
                        lat[side].append(latency_s(job))
                for side in order:
                    sps, a = train_result(run_job(c, side, commands[side]["train"], 2), args.epochs)
                    acc[side].add(a)
                    if i:
                        thr[side].append(sps)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if acc["local"] != acc["docker"] or len(acc["local"]) != 1:
        raise SystemExit(f"final accuracy differs: local {acc['local']} docker {acc['docker']}")
    added = [d - lo for d, lo in zip(lat["docker"], lat["local"], strict=True)]
    ratio = [d / lo for d, lo in zip(thr["docker"], thr["local"], strict=True)]
    med = statistics.median
    print(f"machine: {os.cpu_count()} cores, torch CPU, gloo, 1 thread per rank; "
          f"{args.pairs} pairs after 1 warm-up; digits {args.epochs} epochs, 2 ranks; "
          f"final accuracy {acc['local'].pop():.4f} on both")  # fmt: skip
    print(f"{'metric':<34}{'local':>10}{'docker':>10}{'docker-local / ratio (min..max)':>36}")
    print(f"{'submit->running median (s)':<34}{med(lat['local']):>10.3f}{med(lat['docker']):>10.3f}"
          f"{med(added):>+14.3f} s ({min(added):+.3f}..{max(added):+.3f})")  # fmt: skip
    train = f"{med(thr['local']):>10.0f}{med(thr['docker']):>10.0f}"
    print(f"{'digits training (samples/s)':<34}{train}"
          f"{med(ratio):>14.3f}x ({min(ratio):.3f}..{max(ratio):.3f})")  # fmt: skip
    ok = med(added) <= TARGETS["added_latency_s"] and med(ratio) >= TARGETS["throughput_ratio"]
    print(json.dumps({
        "bench": "docker_vs_local", "metric": "added_latency_s,throughput_ratio",
        "hora": {"added_latency_s": round(med(added), 3), "throughput_ratio": round(med(ratio), 3)},
        "baseline": "local runtime", "ratio": round(med(ratio), 3), "target": TARGETS, "pass": ok,
    }))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
