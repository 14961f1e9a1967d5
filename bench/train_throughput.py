"""Training throughput on three model shapes: hora DistributedOptimizer vs torch DDP.

Protocol (../shared/BENCH.md): 2 processes on gloo, 1 thread each. Every row of one shape trains
the same model from the same weights on the same synthetic data (batch per process, steps per
run, SGD with momentum) in the *same* two processes. Shapes:

* ``large``: MLP 1024 -> 3 x 1600 -> 1000: 8 tensors, 8.4M parameters (few large gradients)
* ``small``: MLP 256 -> 99 x 128 -> 10: 200 tensors, 1.6M parameters (many small gradients)
* ``cnn``:   3 conv layers + 2 linear layers on 3x32x32 images: 10 tensors, 0.6M parameters

Rows, per shape:

* ``ddp``:       torch.nn.parallel.DistributedDataParallel (defaults: 25 MiB buckets, first 1 MiB)
* ``hora``:      hvd.DistributedOptimizer (defaults)
* ``ddp_aa``:    a second DDP run: an A/A control; its ratio to ``ddp`` shows how far noise alone
  moves a ratio on this machine (not part of the target)
* ``hora_fp16``: hvd.DistributedOptimizer(compression=hvd.Compression.fp16)
* ``ddp_fp16``:  DDP with torch's ``fp16_compress_hook`` (hora_fp16's fair baseline)

Correctness first: each row trains ``--check-steps`` steps from the same weights and must end with
DDP's parameters (1e-5 relative for fp32, 2e-3 for the fp16 rows). Then one warm-up round and
``--pairs`` timed rounds; a round runs every row of every shape once, the row order reversed in
every other round. Ratio = row samples/s / ddp samples/s of the same round and shape; the table
gives the median, min and max over rounds.

Target: hora >= 1.0x DDP (median ratio) on every shape.

Usage: python bench/train_throughput.py [--quick] [--np 2] [--pairs 9] [--steps 6]
                                       [--shapes large,small,cnn]
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
ROWS = ["ddp", "hora", "ddp_aa", "hora_fp16", "ddp_fp16"]
SHAPES = {"large": 64, "small": 64, "cnn": 32}  # shape -> batch per process
FP16_TOL, FP32_TOL = 2e-3, 1e-5


def _mlp(torch: Any, dims: list[int]) -> Any:
    layers: list[Any] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _cnn(torch: Any) -> Any:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))


def make_model(torch: Any, shape: str) -> Any:
    """The model of one shape, with seeded weights."""
    torch.manual_seed(0)
    if shape == "large":
        return _mlp(torch, [1024, 1600, 1600, 1600, 1000])
    if shape == "small":
        return _mlp(torch, [256] + [128] * 99 + [10])
    return _cnn(torch)


def make_batch(torch: Any, shape: str, batch: int, rank: int) -> tuple[Any, Any]:
    """Synthetic inputs and labels for one rank (different per rank, same for every row)."""
    g = torch.Generator().manual_seed(1 + rank)
    if shape == "cnn":
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,),
                                                                         generator=g)
    n_in, n_out = (1024, 1000) if shape == "large" else (256, 10)
    return torch.randn(batch, n_in, generator=g), torch.randint(0, n_out, (batch,), generator=g)


class Runner:
    """Builds one row's model and optimizer for one shape, trains N steps, frees everything."""

    def __init__(self, torch: Any, dist: Any, hvd: Any, batches: dict[str, int]) -> None:
        self.torch, self.dist, self.hvd = torch, dist, hvd
        self.loss = torch.nn.CrossEntropyLoss()
        rank = dist.get_rank()
        self.data = {s: make_batch(torch, s, b, rank) for s, b in batches.items()}
        self.init = {s: make_model(torch, s).state_dict() for s in batches}

    def build(self, shape: str, kind: str) -> tuple[Any, Any, Any]:
        torch, hvd = self.torch, self.hvd
        model = make_model(torch, shape)
        model.load_state_dict(self.init[shape])
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        fwd = model
        if kind.startswith("ddp"):
            fwd = torch.nn.parallel.DistributedDataParallel(model)
            if kind == "ddp_fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                fwd.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            comp = hvd.Compression.fp16 if kind == "hora_fp16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=comp)
        return model, fwd, opt

    def run(self, shape: str, kind: str, steps: int) -> tuple[float, Any]:
        model, fwd, opt = self.build(shape, kind)
        x, y = self.data[shape]
        self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            self.loss(fwd(x), y).backward()
            opt.step()
        self.dist.barrier()
        elapsed = time.perf_counter() - t0
        flat = self.torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del model, fwd, opt
        gc.collect()
        return elapsed, flat


def _check(runner: Runner, shapes: list[str], steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for shape in shapes:
        ref = runner.run(shape, "ddp", steps)[1]
        out[shape] = {}
        for kind in ROWS[1:]:
            got = runner.run(shape, kind, steps)[1]
            rel = float((got - ref).abs().max() / ref.abs().max())
            tol = FP16_TOL if kind.endswith("fp16") else FP32_TOL
            if rel > tol:
                raise SystemExit(f"correctness check failed: {shape} {kind} vs ddp: relative "
                                 f"diff {rel:.2e} > {tol}")
            out[shape][kind] = rel
    return out


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hvd.init()
    runner = Runner(torch, dist, hvd, {s: SHAPES[s] for s in args.shapes})
    check = _check(runner, args.shapes, args.check_steps)
    rounds = []
    for r in range(args.pairs + 1):
        order = ROWS if r % 2 == 0 else ROWS[::-1]
        rounds.append({s: {k: runner.run(s, k, args.steps)[0] for k in order}
                       for s in args.shapes})
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps({
            "np": hvd.size(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "shapes": {s: {"batch": SHAPES[s], "params": _count(torch, s)} for s in args.shapes},
            "steps": args.steps, "check": check, "check_steps": args.check_steps,
            "rounds": rounds[1:],
        }))
    hvd.shutdown()


def _count(torch: Any, shape: str) -> tuple[int, int]:
    ps = list(make_model(torch, shape).parameters())
    return sum(p.numel() for p in ps), len(ps)


def launch(args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--pairs", str(args.pairs), "--steps", str(args.steps)]
    worker += ["--check-steps", str(args.check_steps), "--shapes", ",".join(args.shapes)]
    return run_ranks(__file__, args.np, worker)


def report(data: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Print the table; return shape -> row -> {sps, ratio, min, max}."""
    n, steps = data["np"], data["steps"]
    print(f"training throughput, {n} processes, gloo, {data['threads']} thread(s) each, torch "
          f"{data['torch']}, SGD momentum, {steps} steps/run, {len(data['rounds'])} rounds")
    out: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'shape':>6} {'row':>10} {'samples/s med':>14} {'ratio vs ddp med':>17} "
          f"{'min':>6} {'max':>6}")
    for shape, info in data["shapes"].items():
        samples = n * info["batch"] * steps
        times = [r[shape] for r in data["rounds"]]
        out[shape] = {}
        for kind in ROWS:
            ratios = [r["ddp"] / r[kind] for r in times]
            row = {"sps": statistics.median(samples / r[kind] for r in times),
                   "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            out[shape][kind] = row
            print(f"{shape:>6} {kind:>10} {row['sps']:14.1f} {row['ratio']:17.3f} "
                  f"{row['min']:6.3f} {row['max']:6.3f}")
        fp16 = [r["ddp_fp16"] / r["hora_fp16"] for r in times]
        out[shape]["fp16_vs_ddp_fp16"] = {"ratio": statistics.median(fp16)}
        params, tensors = info["params"]
        check = ", ".join(f"{k} {v:.1e}" for k, v in data["check"][shape].items())
        print(f"{shape:>6}   {params:,} params in {tensors} tensors, batch {info['batch']}/"
              f"process; hora_fp16 / ddp_fp16 median {statistics.median(fp16):.3f}; "
              f"max rel param diff vs ddp after {data['check_steps']} steps: {check}")
    return out


def _shapes(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in SHAPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--shapes: unknown {bad}; choose from {list(SHAPES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds, under 60 s")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--pairs", type=int, default=9)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--shapes", type=_shapes, default=list(SHAPES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.pairs, args.check_steps = 2, 2, 2
    t0 = time.monotonic()
    rows = report(launch(args))
    ratios = {s: round(r["hora"]["ratio"], 4) for s, r in rows.items()}
    worst = min(ratios, key=lambda s: ratios[s])
    ok = all(v >= TARGET for v in ratios.values())
    print(f"wall {time.monotonic() - t0:.0f}s")
    print(json.dumps({
        "bench": "train_throughput", "metric": "samples/s, hora/ddp median ratio, worst shape",
        "hora": round(rows[worst]["hora"]["sps"], 2),
        "baseline": round(rows[worst]["ddp"]["sps"], 2), "ratio": ratios[worst],
        "target": TARGET, "pass": ok, "ratios": ratios,
        "aa_ratios": {s: round(r["ddp_aa"]["ratio"], 4) for s, r in rows.items()},
        "fp16_ratios": {s: round(r["hora_fp16"]["ratio"], 4) for s, r in rows.items()},
        "fp16_vs_ddp_fp16": {s: round(r["fp16_vs_ddp_fp16"]["ratio"], 4)
                             for s, r in rows.items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
