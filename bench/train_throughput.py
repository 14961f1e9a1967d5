"""Training throughput: hora DistributedOptimizer vs torch DDP vs per-parameter all_reduce.

Protocol (../shared/BENCH.md): 2 processes on gloo, 1 thread each, the same ~25M-parameter MLP
(25,129,960 parameters: 1024 -> 6 x 2048 -> 1000, ReLU, 14 tensors), the same synthetic data,
the same batch per process and the same number of SGD-with-momentum steps for every approach.
Correctness first: every approach trains 3 steps from the same initial weights and must end
with DDP's parameters (1e-5 relative for fp32, 2e-3 for fp16 compression). Then one warm-up
round and >= 5 timed rounds; each round runs every approach once in the same process world,
the order alternating between rounds (hora first, then DDP first, ...). Samples/s per run;
per-round ratio to that round's DDP run; median, min and max of the ratios.

Rows:

* ``hora``:      hvd.DistributedOptimizer (hooks, fused buckets, overlap with backward)
* ``ddp``:       torch.nn.parallel.DistributedDataParallel (defaults: 25 MB buckets)
* ``tutorial``:  loss.backward(); for p: dist.all_reduce(p.grad); p.grad /= size
* ``hora_fp16``: hvd.DistributedOptimizer(compression=hvd.Compression.fp16)
* ``hora_XMB``:  hvd.DistributedOptimizer(fusion_threshold=X MiB), one row per ``--fusion-mb``
  value (the fusion-threshold sweep; ``hora`` itself uses the default, 25 MiB)

Target: hora >= 1.0x DDP samples/s (median of the round ratios).

Usage: python bench/train_throughput.py [--quick] [--np 2] [--pairs 5] [--steps 8] [--batch 32]
                                       [--fusion-mb 1,25,1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _world import run_ranks

TARGET = 1.0
ROWS = ["hora", "ddp", "tutorial", "hora_fp16"]
WIDTH, DEPTH, IN, OUT = 2048, 6, 1024, 1000


def make_model(torch: Any, init: dict[str, Any] | None = None) -> Any:
    """The MLP; with ``init`` its weights are copied from it (skipping the slow random init)."""
    torch.manual_seed(0)
    dims = [IN] + [WIDTH] * DEPTH + [OUT]
    layers: list[Any] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        if init is None:
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        else:
            layers += [torch.nn.utils.skip_init(torch.nn.Linear, a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    if init is not None:
        model.load_state_dict(init)
    return model


class Runner:
    """Builds one approach's model and optimizer, trains N steps, then frees everything."""

    def __init__(self, torch: Any, dist: Any, hvd: Any, batch: int) -> None:
        self.rows = list(ROWS)
        self.torch, self.dist, self.hvd = torch, dist, hvd
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        self.x = torch.randn(batch, IN, generator=g)
        self.y = torch.randint(0, OUT, (batch,), generator=g)
        self.loss = torch.nn.CrossEntropyLoss()
        self.init = make_model(torch).state_dict()

    def build(self, kind: str) -> tuple[Any, Any, Any]:
        torch, hvd = self.torch, self.hvd
        model = make_model(torch, self.init)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        fwd = model
        if kind == "ddp":
            fwd = torch.nn.parallel.DistributedDataParallel(model)
        elif kind.startswith("hora"):
            comp = hvd.Compression.fp16 if kind == "hora_fp16" else hvd.Compression.none
            mb = kind.removeprefix("hora_").removesuffix("MB")
            threshold = int(mb) * 1024 * 1024 if mb.isdigit() else None
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=comp, fusion_threshold=threshold)
        return model, fwd, opt

    def step(self, kind: str, model: Any, fwd: Any, opt: Any) -> None:
        opt.zero_grad()
        self.loss(fwd(self.x), self.y).backward()
        if kind == "tutorial":
            n = self.dist.get_world_size()
            for p in model.parameters():
                self.dist.all_reduce(p.grad)
                p.grad.div_(n)
        opt.step()

    def run(self, kind: str, steps: int) -> tuple[float, Any]:
        model, fwd, opt = self.build(kind)
        self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(kind, model, fwd, opt)
        self.dist.barrier()
        elapsed = time.perf_counter() - t0
        flat = self.torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del model, fwd, opt
        gc.collect()
        return elapsed, flat


def _check(runner: Runner, steps: int) -> dict[str, float]:
    ref = runner.run("ddp", steps)[1]
    out = {}
    for kind in runner.rows:
        if kind == "ddp":
            continue
        got = runner.run(kind, steps)[1]
        rel = float((got - ref).abs().max() / ref.abs().max())
        tol = 2e-3 if kind == "hora_fp16" else 1e-5
        if rel > tol:
            raise SystemExit(f"correctness check failed: {kind} vs ddp: relative diff "
                             f"{rel:.2e} > {tol}")
        out[kind] = rel
    return out


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hvd.init()
    runner = Runner(torch, dist, hvd, args.batch)
    runner.rows += [f"hora_{mb}MB" for mb in args.fusion_mb]
    check = _check(runner, args.check_steps)
    rounds = []
    for r in range(args.pairs + 1):
        rows = runner.rows
        order = rows if r % 2 == 0 else rows[1:2] + rows[:1] + rows[2:]
        times = {kind: runner.run(kind, args.steps)[0] for kind in order}
        rounds.append(times)
    if hvd.rank() == 0:
        n_params = sum(p.numel() for p in make_model(torch, runner.init).parameters())
        Path(args.out).write_text(json.dumps({
            "np": hvd.size(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "params": n_params, "batch": args.batch, "steps": args.steps, "check": check,
            "check_steps": args.check_steps, "rows": runner.rows,
            "rounds": rounds[1:],
        }))
    hvd.shutdown()


def launch(args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--pairs", str(args.pairs), "--steps", str(args.steps), "--batch", str(args.batch)]
    worker += ["--check-steps", str(args.check_steps)]
    worker += ["--fusion-mb", ",".join(map(str, args.fusion_mb))]
    return run_ranks(__file__, args.np, worker)


def report(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    n, batch, steps = data["np"], data["batch"], data["steps"]
    samples = n * batch * steps
    print(f"training throughput, {n} processes, gloo, {data['threads']} thread(s) each, "
          f"torch {data['torch']}; MLP {data['params']:,} params, batch {batch}/process, "
          f"{steps} steps/run, {len(data['rounds'])} rounds")
    print(f"correctness vs ddp (max relative param diff after {data['check_steps']} steps): "
          + ", ".join(f"{k} {v:.1e}" for k, v in data["check"].items()))
    print(f"{'row':>10} {'samples/s med':>14} {'ratio vs ddp med':>17} {'min':>6} {'max':>6}")
    rows: dict[str, dict[str, float]] = {}
    for kind in data["rows"]:
        sps = [samples / r[kind] for r in data["rounds"]]
        ratios = [r["ddp"] / r[kind] for r in data["rounds"]]
        rows[kind] = {"sps": statistics.median(sps), "ratio": statistics.median(ratios),
                      "min": min(ratios), "max": max(ratios)}
        print(f"{kind:>10} {rows[kind]['sps']:14.1f} {rows[kind]['ratio']:17.3f} "
              f"{min(ratios):6.3f} {max(ratios):6.3f}")
    return rows


def _mbs(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds, under 60 s")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--fusion-mb", type=_mbs, default=[64],
                   help="extra hora rows with these fusion thresholds (MiB), comma-separated")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.pairs, args.batch, args.check_steps, args.fusion_mb = 2, 3, 16, 2, []
    t0 = time.monotonic()
    rows = report(launch(args))
    hora, ddp = rows["hora"], rows["ddp"]
    ok = hora["ratio"] >= TARGET
    print(f"wall {time.monotonic() - t0:.0f}s")
    print(json.dumps({"bench": "train_throughput", "metric": "samples/s, hora/ddp median ratio",
                      "hora": round(hora["sps"], 2), "baseline": round(ddp["sps"], 2),
                      "ratio": round(hora["ratio"], 4), "target": TARGET, "pass": ok,
                      "fp16_ratio": round(rows["hora_fp16"]["ratio"], 4),
                      "tutorial_ratio": round(rows["tutorial"]["ratio"], 4)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
