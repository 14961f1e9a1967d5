"""New large results on huge pages: ``hvd.allreduce`` / ``hvd.allgather`` with and without.

Protocol (../shared/BENCH.md). A collective that returns a new tensor allocates it on every
call; from 32 MiB that is a fresh mapping, faulted in as the result is written
(``hora.torch._pages``). Two ranks on this machine (``--np``), gloo, one thread each, in the
same processes, per size, interleaved rounds of blocks (a barrier before each block, the row
order reversed every other round, one warm-up round):

* ``huge``: ``hvd.allreduce(t)`` as it is, its result advised for huge pages;
* ``small``: the same call with the advice off (``_pages.MIN_BYTES`` past every size): the
  code before, in the same processes and the same minutes;
* ``gloo``: ``dist.all_reduce(t.clone())``, the same work without hora;
* ``gather`` / ``gather_small``: ``hvd.allgather`` of ``size / n`` per rank, with and
  without the advice.

Correct first: each hora row's result equals gloo's. 16 MB is below the threshold, where both
hora rows run the same code: its speed-ups are an A/A control, the spread noise alone gives.
Reported: ms a call (median over the rounds), and per round the speed-up ``small / huge``
(median, min, max). Target (``pass``): ``hvd.allreduce`` faster with the advice at every
size past the threshold (median speed-up > 1); the allgather rows are reported beside it.

Usage: python bench/large_results.py [--quick] [--np 2] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from _world import run_ranks, timed_rounds

MB = 1 << 20
SIZES = [16 * MB, 64 * MB, 256 * MB]
ROWS = ["huge", "small", "gloo", "gather", "gather_small"]
OFF = 1 << 62  # _pages.MIN_BYTES that no tensor reaches: the advice off


def _rows(hvd: Any, dist: Any, pages: Any, on_bytes: int, t: Any) -> dict[str, Any]:
    """The rows for tensor ``t``; ``on_bytes``: ``pages.MIN_BYTES`` as hora ships it."""
    part = t[: t.numel() // hvd.size()]

    def hora(fn: Any, on: bool) -> Any:
        def call() -> Any:
            pages.MIN_BYTES = on_bytes if on else OFF
            return fn()
        return call

    def gloo() -> Any:
        c = t.clone()
        dist.all_reduce(c)
        return c

    return {
        "huge": hora(lambda: hvd.allreduce(t, op=hvd.Sum, name="r"), True),
        "small": hora(lambda: hvd.allreduce(t, op=hvd.Sum, name="r"), False),
        "gloo": gloo,
        "gather": hora(lambda: hvd.allgather(part, name="g"), True),
        "gather_small": hora(lambda: hvd.allgather(part, name="g"), False),
    }


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch import _pages

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce_(torch.zeros(1), name="set-up")
    out: dict[str, Any] = {"load": [os.getloadavg()[0]], "sizes": {}}
    on_bytes = _pages.MIN_BYTES  # read before any row sets it
    for nbytes in SIZES:
        t = torch.arange(nbytes // 4, dtype=torch.float32) % 5 + hvd.rank()
        rows = _rows(hvd, dist, _pages, on_bytes, t)
        ref = rows["gloo"]()
        for row in ("huge", "small"):  # correct first
            if not torch.equal(rows[row](), ref):
                raise SystemExit(f"{row} at {nbytes} bytes differs from gloo's sum")
        calls = 1 if args.quick else max(2, (512 * MB) // nbytes // 2)
        per = timed_rounds(dist, {r: rows[r] for r in ROWS}, args.rounds, calls)
        out["sizes"][nbytes] = {r: [s * 1e3 for s in v] for r, v in per.items()}
    out["load"].append(os.getloadavg()[0])
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    hvd.shutdown()


def report(res: dict[str, Any], np: int) -> dict[str, Any]:
    print(f"large results, {np} ranks, gloo, 1 thread each; load average "
          f"{min(res['load']):.1f}-{max(res['load']):.1f}")
    print("ms a call (median over the rounds); speed-up: the advice off over on, per round")
    print(f"{'size':>7} {'huge':>8} {'small':>8} {'gloo':>8} {'speed-up (min..max)':>22} "
          f"{'gather':>8} {'small':>8} {'speed-up (min..max)':>22} {'gloo/huge':>9}")
    sizes: dict[str, Any] = {}
    for n, per in res["sizes"].items():
        med = {r: statistics.median(v) for r, v in per.items()}
        up = [b / a for a, b in zip(per["huge"], per["small"], strict=True)]
        gup = [b / a for a, b in zip(per["gather"], per["gather_small"], strict=True)]
        row = {"ms": med, "speedup": statistics.median(up), "speedup_min": min(up),
               "gather_speedup": statistics.median(gup), "gather_speedup_min": min(gup)}
        print(f"{int(n) // MB:>4} MB {med['huge']:8.1f} {med['small']:8.1f} {med['gloo']:8.1f} "
              f"{row['speedup']:9.2f} ({min(up):.2f}..{max(up):.2f}) {med['gather']:8.1f} "
              f"{med['gather_small']:8.1f} {row['gather_speedup']:9.2f} "
              f"({min(gup):.2f}..{max(gup):.2f}) {med['gloo'] / med['huge']:9.2f}")
        sizes[f"{int(n) // MB} MB"] = row
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one call a block, 3 rounds")
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.worker:
        worker(args)
        return 0
    t0 = time.monotonic()
    extra = ["--rounds", str(args.rounds)] + (["--quick"] if args.quick else [])
    sizes = report(run_ranks(__file__, args.np, extra), args.np)
    past = [s["speedup"] for n, s in zip(SIZES, sizes.values(), strict=True) if n > 32 * MB]
    top = sizes[f"{SIZES[-1] // MB} MB"]
    print(json.dumps({
        "bench": "large_results", "metric": "hvd.allreduce at 256 MB: ms with the advice "
        "off over on", "hora": top["ms"]["huge"], "baseline": top["ms"]["small"],
        "ratio": top["speedup"], "target": 1.0, "worst_past_threshold": min(past),
        "pass": min(past) > 1.0, "sizes": sizes, "wall_s": round(time.monotonic() - t0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
