"""The shared-memory ring's slot size against its busbw: is 4 MiB the right chunk?

The ring (``kernels/hora/torch/_shm.py``) cuts a tensor into chunks of one slot (4 MiB a rank
for two ranks) and passes one barrier a chunk. A smaller slot keeps each chunk's three passes
(copy in, sum a slice, copy out) in the caches, at the cost of more barriers; ranks that
outnumber their CPUs can pay a millisecond a barrier, and take bigger slots. This runs
``--ranks`` ranks (2 by default; gloo, 1 thread each) that set up one ring per slot size in
``--slots`` (each the module's own code with its slot sizes set, in its own segment), check
that each gives gloo's sum (exactly at 2 ranks), then time ``ring.allreduce_(t)`` at 1 to
256 MB for every slot and a plain copy of the same size, in rounds whose order rotates, after
one warm-up round (../shared/BENCH.md). A round's time is its slowest rank's.

Prints, per size, the copy's GB/s and each slot's busbw (median over the rounds), then one
JSON line: the best slot against the current one (the slot hora gives these ranks on this
machine: crowded or not), per size. The "target" is the current slot being within 10 % of
the best at every size >= 4 MB.

Usage: python bench/shm_slots.py [--quick] [--ranks 2] [--pairs 9] [--slots 512,1024,2048,4096]
(KiB)
(``--quick``: 1 and 4 MiB slots, 4 and 16 MB, 3 rounds.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _world import ring_from_file, run_ranks, slowest_rounds

MB = 1024 * 1024
SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [4 * MB, 16 * MB]
SHM = Path(__file__).resolve().parent.parent / "kernels" / "hora" / "torch" / "_shm.py"


def _ring(slot: int, comm: Any) -> Any:
    """A ring of this checkout's code with slots of ``slot`` bytes, in its own segment."""
    from hora.torch import _shm

    budget = _shm.NBUF * comm.size * slot  # the slot whether the ranks are crowded or not
    ring = ring_from_file(SHM, comm, f"hora_shm_{slot}", SLOT_MAX=slot, CROWDED_SLOT_MAX=slot,
                          SLOT_MIN=min(_shm.SLOT_MIN, slot), SEGMENT_BUDGET=budget,
                          CROWDED_BUDGET=budget)
    assert ring.slot == slot, f"a ring of {ring.slot}-byte slots, not {slot}"  # noqa: S101
    return ring


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce_(torch.zeros(1), name="set-up")
    comm = comm_of(None, "bench")
    slots = [int(s) * 1024 for s in args.slots.split(",")]
    rings = {str(s): _ring(s, comm) for s in slots}
    rows = ["copy", *rings]
    out: dict[str, Any] = {"load": [os.getloadavg()[0]], "sizes": {}, "slot": comm.shm.slot}
    for nbytes in QUICK_SIZES if args.quick else SIZES:
        t, src, dst = (torch.ones(nbytes // 4) for _ in range(3))
        x = torch.arange(t.numel(), dtype=torch.float32) % 251 + hvd.rank()
        ref = x.clone()
        dist.all_reduce(ref)
        tol = 0.0 if hvd.size() == 2 else 1e-6
        for name, ring in rings.items():
            y = x.clone()
            ring.allreduce_(y, "allreduce", "check")
            if not torch.allclose(y, ref, rtol=tol, atol=tol):
                raise SystemExit(f"slot {name}: the sum differs from gloo's at {nbytes} bytes")
        calls = max(3, min(20, 32 * MB // nbytes))
        rounds = []
        for i in range(args.pairs + 1):
            timed = {}
            for row in rows[i % len(rows):] + rows[:i % len(rows)]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if row == "copy":
                        dst.copy_(src)
                    else:
                        rings[row].allreduce_(t, "allreduce", "bench")
                timed[row] = (time.perf_counter() - t0) / calls
            rounds.append(timed)
        out["sizes"][str(nbytes)] = slowest_rounds(dist, rounds[1:])
    out["load"].append(os.getloadavg()[0])
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    hvd.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 slots, 2 sizes, 3 rounds")
    p.add_argument("--ranks", type=int, default=2, help="ranks (on this machine)")
    p.add_argument("--pairs", type=int, default=9, help="timed rounds per size")
    p.add_argument("--slots", default="512,1024,2048,4096", help="slot sizes, KiB")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.pairs, args.slots = 3, "1024,4096"
    n = args.ranks
    data = run_ranks(__file__, n, ["--pairs", str(args.pairs), "--slots", args.slots]
                     + (["--quick"] if args.quick else []))
    current = str(data["slot"])  # the slot hora's own ring took in these ranks
    names = [str(int(s) * 1024) for s in args.slots.split(",")]
    print(f"{n} ranks, 1 thread each; hora's slot {int(current) // 1024} KiB; load average"
          f" {data['load'][0]:.1f} -> {data['load'][1]:.1f}; busbw GB/s by slot (median over"
          " rounds); copy: GB/s of a copy of the size, to the last rank")
    print(f"{'size':>7} {'copy':>6} " + " ".join(f"{int(n) // 1024:>6}K" for n in names))
    best_vs_current: dict[int, float] = {}
    busbw: dict[int, tuple[float, float]] = {}  # size in MB: (best slot's, the current's)
    busf = 2 * (n - 1) / n
    for key, rounds in data["sizes"].items():
        nbytes = int(key)
        bw = {k: statistics.median(nbytes / r[k] / 1e9 * (1 if k == "copy" else busf)
                                   for r in rounds) for k in ["copy", *names]}
        print(f"{nbytes // MB:>4} MB {bw['copy']:6.2f} " + " ".join(f"{bw[k]:7.2f}" for k in names))
        if current in names:
            busbw[nbytes // MB] = (max(bw[k] for k in names), bw[current])
            best_vs_current[nbytes // MB] = round(busbw[nbytes // MB][0] / bw[current], 3)
    ok = all(v <= 1.1 for mb, v in best_vs_current.items() if mb >= 4)
    worst = max(best_vs_current, key=lambda mb: best_vs_current[mb], default=None)
    print(json.dumps({"bench": "shm_slots", "metric": "best slot's busbw / the current slot's",
                      "hora": busbw[worst][1] if worst else None,
                      "baseline": busbw[worst][0] if worst else None,
                      "ratio": best_vs_current.get(worst) if worst else None, "target": 1.1,
                      "pass": ok, "current_slot": int(current),
                      "best_vs_current": best_vs_current}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
