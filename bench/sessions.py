"""Notebook engines as service sessions: cold start through the service, and the cell round trip.

Protocol (../shared/BENCH.md), each part hora side by side with a named baseline, interleaved
(A B, then B A, ...), one warm-up pair, then --pairs timed pairs; the median of the per-pair
ratios with min and max:

1. cold start: ``%dist_start -n 2`` through a real hora service (``ServiceCluster``: the kernel
   starts the controller, the service schedules a session and starts 2 engines with its local
   runtime, the kernel initialises ``hora.torch`` in them) vs kernel-local engines
   (``Cluster``: the kernel starts controller and engines itself). Both until the process
   group is ready. Correct first: after each start an allreduce of ``rank + 1`` must give 3 on
   both ranks; after each service start the slots must be free again before the next one
   (waited for, not timed). Target: service / kernel-local <= 1.2.
2. round trip: a trivial ``%%distributed`` cell (``x = 1``) on engines of a service session vs
   raw ipyparallel ``view.execute("x = 1", block=True)`` on the SAME engines, both run as cells
   through one IPython shell (the method of bench/notebook.py part 1). Target: <= 1.1.

The service is a real uvicorn process on 127.0.0.1 (bench/service.py's ``Server``) with 2 CPU
slots, single-user mode. --quick (under a minute): 1 pair each, no warm-up pair, 10 cells per
round-trip sample.

Usage: python bench/sessions.py [--quick] [--pairs 5] [--iters 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
TARGETS = {"cold_start": 1.2, "roundtrip": 1.1}
CHECK = "_s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nb = _load("notebook")
svc = _load("service")


def wait_free(server: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=10) as c:
        while time.monotonic() < deadline:
            if all(s["job_id"] is None for s in c.get("/v1/gpus").json()):
                return
            time.sleep(0.1)
    raise SystemExit("the session's slots were not freed within 60 s")


def start_once(cluster: Any) -> float:
    t0 = time.perf_counter()
    cluster.start()
    took = time.perf_counter() - t0
    try:
        cluster.run(CHECK)
        got = cluster.pull("_s")
        if got != [3.0, 3.0]:
            raise SystemExit(f"correctness: allreduce gave {got}, expected [3.0, 3.0]")
    finally:
        cluster.stop()
    return took


def bench_cold_start(server: Any, pairs: int, warmup: bool) -> dict[str, Any]:
    from hora.client import Client
    from hora.engines import Cluster, ClusterOptions
    from hora.engines.session import ServiceCluster

    options = ClusterOptions(n=2, timeout_s=60)

    def service() -> float:
        took = start_once(ServiceCluster(options, service=Client(server.url, server.token)))
        wait_free(server)
        return took

    def local() -> float:
        return start_once(Cluster(options))

    samples = nb.interleave(pairs, service, local, warmup)
    ratios = [a / b for a, b in samples]
    rows = [[str(i), f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"] for i, (a, b) in enumerate(samples)]
    print(nb.table("\n1. cold start of 2 engines to a ready process group (s)",
                   ["pair", "through the service", "kernel-local", "ratio"], rows))  # fmt: skip
    s = nb.summarize(ratios)
    print(f"ratio median {s['median']:.2f} (min {s['min']:.2f}, max {s['max']:.2f}); "
          f"target <= {TARGETS['cold_start']}")  # fmt: skip
    return {
        "bench": "sessions.cold_start", "metric": "cold_start_s (service session / kernel-local)",
        "hora": statistics.median(a for a, _ in samples),
        "baseline": statistics.median(b for _, b in samples), "ratio": s["median"],
        "ratio_min": s["min"], "ratio_max": s["max"], "target": TARGETS["cold_start"],
        "pass": s["median"] <= TARGETS["cold_start"],
    }  # fmt: skip


def bench_roundtrip(server: Any, pairs: int, iters: int) -> dict[str, Any]:
    # this benchmark process stands in for the notebook kernel: the magic finds the service
    # the way a kernel under `hora up` does
    os.environ.update(HORA_URL=server.url, HORA_TOKEN=server.token)
    nb.TARGETS["roundtrip"] = TARGETS["roundtrip"]  # the printed target is this one
    shell, cluster = nb.start_shell()
    try:
        if type(cluster).__name__ != "ServiceCluster" or cluster.session is None:
            raise SystemExit("%dist_start did not go through the service")
        print(f"\nengines of session {cluster.session.id} (from the service)")
        result = nb.bench_roundtrip(shell, cluster, pairs, iters)
    finally:
        shell.run_line_magic("dist_stop", "")
    result["bench"] = "sessions.roundtrip"
    result["target"] = TARGETS["roundtrip"]
    result["pass"] = result["ratio"] <= TARGETS["roundtrip"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run, under 60 s")
    p.add_argument("--pairs", type=int, default=5, help="timed pairs per part (after 1 warm-up)")
    p.add_argument("--iters", type=int, default=40, help="cells per round-trip sample")
    args = p.parse_args(argv)
    warmup = not args.quick
    if args.quick:
        args.pairs, args.iters = 1, 10
    import torch

    print(f"bench/sessions.py: torch {torch.__version__}, CPU, gloo, 2 engines, 1 thread per "
          f"engine, {os.cpu_count()} cores; pairs={args.pairs} iters={args.iters}")  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="hora-bench-sessions-") as tmp:
        server = svc.Server(Path(tmp), slots=2)
        try:
            results = [
                bench_cold_start(server, args.pairs, warmup),
                bench_roundtrip(server, args.pairs, args.iters),
            ]
        finally:
            server.stop()
    print()
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
