"""Submitting to the job service, against an older commit of hora, side by side in one run.

Issue 29 asks for the submit rate back to at least 1.0x of commit 32b55c1 (the service before
the isolation work). This runs two real uvicorn services on 127.0.0.1 at once, each on its own
store (a real SQLite file) and its own 2 CPU slots: one serving this checkout (the installed
hora) and one serving the sources of ``--baseline`` (``git archive`` of that commit into a
temporary directory, put first on ``PYTHONPATH``), then measures them in interleaved pairs
(A B, then B A, ...; one warm-up pair):

* ``latency``: submit -> running on an idle cluster, one job at a time (``sleep 60``, cancelled
  before the next), from the service's own transition times (``queued`` -> ``running``);
* ``rate``: submissions per second, ``--clients`` concurrent clients submitting ``--jobs``
  jobs into the queue (a blocker job holds every slot, so they stay queued; both services'
  queues grow by the same number of jobs each pair), and the service's CPU time (its
  process, every thread: user + system) a submission over the same sample, which tells work
  from waiting when the rate moves.

Correct first: each service must then hold exactly the jobs it was sent, queued. The ratio of
a pair is this checkout's figure over the baseline's (rate: higher is better; latency: lower).
Target: the submit rate ratio >= 1.0.

Usage: python bench/service_submit.py [--quick] [--baseline 32b55c1] [--pairs 5]
       [--jobs 200] [--latency 15] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_bench_service", HERE / "service.py")
assert _spec is not None and _spec.loader is not None
service = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(service)

TARGET = 1.0


def baseline_tree(rev: str, into: Path) -> Path:
    """The ``kernels`` and ``service`` sources of commit ``rev``, unpacked under ``into``."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", rev, "kernels", "service"],
        capture_output=True, check=True, timeout=120,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=120)
    return into


def latency_ms(srv: Any, n: int) -> float:
    """Median submit -> running (the service's transition times) of ``n`` jobs, one at a time."""
    got = []
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as c:
        for _ in range(n):
            job = c.post("/v1/jobs", json={"command": ["sleep", "60"], "workers": 1}).json()
            running = service.wait_state(c, job["id"], ("running",))
            at = service._at(running, "running") - service._at(running, "queued")
            got.append(at.total_seconds() * 1000)
            c.post(f"/v1/jobs/{job['id']}/cancel")
            service.wait_state(c, job["id"], ("cancelled",))
    return statistics.median(got)


def block(srv: Any) -> None:
    """Hold every slot of ``srv`` with one job, so that what is submitted next stays queued."""
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as c:
        job = c.post("/v1/jobs", json={"command": ["sleep", "3600"], "workers": 2}).json()
        service.wait_state(c, job["id"], ("running",))


def queued(srv: Any) -> int:
    """How many jobs ``srv`` says are queued."""
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as c:
        return int(c.get("/v1/jobs", params={"state": "queued", "limit": 1}).json()["total"])


def submit_rate(srv: Any, jobs: int, clients: int, cpu_ms: list[float]) -> float:
    """Submissions per second into ``srv``; appends the service's CPU ms a submission."""
    proc = psutil.Process(srv.proc.pid)
    before = proc.cpu_times()
    rate = asyncio.run(service._submit_many(srv.url, srv.headers, jobs, clients))
    after = proc.cpu_times()
    cpu_ms.append((after.user - before.user + after.system - before.system) / jobs * 1000)
    return rate


def pairs(sides: dict[str, Any], n: int, measure: Any) -> dict[str, list[float]]:
    """``measure(server)`` for each side, in ``n`` interleaved pairs after a warm-up pair."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(n + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            value = measure(sides[name])
            if i:
                out[name].append(value)
    return out


def ratios(got: dict[str, list[float]], higher_is_better: bool) -> list[float]:
    """Per pair: this checkout's figure over the baseline's (inverted for a latency)."""
    now, before = got["now"], got["baseline"]
    return [(a / b if higher_is_better else b / a) for a, b in zip(now, before, strict=True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced run (< 60 s)")
    p.add_argument("--baseline", default="32b55c1", help="the commit to compare with")
    p.add_argument("--pairs", type=int, default=None)
    p.add_argument("--jobs", type=int, default=None, help="jobs submitted per side per pair")
    p.add_argument("--latency", type=int, default=None, help="jobs per latency sample")
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args()
    npairs = args.pairs or (2 if args.quick else 5)
    jobs = args.jobs or (60 if args.quick else 200)
    nlat = args.latency or (5 if args.quick else 15)
    with tempfile.TemporaryDirectory(prefix="hora-submit-") as tmp:
        tree = baseline_tree(args.baseline, Path(tmp) / "tree")
        (Path(tmp) / "now").mkdir()
        (Path(tmp) / "base").mkdir()
        sides = {
            "now": service.Server(Path(tmp) / "now", slots=2),
            "baseline": service.Server(Path(tmp) / "base", slots=2, tree=tree),
        }
        try:
            lat = pairs(sides, npairs, lambda s: latency_ms(s, nlat))
            for srv in sides.values():
                block(srv)
            cpu: dict[int, list[float]] = {id(srv): [] for srv in sides.values()}
            rate = pairs(
                sides, npairs, lambda s: submit_rate(s, jobs, args.clients, cpu[id(s)])
            )  # fmt: skip
            # the warm-up pair's figures are dropped, as pairs() drops its rates
            cpu_ms = {name: cpu[id(srv)][1:] for name, srv in sides.items()}
            held = {name: queued(srv) for name, srv in sides.items()}
        finally:
            for srv in sides.values():
                srv.stop()
    want = jobs * (npairs + 1)
    if any(v != want for v in held.values()):
        raise SystemExit(f"expected {want} jobs queued on each side, found {held}")
    return report(args, npairs, jobs, nlat, lat, rate, cpu_ms)


def report(
    args: argparse.Namespace, npairs: int, jobs: int, nlat: int,
    lat: dict[str, list[float]], rate: dict[str, list[float]], cpu_ms: dict[str, list[float]],
) -> int:  # fmt: skip
    """Print the table and the final JSON line; 0 when the target is met."""
    r_rate, r_lat, r_cpu = ratios(rate, True), ratios(lat, False), ratios(cpu_ms, False)
    print(
        f"hora service submission, this checkout vs {args.baseline} (python "
        f"{sys.version.split()[0]}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"{npairs} pairs after 1 warm-up pair)"
    )
    print(f"{'pair':>4} {'submits/s now':>14} {'baseline':>9} {'ratio':>6}   "
          f"{'CPU ms/submit now':>17} {'baseline':>9} {'saving':>6}   "
          f"{'submit->running ms now':>22} {'baseline':>9} {'speed':>6}")  # fmt: skip
    for i in range(npairs):
        print(f"{i:>4} {rate['now'][i]:>14.1f} {rate['baseline'][i]:>9.1f} {r_rate[i]:>6.2f}   "
              f"{cpu_ms['now'][i]:>17.3f} {cpu_ms['baseline'][i]:>9.3f} {r_cpu[i]:>6.2f}   "
              f"{lat['now'][i]:>22.2f} {lat['baseline'][i]:>9.2f} {r_lat[i]:>6.2f}")  # fmt: skip
    med = statistics.median(r_rate)
    print(
        f"submit rate ({args.clients} clients, {jobs} jobs a sample): ratio median {med:.2f} "
        f"(min {min(r_rate):.2f}, max {max(r_rate):.2f}); target >= {TARGET}\n"
        f"the service's CPU a submission, baseline / now: median {statistics.median(r_cpu):.2f} "
        f"(min {min(r_cpu):.2f}, max {max(r_cpu):.2f})\n"
        f"submit -> running ({nlat} jobs a sample, baseline / now): median "
        f"{statistics.median(r_lat):.2f} (min {min(r_lat):.2f}, max {max(r_lat):.2f})"
    )
    line = {
        "bench": "service_submit", "metric": f"submits/s, this checkout / {args.baseline}",
        "hora": round(statistics.median(rate["now"]), 1),
        "baseline": round(statistics.median(rate["baseline"]), 1),
        "ratio": round(med, 3), "ratio_min": round(min(r_rate), 3),
        "ratio_max": round(max(r_rate), 3), "target": TARGET, "pass": med >= TARGET,
        "latency_ratio": round(statistics.median(r_lat), 3),
        "cpu_ms_per_submit": round(statistics.median(cpu_ms["now"]), 3),
        "cpu_ms_per_submit_baseline": round(statistics.median(cpu_ms["baseline"]), 3),
        "cpu_saving": round(statistics.median(r_cpu), 3),
    }  # fmt: skip
    print(json.dumps(line))
    return 0 if line["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
