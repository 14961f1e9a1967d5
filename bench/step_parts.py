"""Where a data-parallel training step's time goes against the ideal: compute, the wait, the step.

Issue 29 asks for N ranks at >= 0.9 of N x one rank alone on the compute-heavy shape
(``bench/train_throughput.py``'s ``cnn``). This splits a step of 2 ranks into what each part
costs, for hora's DistributedOptimizer and torch DDP side by side (interleaved blocks of
``--steps`` steps, the order swapped every other block, same processes, same weights, data
and threads as train_throughput.py):

* ``compute``: forward and backward, each rank's own clock, mean of the ranks;
* ``wait``: how much later the slower rank of a step finished its compute than the mean,
  step by step: what any synchronous method pays for two processes computing side by side;
* ``step``: ``opt.step()`` in plain training (hora: the reduction and SGD's update, plus the wait
  for the slower rank; DDP reduces during backward, so its ``step`` is SGD's update alone and
  its wait sits inside ``compute``);
* ``aligned``: ``opt.step()`` when a barrier released both ranks together after backward
  (hora: the reduction and the update, without the wait);
* ``alone``: one rank's whole step (forward, backward, update) on rank 0 while rank 1 waits;
* ``slowdown``: how much slower the same forward and backward run with both ranks computing at
  once than alone (the two processes share the machine);
* ``reduction``: ``aligned`` less alone's ``step()`` (SGD's update alone): what hora's
  reduction of the gradients costs itself.

From these, ``bound``: the fraction of the ideal that a reduction costing nothing would reach,
alone / (alone + slowdown + wait); and each method's own fraction, alone / its whole step
(a rank's compute plus its ``step()``, which includes the wait).

Run: ``python bench/step_parts.py [--shape cnn] [--steps 50] [--pairs 6]``; ``--quick``: under
60 s. The last line is the protocol's JSON (../shared/BENCH.md).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _world import run_ranks  # noqa: E402
from train_throughput import SHAPES, make_batch, make_model  # noqa: E402

TARGET_IDEAL = 0.9


def _block(torch: Any, dist: Any, fwd: Any, opt: Any, x: Any, y: Any, steps: int,
           aligned: bool) -> dict[str, list[float]]:
    """Train ``steps`` steps; per step: compute and step() seconds of this rank.

    ``aligned``: a barrier releases the ranks together into each step(). For one rank alone,
    the others pass 0 steps and wait at the closing barrier.
    """
    loss = torch.nn.CrossEntropyLoss()
    comp, step = [], []
    dist.barrier()
    for _ in range(steps):
        a = time.perf_counter()
        opt.zero_grad()
        loss(fwd(x), y).backward()
        b = time.perf_counter()
        if aligned:
            dist.barrier()
        c = time.perf_counter()
        opt.step()
        comp.append(b - a)
        step.append(time.perf_counter() - c)
    dist.barrier()
    return {"compute": comp, "step": step}


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hvd.init()
    init = make_model(torch, args.shape).state_dict()
    x, y = make_batch(torch, args.shape, SHAPES[args.shape], hvd.rank())

    def build(kind: str) -> tuple[Any, Any]:
        model = make_model(torch, args.shape)
        model.load_state_dict(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if kind == "hora":
            return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        if kind == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model), opt
        return model, opt

    rows = {k: build(k) for k in ("hora", "ddp", "alone")}
    blocks: list[dict[str, Any]] = []
    for r in range(args.pairs + 1):  # the first pair warms up
        got: dict[str, Any] = {}
        order = ["hora", "ddp", "hora_aligned", "alone"]
        for kind in order if r % 2 == 0 else order[::-1]:
            fwd, opt = rows[kind.split("_")[0]]
            steps = 0 if kind == "alone" and hvd.rank() != 0 else args.steps
            got[kind] = _block(torch, dist, fwd, opt, x, y, steps, kind.endswith("aligned"))
        blocks.append(got)
    mine = json.dumps(blocks[1:])
    every = [json.loads(b) for b in hvd.allgather_object(mine)]
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps({"ranks": every, "torch": torch.__version__}))
    hvd.shutdown()


def _parts(ranks: list[list[dict[str, Any]]], kind: str, i: int) -> dict[str, float]:
    """Per-step means (s) of block ``i`` of ``kind``, over the ranks."""
    per = [r[i][kind] for r in ranks]
    n = len(per[0]["compute"])
    comp = statistics.fmean(c for p in per for c in p["compute"])
    slowest = statistics.fmean(max(p["compute"][s] for p in per) for s in range(n))
    step = statistics.fmean(c for p in per for c in p["step"])
    return {"compute": comp, "wait": slowest - comp, "step": step}


PARTS = ("alone", "compute", "slowdown", "wait", "step", "aligned", "reduction",
         "hora_whole", "ddp_whole")


def report(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ranks = data["ranks"]
    pairs = len(ranks[0])
    out: dict[str, list[float]] = {}
    for i in range(pairs):
        hora, ddp, aligned = (_parts(ranks, k, i) for k in ("hora", "ddp", "hora_aligned"))
        alone_c = statistics.fmean(ranks[0][i]["alone"]["compute"])
        alone_s = statistics.fmean(ranks[0][i]["alone"]["step"])
        alone = alone_c + alone_s
        # a rank's step() waits for the slower rank: its loop is its compute plus its step()
        hora_whole = hora["compute"] + hora["step"]
        ddp_whole = ddp["compute"] + ddp["step"]  # DDP waits inside backward
        slowdown = hora["compute"] - alone_c  # the same compute, two processes at once
        rows = {
            "alone": alone, "compute": hora["compute"], "slowdown": slowdown,
            "wait": hora["wait"], "step": hora["step"], "aligned": aligned["step"],
            "reduction": aligned["step"] - alone_s, "hora_whole": hora_whole,
            "ddp_whole": ddp_whole, "bound": alone / (alone + slowdown + hora["wait"]),
            "hora_of_ideal": alone / hora_whole, "ddp_of_ideal": alone / ddp_whole,
        }
        for k, v in rows.items():
            out.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"{args.shape}, 2 ranks, gloo, 1 thread each, torch {data['torch']}, {args.steps} "
          f"steps a block, {pairs} pairs of blocks; per step, ms (median over the pairs)")
    for k in PARTS:
        print(f"  {k:14s} {1e3 * med[k]:8.2f}   min {1e3 * min(out[k]):8.2f}  max "
              f"{1e3 * max(out[k]):8.2f}")
    for k in ("bound", "hora_of_ideal", "ddp_of_ideal"):
        print(f"  {k:14s} {med[k]:8.3f}   min {min(out[k]):8.3f}  max {max(out[k]):8.3f}")
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and pairs, under 60 s")
    p.add_argument("--shape", choices=list(SHAPES), default="cnn")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.pairs = 10, 2
    if args.steps < 1 or args.pairs < 1:
        p.error("--steps and --pairs must be at least 1")
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    data = run_ranks(__file__, 2, ["--shape", args.shape, "--steps", str(args.steps),
                                   "--pairs", str(args.pairs)])
    med = report(data, args)
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; wall {time.monotonic() - t0:.0f}s")
    print(json.dumps({
        "bench": "step_parts", "metric": f"{args.shape}: hora's step against 2x one rank alone",
        "hora": round(med["hora_of_ideal"], 4), "baseline": round(med["ddp_of_ideal"], 4),
        "ratio": round(med["hora_of_ideal"] / med["ddp_of_ideal"], 4), "target": TARGET_IDEAL,
        "pass": med["hora_of_ideal"] >= TARGET_IDEAL, "bound_without_reduction": round(
            med["bound"], 4), "wait_ms": round(1e3 * med["wait"], 3),
        "slowdown_ms": round(1e3 * med["slowdown"], 3),
        "reduction_ms": round(1e3 * med["reduction"], 3)}))
    return 0 if med["hora_of_ideal"] >= TARGET_IDEAL else 1


if __name__ == "__main__":
    sys.exit(main())
