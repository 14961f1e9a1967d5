"""Slurm runtime: submit -> first rank running, hora vs raw sbatch; the cost of tracking jobs.

On the two-node test cluster (``scripts/slurm-cluster.sh``, started and stopped here), with
one real service (uvicorn, SQLite in a temp dir, ``HORA_SLURM_CONF`` set):

* **latency**: a 1-rank job whose command writes ``time.time()`` as it starts, submitted
  through the service (``POST /v1/jobs``: monitor loop, ``sbatch``, Slurm, batch script,
  ``srun``, rank launcher, shim) and as a raw ``sbatch --wrap "srun python -c ..."``, in
  pairs whose order alternates, after one warm-up pair. Each side's latency runs from just
  before the submission to the time the command wrote. Target: hora adds <= 1 s (median of
  the per-pair differences).
* **tracking**: ``N`` held Slurm jobs (``sbatch --hold``), then the monitor's cost for them:
  one ``squeue`` for all of them (:meth:`SlurmRuntime._refresh`), and one poll of a rank of
  each from the cache.

Usage: python bench/slurm_latency.py [--pairs 10] [--jobs 1000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm-cluster.sh"
TARGET_S = 1.0
STAMP = "import sys, time; open(sys.argv[1], 'w').write(repr(time.time()))"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_file(path: Path, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return float(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.005)
    raise SystemExit(f"{path} never written")


def via_hora(c: httpx.Client, stamp: Path) -> float:
    t0 = time.time()
    r = c.post("/v1/jobs", json={"command": [sys.executable, "-c", STAMP, str(stamp)],
                                 "runtime": "slurm"})  # fmt: skip
    if r.status_code != 201:
        raise SystemExit(f"submit failed: {r.text}")
    return _wait_file(stamp) - t0


def via_sbatch(env: dict[str, str], stamp: Path) -> float:
    t0 = time.time()
    wrap = f"srun {sys.executable} -c \"{STAMP}\" {stamp}"
    subprocess.run(["sbatch", "-N1", "-n1", "-o", "/dev/null", "--wrap", wrap], env=env,
                   check=True, capture_output=True)  # fmt: skip
    return _wait_file(stamp) - t0


def tracking(conf: str, n: int, env: dict[str, str]) -> dict[str, float]:
    """Submit ``n`` held jobs, then time one squeue for all and one poll of each."""
    from hora_service.runtimes.sbatch import SlurmOptions
    from hora_service.runtimes.slurm import SlurmRuntime

    ids = []
    for _ in range(n):
        argv = ["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"]
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
        ids.append(out.stdout.strip())
    rt = SlurmRuntime(SlurmOptions(), "bench", conf, None)
    refresh, polls = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        rt._refresh()
        refresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        seen = [rt.info(i) for i in ids]
        polls.append(time.perf_counter() - t0)
        assert all(s is not None and s.state == "PENDING" for s in seen)  # noqa: S101
    subprocess.run(["scancel", *ids], env=env, check=True)
    return {"squeue_s": statistics.median(refresh), "lookups_s": statistics.median(polls)}


def main() -> int:
    """Start the cluster and a service; run both measurements; print them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--jobs", type=int, default=1000)
    args = p.parse_args()
    svc = _load("service")
    tmp = Path(tempfile.mkdtemp(prefix="hora-bench-slurm-"))
    tmp.chmod(0o755)
    where = tmp / "cluster"
    subprocess.run([str(CLUSTER), "start", str(where)], check=True, timeout=120)
    conf = str(where / "etc" / "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)
    lat: dict[str, list[float]] = {"hora": [], "sbatch": []}
    try:
        server = svc.Server(tmp / "data", slots=2, settings={
            "HORA_SLURM_CONF": conf, "HORA_WORK_ROOT": str(tmp),
            "HORA_MONITOR_INTERVAL_S": "0.05"})  # fmt: skip
        try:
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
                for i in range(args.pairs + 1):
                    order = ["hora", "sbatch"] if i % 2 == 0 else ["sbatch", "hora"]
                    for side in order:
                        stamp = tmp / f"stamp-{side}-{i}"
                        took = via_hora(c, stamp) if side == "hora" else via_sbatch(env, stamp)
                        if i:
                            lat[side].append(took)
                        time.sleep(0.5)  # the job ends before the next one is submitted
        finally:
            server.stop()
        track = tracking(conf, args.jobs, env)
    finally:
        subprocess.run([str(CLUSTER), "stop", str(where)], check=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    added = [h - s for h, s in zip(lat["hora"], lat["sbatch"], strict=True)]
    med = statistics.median
    print(f"{args.pairs} pairs after 1 warm-up; submit -> the command's first line, 1 rank")
    print(f"  raw sbatch: median {med(lat['sbatch']):.3f} s ({min(lat['sbatch']):.3f}.."
          f"{max(lat['sbatch']):.3f}); hora: median {med(lat['hora']):.3f} s "
          f"({min(lat['hora']):.3f}..{max(lat['hora']):.3f}); hora - sbatch per pair: median "
          f"{med(added):+.3f} s ({min(added):+.3f}..{max(added):+.3f})")  # fmt: skip
    print(f"tracking {args.jobs} Slurm jobs: one squeue for all {track['squeue_s'] * 1000:.0f} ms;"
          f" {args.jobs} lookups from its cache {track['lookups_s'] * 1000:.2f} ms")
    ok = med(added) <= TARGET_S
    print(json.dumps({"bench": "slurm_latency", "added_latency_s": round(med(added), 3),
                      "target_s": TARGET_S, "pass": ok, **{k: round(v, 4)
                      for k, v in track.items()}, "jobs": args.jobs}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
