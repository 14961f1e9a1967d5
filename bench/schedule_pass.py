"""The job manager's scheduling pass in process, against an older commit, side by side.

``bench/service_scale.py`` times the pass inside a real service under requests and heartbeats,
where another thread's work and the machine's load add to it. This times the pass alone: two
worker processes, one importing this checkout's hora and one the sources of ``--baseline``
(``git archive`` of that commit, first on ``PYTHONPATH``), each with a real
:class:`~hora_service.manager.JobManager` on its own SQLite store per queue length, every
slot held by another holder on the machine (real forked processes holding the slots' leases,
as a notebook's engines or another service would), and ``N`` jobs queued. The workers are
asked in interleaved pairs (A B, then B A; one warm-up pair) for the median of ``--passes``
passes (``Monitor.schedule`` under the manager's lock, as the monitor runs it).

Correct first: in both, every job is still queued after the passes and none was placed.
Ratio of a pair: the baseline's median over this checkout's (above 1: faster now).
Target: one pass <= 10 ms with 1,000 queued (issue 29 item 4) in this checkout.

Usage: python bench/schedule_pass.py [--quick] [--baseline 51c12ee] [--pairs 5]
       [--queued 10,100,1000,10000] [--passes 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from service_submit import baseline_tree  # noqa: E402

TARGET_MS = 10.0

WORKER = r"""
import json, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from helpers.lease_holder import Holder
from hora.leases import LeaseDir
from hora.spec import JobSpec
from hora_service.manager import JobManager
from hora_service.settings import Settings

sizes = [int(x) for x in sys.argv[2].split(",")]
tmp = Path(tempfile.mkdtemp(prefix="hora-bench-pass-"))
managers, holders = {}, []
for n in sizes:
    root = tmp / str(n)
    settings = Settings(data_dir=root / "data", work_root=root, gpus="0,1,2,3,4,5,6,7",
                        lease_dir=root / "leases", user_mode="shared")
    m = JobManager(settings)
    m.open_store()
    m.users.create("ann")
    machine = LeaseDir(root / "leases")
    machine.ready()
    holders += [Holder(machine, m.leases.name(s.index)) for s in m.inventory]
    for _ in range(n):
        m.submit("ann", JobSpec(command=["true"]))
    managers[n] = m
print("ready", flush=True)
try:
    for line in sys.stdin:
        n, passes = (int(x) for x in line.split())
        m, got = managers[n], []
        if hasattr(m, "monitor"):  # the manager composed around its state
            lock, schedule, pending = m.state.lock, m.monitor.schedule, m.state.pending
        else:  # an older tree's manager of mixins
            lock, schedule, pending = m._lock, m._schedule, m._pending
        for _ in range(passes):
            with lock:
                t0 = time.perf_counter()
                schedule(time.time())
                got.append(time.perf_counter() - t0)
        print(json.dumps({"ms": statistics.median(got) * 1000, "queued": len(pending)}),
              flush=True)
finally:
    for h in holders:
        h.kill()
"""


class Worker:
    """One side: a process importing one tree's hora, answering "time N queued" requests."""

    def __init__(self, tree: Path, sizes: list[int]) -> None:
        env = {**os.environ, "PYTHONPATH": f"{tree / 'kernels'}:{tree / 'service'}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(HERE.parent / "tests"), ",".join(map(str, sizes))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        if first != "ready":
            raise SystemExit(f"the worker of {tree} did not start: {first!r}")

    def time(self, n: int, passes: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n} {passes}\n")
        self.proc.stdin.flush()
        got: dict[str, Any] = json.loads(self.proc.stdout.readline())
        if got["queued"] != n:
            raise SystemExit(f"a pass placed a job: {got['queued']} of {n} still queued")
        return got

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced run (< 60 s)")
    p.add_argument("--baseline", default="51c12ee", help="the commit to compare with")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--queued", type=lambda s: [int(x) for x in s.split(",")],
                   default=[10, 100, 1000, 10_000])  # fmt: skip
    p.add_argument("--passes", type=int, default=50)
    args = p.parse_args()
    if args.quick:
        args.pairs, args.queued, args.passes = 2, [10, 1000], 20
    with tempfile.TemporaryDirectory() as tmp:
        tree = baseline_tree(args.baseline, Path(tmp) / "tree")
        sides = {"now": Worker(HERE.parent, args.queued), "baseline": Worker(tree, args.queued)}
        ms: dict[int, dict[str, list[float]]] = {n: {"now": [], "baseline": []}
                                                 for n in args.queued}  # fmt: skip
        try:
            for pair in range(args.pairs + 1):  # pair 0: warm-up, not kept
                order = ["now", "baseline"] if pair % 2 else ["baseline", "now"]
                for n in args.queued:
                    for side in order:
                        got = sides[side].time(n, args.passes)["ms"]
                        if pair:
                            ms[n][side].append(got)
        finally:
            for w in sides.values():
                w.close()
    return report(args, ms)


def report(args: argparse.Namespace, ms: dict[int, dict[str, list[float]]]) -> int:
    """Print the table and the final JSON line; 0 when the target is met."""
    print(f"scheduling pass in process, this checkout vs {args.baseline} (python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"8 slots all held elsewhere, {args.passes} passes a sample, "
          f"{args.pairs} pairs)")  # fmt: skip
    print(f"{'queued':>7} {'now ms':>8} {'baseline ms':>12} {'speed-up med (min..max)':>24}")
    line: dict[str, Any] = {}
    for n, got in ms.items():
        ratios = [b / a for a, b in zip(got["now"], got["baseline"], strict=True)]
        now, base = statistics.median(got["now"]), statistics.median(got["baseline"])
        print(f"{n:>7} {now:>8.3f} {base:>12.3f} {statistics.median(ratios):>10.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f})")  # fmt: skip
        line[n] = (now, base, statistics.median(ratios))
    big = 1000 if 1000 in line else max(line)
    now, base, ratio = line[big]
    ok = now <= TARGET_MS
    print(json.dumps({
        "bench": "schedule_pass", "metric": f"ms a pass at {big} queued, now vs {args.baseline}",
        "hora": round(now, 3), "baseline": round(base, 3), "ratio": round(ratio, 2),
        "target": TARGET_MS, "pass": ok,
    }))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
