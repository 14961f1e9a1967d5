"""Allreduce sweep: hora.torch vs raw torch.distributed.all_reduce, 2 processes on gloo.

Protocol (../shared/BENCH.md): both sides do the same work in the same processes; for each
size, a correctness check, one warm-up pair, then 11 timed pairs (7 with --quick). A pair is a
block of hora calls and a block of baseline calls (barrier before each block), alternating
which block goes first. Reported: the median of the per-pair busbw ratios (hora / raw), with
min and max. Rows:

* ``sum``:     hvd.allreduce_(t, op=Sum)      vs dist.all_reduce(t)
* ``avg``:     hvd.allreduce_(t, op=Average)  vs dist.all_reduce(t); t.div_(n)
* ``sum_oop``: hvd.allreduce(t, op=Sum) (new tensor, input kept) vs dist.all_reduce(t.clone())
* ``raw_vs_raw``: dist.all_reduce vs itself, an A/A control that shows the noise floor (not
  part of the target)

Target: hora >= 0.95x raw busbw for every size >= 1 MB, on every row.

Usage: python bench/allreduce.py [--quick] [--np 2] [--pairs 11]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _world import run_ranks

KB, MB = 1024, 1024 * 1024
FULL_SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [4 * KB, 64 * KB, 1 * MB, 4 * MB, 16 * MB]
TARGET = 0.95
ROWS = ["sum", "avg", "sum_oop", "raw_vs_raw"]
TARGET_ROWS = ("sum", "avg", "sum_oop")


def _calls(nbytes: int, quick: bool) -> int:
    """Calls per timed block: enough to last ~10 ms at small sizes, at least 3."""
    return max(3, min(50, (4 if quick else 16) * MB // nbytes))


def _ops(kind: str, hvd: Any, dist: Any, n: int) -> tuple[Any, Any]:
    if kind == "sum":
        return (lambda t: hvd.allreduce_(t, op=hvd.Sum, name="bench"), lambda t: dist.all_reduce(t))
    if kind == "avg":
        return (
            lambda t: hvd.allreduce_(t, op=hvd.Average, name="bench"),
            lambda t: (dist.all_reduce(t), t.div_(n)),
        )
    if kind == "raw_vs_raw":  # A/A control: how far noise alone moves the ratio
        return (lambda t: dist.all_reduce(t), lambda t: dist.all_reduce(t))
    return (
        lambda t: hvd.allreduce(t, op=hvd.Sum, name="bench"),
        lambda t: dist.all_reduce(t.clone()),
    )


def _block(fn: Any, t: Any, calls: int, dist: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(t)
    return (time.perf_counter() - t0) / calls


def _pairs(a: Any, b: Any, t: Any, calls: int, n: int, dist: Any) -> list[tuple[float, float]]:
    """One warm-up pair, then ``n`` timed pairs of blocks; odd pairs run B first."""
    out = []
    for k in range(n + 1):
        if k % 2:
            tb = _block(b, t, calls, dist)
            out.append((_block(a, t, calls, dist), tb))
        else:
            ta = _block(a, t, calls, dist)
            out.append((ta, _block(b, t, calls, dist)))
    return out[1:]


def _check(hvd: Any, dist: Any, torch: Any, numel: int) -> None:
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(numel, dtype=torch.float32) % 97 + r
    a = x.clone()
    hvd.allreduce_(a, op=hvd.Sum)
    b = x.clone()
    dist.all_reduce(b)
    c = hvd.allreduce(x, op=hvd.Average)
    if not (torch.equal(a, b) and torch.allclose(c, b / n)):
        raise SystemExit(f"correctness check failed at {numel * 4} bytes")


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    results = []
    for nbytes in QUICK_SIZES if args.quick else FULL_SIZES:
        numel = nbytes // 4
        _check(hvd, dist, torch, numel)
        t = torch.ones(numel)
        calls = _calls(nbytes, args.quick)
        for kind in ROWS:
            a, b = _ops(kind, hvd, dist, n)
            pairs = _pairs(a, b, t, calls, args.pairs, dist)
            results.append({"bytes": nbytes, "row": kind, "calls": calls, "pairs": pairs})
    if hvd.rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "np": n,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "results": results,
                }
            )
        )
    hvd.shutdown()


def launch(args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--pairs", str(args.pairs)] + (["--quick"] if args.quick else [])
    return run_ranks(__file__, args.np, worker)


def _fmt(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def report(data: dict[str, Any]) -> dict[str, Any]:
    n = data["np"]
    busf = 2 * (n - 1) / n
    print(
        f"allreduce, {n} processes, gloo, {data['threads']} thread(s) each, torch {data['torch']}"
    )
    print(
        f"{'size':>7} {'row':>8} {'hora algbw':>11} {'raw algbw':>10} {'hora busbw':>11} "
        f"{'raw busbw':>10} {'ratio med':>9} {'min':>6} {'max':>6}  (GB/s)"
    )
    worst, rows = None, []
    for res in data["results"]:
        ratios = [b / a for a, b in res["pairs"]]
        ha = res["bytes"] / statistics.median(a for a, _ in res["pairs"]) / 1e9
        ra = res["bytes"] / statistics.median(b for _, b in res["pairs"]) / 1e9
        med = statistics.median(ratios)
        rows.append(
            {
                "bytes": res["bytes"],
                "row": res["row"],
                "ratio": med,
                "hora_busbw": ha * busf,
                "raw_busbw": ra * busf,
            }
        )
        print(
            f"{_fmt(res['bytes']):>7} {res['row']:>8} {ha:11.3f} {ra:10.3f} {ha * busf:11.3f} "
            f"{ra * busf:10.3f} {med:9.3f} {min(ratios):6.3f} {max(ratios):6.3f}"
        )
        if (
            res["bytes"] >= MB
            and res["row"] in TARGET_ROWS
            and (worst is None or med < worst["ratio"])
        ):
            worst = rows[-1]
    assert worst is not None
    _pooled(data)
    return worst


def _pooled(data: dict[str, Any]) -> None:
    """Per row, the median of every per-pair ratio at sizes >= 1 MB (a steadier summary)."""
    for row in ROWS:
        ratios = [
            b / a
            for res in data["results"]
            if res["row"] == row and res["bytes"] >= MB
            for a, b in res["pairs"]
        ]
        print(
            f"pooled >= 1 MB {row:>10}: median ratio {statistics.median(ratios):.3f} "
            f"over {len(ratios)} pairs"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced sweep, under 60 s")
    p.add_argument("--np", type=int, default=2)
    p.add_argument(
        "--pairs", type=int, default=None, help="least timed pairs per size (11; quick 7)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.pairs = args.pairs or (7 if args.quick else 11)
    if args.worker:
        worker(args)
        return 0
    t0 = time.monotonic()
    worst = report(launch(args))
    ok = worst["ratio"] >= TARGET
    print(
        f"worst size >= 1 MB: {_fmt(worst['bytes'])} {worst['row']} ratio {worst['ratio']:.3f}; "
        f"wall {time.monotonic() - t0:.0f}s"
    )
    print(
        json.dumps(
            {
                "bench": "allreduce",
                "metric": "busbw ratio hora/raw, worst median over sizes >= 1MB",
                "hora": round(worst["hora_busbw"], 4),
                "baseline": round(worst["raw_busbw"], 4),
                "ratio": round(worst["ratio"], 4),
                "target": TARGET,
                "pass": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
