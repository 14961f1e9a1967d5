"""A blocking ``hvd.allreduce_`` through shared memory: its cost per call, this checkout vs another.

Protocol (../shared/BENCH.md). Two ranks on this machine, gloo, one thread each. A *run* is
one world of fresh processes that measures, per size (8 B to 16 MB), interleaved rounds of
blocks (a barrier before each block, the row order reversed every other round) of three rows:

* ``hvd``: ``hvd.allreduce_(t, op=Sum)``, the blocking call a script makes (a negotiation
  round, then the data through the set's lane);
* ``ring``: ``ring.allreduce_(t)`` on the set's first ring in the calling thread: the data's
  moves alone, the floor under ``hvd``;
* ``gloo``: ``dist.all_reduce(t)`` on the same ranks.

With ``--before REF``, runs alternate between this checkout and the ``kernels`` of commit REF
(``git archive``, first on ``PYTHONPATH``), A B then B A, ``--pairs`` pairs after one warm-up
pair: both sides run the same script in fresh processes, so the pair's ratio (``before`` µs
over ``now`` µs for the ``hvd`` row, > 1: faster now) compares the two codes in the same
minutes of the machine. Correct first: in every run, every row's result equals gloo's.
Target (with ``--before``): not slower than REF at any size (median speed-up >= 1.0).

``--op Average`` times ``hvd.allreduce_(t, op=Average)`` instead (gloo's row divides after its
sum; the ring row stays the data's moves); ``--sizes 4MB,64MB,256MB`` picks the sizes.

Usage: python bench/blocking_allreduce.py [--quick] [--pairs 5] [--before REF] [--op Average]
       [--sizes 8B,64KB,1MB,4MB,16MB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _world import run_ranks, timed_rounds

HERE = Path(__file__).resolve().parent
SIZES = [8, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024]
ROWS = ["hvd", "ring", "gloo"]


def _calls(nbytes: int, quick: bool) -> int:
    n = max(5, min(1000, (64 << 20) // max(nbytes, 1) // 8))
    return max(3, n // 4) if quick else n


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce_(torch.zeros(1), name="set-up")  # the set's first round maps its segment
    ring = comm_of(None, "bench").shm
    if ring is None:
        raise SystemExit("shared memory is not usable by these ranks (HORA_SHM=off?)")
    out: dict[str, Any] = {"load": [os.getloadavg()[0]], "sizes": {}}
    average = args.op == "Average"

    def gloo(t: Any) -> None:
        dist.all_reduce(t)
        if average:
            t.div_(hvd.size())

    for nbytes in _sizes(args.sizes):
        t = torch.ones(max(1, nbytes // 4))
        rows = {"hvd": lambda t=t: hvd.allreduce_(t, op=getattr(hvd, args.op), name="b"),
                "ring": lambda t=t: ring.allreduce_(t, "allreduce", "b"),
                "gloo": lambda t=t: gloo(t)}
        for row, fn in rows.items():  # correct first: each row reduces like gloo
            x = torch.arange(t.numel(), dtype=torch.float32) % 7 + hvd.rank()
            ref = x.clone()
            dist.all_reduce(ref)
            if average and row != "ring":  # the ring row is the data's moves: a sum
                ref.div_(hvd.size())
            t.copy_(x)
            fn()
            if not torch.equal(t, ref):
                raise SystemExit(f"{row} at {nbytes} bytes differs from gloo's {args.op}")
        calls = _calls(nbytes, args.quick)
        per = timed_rounds(dist, {r: rows[r] for r in ROWS}, args.rounds, calls)
        out["sizes"][nbytes] = {row: statistics.median(v) * 1e6 for row, v in per.items()}
    out["load"].append(os.getloadavg()[0])
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    hvd.shutdown()


def _tree(rev: str, into: Path) -> Path:
    """The ``kernels`` of commit ``rev``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", rev, "kernels"],
                             capture_output=True, check=True, timeout=120)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=120)
    return into / "kernels"


def _run(args: argparse.Namespace, kernels: Path | None) -> dict[str, Any]:
    """One world of two ranks; ``kernels`` first on PYTHONPATH when given (the other code)."""
    saved = os.environ.get("PYTHONPATH")
    if kernels is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(kernels), saved) if p)
    try:
        extra = ["--rounds", str(args.rounds), "--op", args.op, "--sizes", args.sizes]
        return run_ranks(__file__, 2, extra + (["--quick"] if args.quick else []))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _sizes(text: str) -> list[int]:
    """``8B,64KB,4MB`` as bytes."""
    units = {"B": 1, "KB": 1 << 10, "MB": 1 << 20}
    out = []
    for part in text.split(","):
        num = part.rstrip("BKM")
        out.append(int(num) * units[part[len(num):]])
    return out


def _fmt(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n // 1024} KB" if n < 1 << 20 else f"{n >> 20} MB"


def report(runs: list[dict[str, Any]], before: list[dict[str, Any]], ref: str | None) -> dict:
    loads = [x for r in runs + before for x in r["load"]]
    print(f"blocking allreduce, 2 ranks, gloo, 1 thread each; {len(runs)} run(s) a side; "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("µs a call (median over the runs of each run's median); hvd/ring: what the call adds"
          " to the data's moves" + (f"; speed-up: {ref}'s hvd over this checkout's, per pair"
                                    if before else ""))
    head = f"{'size':>7} {'hvd':>9} {'ring':>9} {'gloo':>9} {'hvd/ring':>9} {'gloo/hvd':>9}"
    print(head + (f" {'hvd before':>11} {'speed-up med (min..max)':>24}" if before else ""))
    out: dict[str, Any] = {}
    for n in (int(k) for k in runs[0]["sizes"]):
        med = {row: statistics.median(r["sizes"][str(n)][row] for r in runs) for row in ROWS}
        line = (f"{_fmt(n):>7} {med['hvd']:9.1f} {med['ring']:9.1f} {med['gloo']:9.1f} "
                f"{med['hvd'] / med['ring']:9.2f} {med['gloo'] / med['hvd']:9.2f}")
        row = {"hvd_us": med["hvd"], "ring_us": med["ring"], "gloo_us": med["gloo"]}
        if before:
            old = statistics.median(r["sizes"][str(n)]["hvd"] for r in before)
            ups = [b["sizes"][str(n)]["hvd"] / a["sizes"][str(n)]["hvd"]
                   for a, b in zip(runs, before, strict=True)]
            sp = statistics.median(ups)
            line += f" {old:11.1f} {sp:10.2f} ({min(ups):.2f}..{max(ups):.2f})"
            row.update(before_us=old, speedup=sp, speedup_min=min(ups), speedup_max=max(ups))
        print(line)
        out[_fmt(n)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer calls a block, 1 pair")
    ap.add_argument("--pairs", type=int, default=5, help="timed runs a side (default 5)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds a run (default 6)")
    ap.add_argument("--before", metavar="REF", help="alternate with the kernels of commit REF")
    ap.add_argument("--op", choices=["Sum", "Average"], default="Sum",
                    help="the hvd row's reduce op (default Sum; gloo's row divides after)")
    ap.add_argument("--sizes", default=",".join(map(_fmt, SIZES)).replace(" ", ""),
                    help="comma-separated sizes, e.g. 4MB,64MB,256MB (default 8B to 16MB)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    t0 = time.monotonic()
    pairs = 1 if args.quick else args.pairs
    runs: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hora-bench-") as tmp:
        old = _tree(args.before, Path(tmp)) if args.before else None
        for p in range(pairs + (1 if old else 0)):  # with --before, pair 0 warms up
            order = [False] if old is None else [False, True] if p % 2 == 0 else [True, False]
            got = {side: _run(args, old if side else None) for side in order}
            if old is not None and p == 0:
                continue
            runs.append(got[False])
            if old is not None:
                before.append(got[True])
    table = report(runs, before, args.before)
    at = "4 MB" if "4 MB" in table else list(table)[-1]
    hvd4 = table[at]
    worst = min((r["speedup"] for r in table.values()), default=None) if before else None
    result = {"bench": "blocking_allreduce", "metric": f"µs a blocking hvd.allreduce_ "
              f"({args.op}), {at}"
              + (f", {args.before} / this checkout" if before else ", hvd / ring"),
              "hora": hvd4["hvd_us"], "baseline": hvd4.get("before_us", hvd4["ring_us"]),
              "ratio": hvd4.get("speedup", hvd4["ring_us"] / hvd4["hvd_us"]),
              "target": 1.0 if before else None, "worst_speedup": worst,
              "pass": None if worst is None else worst >= 1.0,
              "sizes": table, "wall_s": round(time.monotonic() - t0)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
