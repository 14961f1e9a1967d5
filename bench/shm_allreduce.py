"""Shared-memory reductions against the machine's limit: hora vs its derived bound and gloo.

Protocol (../shared/BENCH.md, rule 8). For 2 and 3 ranks on this machine, per size (1 to 256
MB), interleaved rounds of blocks (a barrier before each block, the row order reversed every
other round), after a correctness check (every row's result equals gloo's, exactly for 2
ranks, and has the same bits on every rank):

* ``deep``: every rank copies 256 MB into another buffer at the same time (both already
  written once: no first-touch faults), far past the caches (32 MiB of L3 here): the
  machine's copy bandwidth per rank, ``B``, which sets the bound. Timed in every round of
  every size, beside the rows it bounds.
* ``copy``: the same at the row's size. Up to 16 MB (32 MB a rank with source and
  destination) part of it runs from the caches, so it reads faster than ``deep``; the
  fraction of the bound it would give is shown too (``of size copy``).

A block's time is its slowest rank's (every rank times its own; they are gathered at the
end): a collective is done when its last rank is, and ``n`` copies "at the same time" take
until the last one ends. With more ranks than cores, one rank's own copy can run alone on a
core while the others share the rest; the time to the last rank counts the sharing that the
ranks of a reduction meet at every barrier. The copy row also shows rank 0's own rate.
* ``own`` and ``cross``: the same moves between the ranks' caches, without hora: every rank
  copies ``S`` into its own region of a file all of them map, a barrier, then copies ``S``
  out of a region (its own for ``own``; the previous rank's, just written by another core,
  for ``cross``), a barrier (the ring's, as between its chunks). Reported as two copies'
  bytes per second, with ``cross / own``: what reading another core's fresh data costs at
  that moment. It is a diagnosis, not a bound: the rows of a round that miss the target can
  be set beside the same round's ``cross / own``. The ``cross`` row also gives the busbw of
  a reduction that would take its time (and, with ``--before``, that reduction against
  ``before``): a 2-rank allreduce reads ``S`` of the other rank's fresh data too, and writes
  ``S`` into shared memory (its own slice's sum among it) and ``S`` into its tensor.
* ``ring``: the set's ring itself, ``ring.allreduce_(t)`` in the calling thread: the data's
  moves alone, without the negotiation round and the lane's thread around them.
* ``hvd.allreduce_``: ``hvd.allreduce_(t, op=Sum)`` (in place; a negotiation round, then the
  ring of the set's lane on the lane's thread). Its difference from ``ring`` is the per-call
  cost of name matching and of handing the data to the lane.
* ``bucket``: a DistributedOptimizer over one parameter of the size: ``p.grad = g`` then
  ``synchronize()`` (the gradient packed into its bucket, the bucket reduced in place in
  shared memory; op Average, as the optimizer's default).
* ``gloo``: ``dist.all_reduce(t)`` on the same ranks.
* ``before`` (with ``--before REF``): the ring of commit REF (``kernels/hora/torch/_shm.py``
  loaded from git next to the current one, with REF's ``_shm_ops.py`` where it has one),
  ``ring.allreduce_(t)``, which is what that commit's optimizer and preflight used for a
  bucket.

The bound (docs/dev/benchmarks.md): an allreduce of ``S`` bytes by reduce-scatter and
allgather in shared memory makes each rank move ``k = 1 + (n+1)/(2n) + (n-1)/n`` times what
a copy of ``S`` moves, for a tensor outside shared memory (copy in the slices the others sum,
sum its own slice, copy every summed slice out) and for a bucket that lives in shared memory
(pack, sum a slice, gather the others' slices) alike. With every rank copying at ``B`` at the
same time, busbw can be at most ``B / k x 2(n-1)/n``. Reported: each row's busbw (median
over rounds), its fraction of the bound (the median of per-round fractions, the bound from
the same round's ``deep`` copy; beside it the same from the size's own copy), and ratios to
gloo and to ``before``. Also the copy rate at 256 MB of one process alone and of two at
once, best of five before the rounds, as the machine's figure.

Targets (issue 29): busbw >= 0.7 of the bound at every size >= 16 MB for both hora rows;
hora >= 3x ``before`` at 4 MB (when ``--before`` is given). With ``--before`` a line per world
size (and the JSON's ``target_of_size_copy_at_4MB``) gives that target as a fraction of the
bound from the 4 MB copy (3x ``before``'s ``of size copy``), beside hora's best row there.

Usage: python bench/shm_allreduce.py [--quick] [--ranks 2,3] [--pairs 5] [--before REF]
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

from _world import load_module, ring_from_file, run_ranks, slowest_rounds

MB = 1024 * 1024
FULL_SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [4 * MB, 16 * MB]
TARGET, TARGET_BEFORE = 0.7, 3.0
ROWS = ["deep", "copy", "own", "cross", "ring", "allreduce", "bucket", "gloo"]
COPY_ROWS = ("copy", "deep", "own", "cross")
DEEP = 256 * MB  # past the caches: the copy that sets the bound


def passes(n: int) -> float:
    """Copies' worth of memory traffic per rank for one allreduce (see the docstring)."""
    scatter = (n + 1) / (2 * n)  # read n slices of S/n, write one
    return 1 + scatter + (n - 1) / n


def _calls(nbytes: int) -> int:
    return max(3, min(20, 32 * MB // nbytes))


def _load_before(path: str | None, comm: Any) -> Any:
    """The ring of the ``--before`` commit, set up on the same ranks (its own segment), with
    that commit's ``_shm_ops`` where it has one (written beside its ``_shm``)."""
    if not path:
        return None
    ops = Path(path).with_name("_shm_ops_before.py")
    if not ops.exists():
        return ring_from_file(path, comm, "hora_shm_before")
    return ring_from_file(path, comm, "hora_shm_before",
                          _shm_ops=load_module(ops, "hora_shm_ops_before"))


class Rows:
    """Every row's operation on one size, in the same processes."""

    def __init__(self, torch: Any, dist: Any, hvd: Any, nbytes: int, ring: Any,
                 before: Any, deep: tuple[Any, Any]) -> None:
        self.torch, self.dist, self.hvd, self.ring, self.before = torch, dist, hvd, ring, before
        self.deep = deep
        numel = nbytes // 4
        regions = _shared_regions(torch, ring, numel)  # the views keep the mapping alive
        me, n = ring.index, ring.size
        self.mine, self.prev = regions[me], regions[(me - 1) % n]
        self.src, self.dst = torch.ones(numel), torch.zeros(numel)
        self.t = torch.ones(numel)
        self.param = torch.nn.Parameter(torch.zeros(numel))
        self.grad = torch.full((numel,), float(hvd.rank() + 1))
        sgd = torch.optim.SGD([self.param], lr=0.0)
        self.opt = hvd.DistributedOptimizer(sgd, named_parameters=[("p", self.param)])
        for _ in range(2):  # the first synchronize moves the bucket into shared memory
            self.bucket()

    def barrier(self) -> None:
        """The ring's own barrier (what separates its chunks), as one operation of its own."""
        self.ring.run("barrier", "bench", self.ring.step, "barrier", "bench", 0, 0, 0)

    def bucket(self) -> None:
        self.param.grad = self.grad
        self.opt.synchronize()

    def run(self, row: str) -> None:
        if row == "copy":
            self.dst.copy_(self.src)
        elif row == "deep":
            self.deep[1].copy_(self.deep[0])
        elif row in ("own", "cross"):
            self.mine.copy_(self.src)
            self.barrier()
            self.dst.copy_(self.mine if row == "own" else self.prev)
            self.barrier()
        elif row == "ring":
            self.ring.allreduce_(self.t, "allreduce", "bench")
        elif row == "allreduce":
            self.hvd.allreduce_(self.t, op=self.hvd.Sum, name="bench")
        elif row == "bucket":
            self.bucket()
        elif row == "gloo":
            self.dist.all_reduce(self.t)
        else:
            self.before.allreduce_(self.t, "allreduce", "bench")

    def check(self) -> dict[str, bool]:
        """Each row's result equals gloo's on this rank (exactly for 2 ranks)."""
        torch, n = self.torch, self.hvd.size()
        x = torch.arange(self.t.numel(), dtype=torch.float32) % 251 + self.hvd.rank()
        ref = x.clone()
        self.dist.all_reduce(ref)
        got = {"allreduce": x.clone()}
        self.hvd.allreduce_(got["allreduce"], op=self.hvd.Sum, name="check")
        got["ring"] = x.clone()
        self.ring.allreduce_(got["ring"], "allreduce", "check")
        self.param.grad = x.clone()
        self.opt.synchronize()
        got["bucket"] = self.param.grad * n  # the optimizer averages
        if self.before is not None:
            got["before"] = x.clone()
            self.before.allreduce_(got["before"], "allreduce", "check")
        tol = 0.0 if n == 2 else 1e-6
        return {k: bool(torch.allclose(v, ref, rtol=tol, atol=tol)) for k, v in got.items()}


def _shared_regions(torch: Any, ring: Any, numel: int) -> list[Any]:
    """A region of ``numel`` floats per rank in one file every rank maps, set up through the
    ring exactly as the optimizer's arena is (``hora.torch._arena._share``)."""
    from hora.torch import _arena, _shm

    size = _shm.ALIGN + ring.size * numel * 4  # the segment's header page, then the regions
    mm = ring.run("bench", "regions", _arena._share, ring, size, "bench")
    if mm is None:
        raise SystemExit(f"cannot map a {size}-byte segment in /dev/shm for the cross rows")
    flat = torch.frombuffer(mm, dtype=torch.float32, offset=_shm.ALIGN, count=ring.size * numel)
    flat.fill_(0.0)  # every page touched once: no first-touch faults in the rounds
    return [flat[j * numel : (j + 1) * numel] for j in range(ring.size)]


def _block(rows: Rows, row: str, calls: int) -> float:
    calls = 1 if row == "deep" else calls  # one 256 MB copy: tens of milliseconds
    rows.dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        rows.run(row)
    return (time.perf_counter() - t0) / calls


def _copy_alone_and_together(torch: Any, dist: Any, rank: int, reps: int) -> dict[str, float]:
    """256 MB copies: rank 0 alone, then ranks 0 and 1 at once (best of ``reps``, GB/s)."""
    src, dst = torch.ones(64 * MB), torch.zeros(64 * MB)
    out: dict[str, float] = {}
    for label, who in (("one", {0}), ("two", {0, 1})):
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            if rank in who:
                t0 = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - t0)
        out[label] = 256 * MB / best / 1e9 if rank == 0 else 0.0
    return out


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce_(torch.zeros(1), name="set-up")  # the set's first round maps its segment
    comm = comm_of(None, "bench")
    if comm.shm is None:
        raise SystemExit("shared memory is not usable by these ranks (HORA_SHM=off?)")
    before = _load_before(args.before_file, comm)
    rows_run = ROWS + (["before"] if before is not None else [])
    result: dict[str, Any] = {"np": hvd.size(), "torch": torch.__version__, "rows": rows_run,
                              "slot": comm.shm.slot,
                              "load": [os.getloadavg()[0]], "sizes": {},
                              "copy256": _copy_alone_and_together(torch, dist, hvd.rank(), 5)}
    deep = (torch.ones(DEEP // 4), torch.zeros(DEEP // 4))
    for nbytes in QUICK_SIZES if args.quick else FULL_SIZES:
        rows = Rows(torch, dist, hvd, nbytes, comm.shm, before, deep)
        check = rows.check()
        if not all(check.values()):
            raise SystemExit(f"correctness check failed at {nbytes} bytes: {check}")
        calls = _calls(nbytes)
        rounds = []
        for r in range(args.pairs + 1):
            order = rows_run if r % 2 == 0 else rows_run[::-1]
            rounds.append({row: _block(rows, row, calls) for row in order})
        slowest = slowest_rounds(dist, rounds[1:])
        for mine, slow in zip(rounds[1:], slowest, strict=True):
            slow["copy0"] = mine["copy"]  # rank 0's own copy, beside the one to the last rank
        result["sizes"][nbytes] = {"calls": calls, "rounds": slowest, "check": check}
        del rows
    result["load"].append(os.getloadavg()[0])
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    hvd.shutdown()


def _fmt(nbytes: int) -> str:
    return f"{nbytes // MB} MB"


def report(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Print one world's table; return its rows (size, row, busbw, fraction of bound, ...)."""
    n = data["np"]
    busf = 2 * (n - 1) / n
    c = data["copy256"]
    print(f"\n{n} ranks, 1 thread each, torch {data['torch']}; load average {data['load'][0]:.1f}"
          f" -> {data['load'][1]:.1f}; copy at 256 MB: {c['one']:.2f} GB/s alone, "
          f"{c['two']:.2f} GB/s per process with two at once")
    print(f"passes per allreduce: {passes(n):.3f} copies (a tensor or a bucket in shared "
          f"memory); slot {data['slot'] // 1024} KiB")
    print(f"{'size':>7} {'row':>10} {'busbw':>7} {'bound':>7} {'of bound':>9} {'min':>6} "
          f"{'max':>6} {'of size copy':>12} {'vs gloo':>8} {'vs before':>9}  (GB/s; copy rows:"
          " per rank, to the last; deep: 256 MB)")
    out = []
    for key, info in data["sizes"].items():
        nbytes = int(key)
        rounds = info["rounds"]
        for row in data["rows"]:
            out.append(_row(nbytes, row, rounds, n, busf, "before" in data["rows"]))
    return out


def _row(nbytes: int, row: str, rounds: list[dict[str, float]], n: int, busf: float,
         has_before: bool) -> dict[str, Any]:
    med = statistics.median
    if row in COPY_ROWS:
        size = {"deep": DEEP, "copy": nbytes}.get(row, 2 * nbytes)  # own, cross: two copies
        bw = med(size / r[row] / 1e9 for r in rounds)
        out = {"bytes": nbytes, "row": row, "busbw": bw}
        if row == "copy":
            note = f"(rank 0's own copy: {med(nbytes / r['copy0'] / 1e9 for r in rounds):.2f})"
        elif row == "deep":
            note = "(256 MB, past the caches: sets the bound)"
        elif row == "own":
            note = "(in, barrier, out of its own region, barrier)"
        else:
            out["cross_own"] = med(r["own"] / r["cross"] for r in rounds)
            out["vs_before"] = med(r["before"] / r["cross"] for r in rounds) if has_before \
                else float("nan")
            as_red = med(nbytes / r["cross"] / 1e9 * busf for r in rounds)
            note = (f"(out of the previous rank's region; cross / own {out['cross_own']:.3f}; "
                    f"as a reduction's busbw {as_red:.2f}"
                    + (f", {out['vs_before']:.2f}x before)" if has_before else ")"))
        print(f"{_fmt(nbytes):>7} {row:>10} {bw:7.2f}   {note}")
        return out
    bw = med(nbytes / r[row] / 1e9 * busf for r in rounds)
    k = passes(n)
    fracs = [(nbytes / r[row]) / (DEEP / r["deep"] / k) for r in rounds]
    by_size = med((nbytes / r[row]) / (nbytes / r["copy"] / k) for r in rounds)
    bound = med(DEEP / r["deep"] / 1e9 / k * busf for r in rounds)
    vs_gloo = med(r["gloo"] / r[row] for r in rounds)
    vs_before = med(r["before"] / r[row] for r in rounds) if has_before else float("nan")
    print(f"{_fmt(nbytes):>7} {row:>10} {bw:7.2f} {bound:7.2f} {med(fracs):9.3f} "
          f"{min(fracs):6.3f} {max(fracs):6.3f} {by_size:12.3f} {vs_gloo:8.2f} {vs_before:9.2f}")
    return {"bytes": nbytes, "row": row, "busbw": bw, "bound": bound, "fraction": med(fracs),
            "of_size_copy": by_size, "vs_gloo": vs_gloo, "vs_before": vs_before}


def launch(args: argparse.Namespace, n: int) -> dict[str, Any]:
    worker_args = ["--pairs", str(args.pairs)] + (["--quick"] if args.quick else [])
    if not args.before:
        return run_ranks(__file__, n, worker_args)
    with tempfile.TemporaryDirectory(prefix="hora-before-") as tmp:
        for name in ("_shm", "_shm_ops"):  # _shm_ops only from 237772a on
            got = subprocess.run(["git", "show", f"{args.before}:kernels/hora/torch/{name}.py"],
                                 cwd=Path(__file__).resolve().parent.parent,
                                 capture_output=True, text=True, check=name == "_shm")
            if got.returncode == 0:
                Path(tmp, f"{name}_before.py").write_text(got.stdout)
        before = str(Path(tmp, "_shm_before.py"))
        return run_ranks(__file__, n, [*worker_args, "--before-file", before])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 ranks, 4 and 16 MB, 3 rounds")
    p.add_argument("--ranks", default="2,3", help="world sizes to run, comma-separated")
    p.add_argument("--pairs", type=int, default=5, help="timed rounds per size")
    p.add_argument("--before", metavar="GIT_REF", help="add the ring of this commit as a row")
    p.add_argument("--before-file", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sizes = [int(x) for x in args.ranks.split(",")]
    if args.quick:
        sizes, args.pairs = [2], 3
    t0 = time.monotonic()
    rows = []
    for n in sizes:
        rows += [dict(r, np=n) for r in report(launch(args, n))]
    hora = [r for r in rows if r["row"] in ("allreduce", "bucket") and r["bytes"] >= 16 * MB]
    worst = min(hora, key=lambda r: r["fraction"])
    at4 = [r["vs_before"] for r in rows if r["row"] in ("allreduce", "bucket")
           and r["bytes"] == 4 * MB]
    yardstick = _size_copy_yardstick(rows) if args.before else []
    ok = worst["fraction"] >= TARGET and (not args.before or min(at4) >= TARGET_BEFORE)
    gloo = next(r for r in rows if r["row"] == "gloo" and r["bytes"] == worst["bytes"]
                and r["np"] == worst["np"])
    print(f"wall {time.monotonic() - t0:.0f}s")
    print(json.dumps({
        "bench": "shm_allreduce", "metric": "hora busbw / derived bound, worst row >= 16 MB",
        "hora": round(worst["busbw"], 3), "baseline": round(gloo["busbw"], 3),
        "ratio": round(worst["fraction"], 3), "target": TARGET, "pass": ok,
        "of_size_copy": round(min(r["of_size_copy"] for r in hora), 3),
        "worst": f"{worst['np']} ranks {_fmt(worst['bytes'])} {worst['row']}",
        "cross_own_there": round(next(r["cross_own"] for r in rows if r["row"] == "cross"
                                      and r["bytes"] == worst["bytes"]
                                      and r["np"] == worst["np"]), 3),
        **({"vs_before_at_4MB": [round(x, 2) for x in at4], "target_before": TARGET_BEFORE,
            "cross_vs_before_at_4MB": [round(r["vs_before"], 2) for r in rows
                                       if r["row"] == "cross" and r["bytes"] == 4 * MB],
            "target_of_size_copy_at_4MB": [round(x, 2) for x in yardstick]}
           if args.before else {})}))
    return 0 if ok else 1


def _size_copy_yardstick(rows: list[dict[str, Any]]) -> list[float]:
    """Per world size, what 3x ``before`` at 4 MB asks, as a fraction of the busbw that
    ``passes(n)`` copies at the speed of a copy of that size (every rank copying at once, the
    same rounds) would give; printed beside hora's best row there."""
    out = []
    for n in sorted({r["np"] for r in rows}):
        at = {r["row"]: r for r in rows if r["np"] == n and r["bytes"] == 4 * MB}
        if "before" not in at:
            continue
        target = TARGET_BEFORE * at["before"]["of_size_copy"]
        best = max(("ring", "allreduce", "bucket"), key=lambda row: at[row]["of_size_copy"])
        print(f"{n} ranks, 4 MB: {TARGET_BEFORE:g}x before is {target:.2f} of the busbw the "
              f"size's copy allows ({passes(n):.2f} copies); hora's best row there: {best} "
              f"{at[best]['of_size_copy']:.2f}")
        out.append(target)
    return out


if __name__ == "__main__":
    sys.exit(main())
