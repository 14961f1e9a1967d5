"""Notebook engines on Slurm: cold start of 4 engines on 2 nodes vs 4 kernel-local engines.

On the two-node test cluster (``scripts/slurm-cluster.sh``, started and stopped here), with
one real service (uvicorn, SQLite in a temp dir, ``HORA_SLURM_CONF`` set, 2 ranks per node):

* **hora on Slurm**: ``ServiceCluster(n=4, runtime="slurm").start()``, what
  ``%dist_start -n 4 --runtime slurm`` does: the kernel's controller on the address the nodes
  reach, ``POST /v1/sessions``, one ``sbatch`` and one ``srun`` of 4 engines (2 on n1, 2 on
  n2), registration and ``hora.torch.init()`` across the nodes;
* **baseline**: ``Cluster(n=4).start()``, 4 engines the kernel starts on its own machine.

Both until the process group is ready. Correct first: after each start an allreduce of
``rank + 1`` must give 10 on every rank, and the Slurm engines must be on n1 and n2. After
each Slurm start the script waits (untimed) until Slurm has ended the job. Pairs alternate
their order after one warm-up pair; the median of the per-pair ratios with min and max.
Target: Slurm / local <= 1.3.

Usage: python bench/slurm_engines.py [--pairs 5]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm-cluster.sh"
TARGET = 1.3
CHECK = "_s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_once(cluster: Any, hosts: set[str] | None) -> float:
    """Seconds to a ready process group; then check it and stop the engines."""
    t0 = time.perf_counter()
    rows = cluster.start()
    took = time.perf_counter() - t0
    try:
        cluster.run(CHECK)
        got = cluster.pull("_s")
        if got != [10.0] * 4:
            raise SystemExit(f"correctness: allreduce gave {got}, expected 10.0 on 4 ranks")
        if hosts is not None and {r["host"] for r in rows} != hosts:
            raise SystemExit(f"engines on {[r['host'] for r in rows]}, expected {hosts}")
    finally:
        cluster.stop()
    return took


def wait_idle(env: dict[str, str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.1)
    raise SystemExit("the session's Slurm job did not end within 60 s")


def interleave(pairs: int, a: Callable[[], float], b: Callable[[], float]) -> list[tuple]:
    out = []
    for i in range(pairs + 1):  # pair 0 warms up
        first, second = (a, b) if i % 2 == 0 else (b, a)
        x, y = first(), second()
        if i:
            out.append((x, y) if first is a else (y, x))
    return out


def main() -> int:
    """Start the cluster and a service; time the pairs; print them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    from hora.client import Client
    from hora.engines import Cluster, ClusterOptions
    from hora.engines.session import ServiceCluster

    svc = _load("service")
    tmp = Path(tempfile.mkdtemp(prefix="hora-bench-slurm-engines-"))
    tmp.chmod(0o755)
    where = tmp / "cluster"
    subprocess.run([str(CLUSTER), "start", str(where)], check=True, timeout=120)
    conf = str(where / "etc" / "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    options = ClusterOptions(n=4, timeout_s=60)
    try:
        server = svc.Server(tmp / "data", slots=4, settings={
            "HORA_SLURM_CONF": conf, "HORA_SLURM_SLOTS_PER_NODE": "2",
            "HORA_WORK_ROOT": str(tmp), "HORA_MONITOR_INTERVAL_S": "0.05"})  # fmt: skip
        try:

            def on_slurm() -> float:
                client = Client(server.url, server.token)
                cluster = ServiceCluster(options, service=client, runtime="slurm")
                took = start_once(cluster, {"n1", "n2"})
                wait_idle(env)
                return took

            samples = interleave(args.pairs, on_slurm, lambda: start_once(Cluster(options), None))
        finally:
            server.stop()
    finally:
        subprocess.run([str(CLUSTER), "stop", str(where)], check=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [a / b for a, b in samples]
    print(f"{args.pairs} pairs after 1 warm-up; cold start of 4 engines to a ready process group")
    print("pair  slurm (2 nodes x 2)  kernel-local  ratio")
    for i, (a, b) in enumerate(samples):
        print(f"{i:<5} {a:<20.2f} {b:<13.2f} {a / b:.2f}")
    med = statistics.median(ratios)
    print(f"ratio median {med:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"target <= {TARGET}")  # fmt: skip
    print(json.dumps({
        "bench": "slurm_engines.cold_start", "metric": "cold_start_s (2 nodes x 2 / local)",
        "hora": statistics.median(a for a, _ in samples),
        "baseline": statistics.median(b for _, b in samples), "ratio": med,
        "ratio_min": min(ratios), "ratio_max": max(ratios), "target": TARGET,
        "pass": med <= TARGET,
    }))  # fmt: skip
    return 0 if med <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
