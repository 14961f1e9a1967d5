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
* ``hora_gloo``: hvd.DistributedOptimizer with its buckets on gloo, as ``HORA_SHM=off`` does
  (the ``hora`` row reduces CPU buckets of same-host ranks through shared memory)
* ``hora_before`` (with ``--before GIT_REF``): the DistributedOptimizer of that commit (its
  ``optimizer.py`` and, where it has one, ``_reducer.py``), loaded next to the current one, for
  before/after comparisons in the same processes (the layers below are the current ones)
* ``alone``: rank 0 trains a plain copy of the model (no wrapper, no communication) while the
  other ranks wait: one rank alone with the same threads. N times its samples/s is the
  *ideal* of N ranks; every row's samples/s over that ideal is its scaling efficiency.

All rows of a shape are built first and stay alive side by side. Correctness first: every row
trains ``--check-steps`` steps from the same weights and must end with DDP's parameters (1e-5
relative for fp32, 2e-3 for the fp16 rows). Then one warm-up round and ``--pairs`` timed rounds;
a round trains every row ``--steps`` steps, the row order rotated by one each round and
reversed every other cycle (every row takes every position alike), so a slow spell of a noisy
machine hits the rows alike. Ratio = ddp time / row time in the same
round; the table gives its median, min and max over rounds, samples/s, and the same median
ratio of CPU time (rank 0, all its threads), which other processes on the machine disturb less.

Targets (issue 29): hora >= 1.1x DDP (median ratio) on every shape, and hora >= 0.9 of the
ideal on the compute-heavy shape (``cnn``).

Usage: python bench/train_throughput.py [--quick] [--np 2] [--pairs 30] [--steps 2]
                                       [--shapes large,small,cnn] [--before GIT_REF]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _world import run_ranks

TARGET = 1.1
TARGET_IDEAL = 0.9
COMPUTE_HEAVY = ("cnn",)
ROWS = ["ddp", "hora", "ddp_aa", "hora_fp16", "ddp_fp16", "hora_gloo", "alone"]
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
    """Holds every row of one shape (models alive side by side) and trains them in turn."""

    def __init__(self, torch: Any, dist: Any, hvd: Any, shape: str, rows: list[str],
                 before: Any = None) -> None:
        self.torch, self.dist, self.hvd, self.shape = torch, dist, hvd, shape
        self.before = before
        self.loss = torch.nn.CrossEntropyLoss()
        self.x, self.y = make_batch(torch, shape, SHAPES[shape], dist.get_rank())
        init = make_model(torch, shape).state_dict()
        self.rows = {kind: self.build(kind, init) for kind in rows}

    def build(self, kind: str, init: dict[str, Any]) -> tuple[Any, Any, Any]:
        """Return (model, forward module, optimizer) for one row, from the weights ``init``."""
        torch, hvd = self.torch, self.hvd
        model = make_model(torch, self.shape)
        model.load_state_dict(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        fwd = model
        if kind == "alone":
            return model, fwd, opt
        if kind.startswith("ddp"):
            fwd = torch.nn.parallel.DistributedDataParallel(model)
            if kind == "ddp_fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                fwd.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            wrap = self.before.DistributedOptimizer if kind == "hora_before" else (
                hvd.DistributedOptimizer)
            comp = hvd.Compression.fp16 if kind == "hora_fp16" else hvd.Compression.none
            opt = wrap(opt, named_parameters=model.named_parameters(), compression=comp)
            if kind == "hora_gloo":  # HORA_SHM=off's path, for this optimizer only
                opt._hora._ring = lambda _wire: None  # noqa: SLF001
        return model, fwd, opt

    def run(self, kind: str, steps: int) -> tuple[float, float]:
        """Train ``steps`` steps of one row; return (wall seconds, CPU seconds of this process).

        The ``alone`` row trains on rank 0 only (the others wait at the next barrier).
        """
        model, fwd, opt = self.rows[kind]
        self.dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps if kind != "alone" or self.dist.get_rank() == 0 else 0):
            opt.zero_grad()
            self.loss(fwd(self.x), self.y).backward()
            opt.step()
        cpu = time.process_time() - c0
        self.dist.barrier()
        return time.perf_counter() - t0, cpu

    def params(self, kind: str) -> Any:
        return self.torch.cat([p.detach().reshape(-1) for p in self.rows[kind][0].parameters()])


def _check(runner: Runner, steps: int) -> dict[str, float]:
    """Train every row ``steps`` steps; each must end with DDP's parameters."""
    for kind in runner.rows:
        runner.run(kind, steps)
    ref = runner.params("ddp")
    out = {}
    for kind in runner.rows:
        if kind in ("ddp", "alone"):
            continue
        rel = float((runner.params(kind) - ref).abs().max() / ref.abs().max())
        tol = FP16_TOL if kind.endswith("fp16") else FP32_TOL
        if rel > tol:
            raise SystemExit(f"correctness check failed: {runner.shape} {kind} vs ddp: relative "
                             f"diff {rel:.2e} > {tol}")
        out[kind] = rel
    return out


def _load_before(path: str | None) -> Any:
    if not path:
        return None
    import importlib.util

    sys.path.insert(0, str(Path(path).parent))  # its reducer_before.py, when it has one
    spec = importlib.util.spec_from_file_location("hora_optimizer_before", path)
    assert spec is not None and spec.loader is not None  # noqa: S101  (a file we just wrote)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(args: argparse.Namespace) -> None:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hvd.init()
    before = _load_before(args.before_file)
    rows = ROWS + (["hora_before"] if before else [])
    result: dict[str, Any] = {"np": hvd.size(), "threads": torch.get_num_threads(),
                              "torch": torch.__version__, "steps": args.steps,
                              "check_steps": args.check_steps, "rows": rows, "shapes": {}}
    for shape in args.shapes:
        runner = Runner(torch, dist, hvd, shape, rows, before)
        check = _check(runner, args.check_steps)
        rounds = []
        for r in range(args.pairs + 1):
            order = _order(rows, r)
            rounds.append({k: runner.run(k, args.steps) for k in order})
        result["shapes"][shape] = {"batch": SHAPES[shape], "params": _count(torch, shape),
                                   "check": check, "rounds": rounds[1:]}
        del runner
        gc.collect()
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    hvd.shutdown()


def _order(rows: list[str], r: int) -> list[str]:
    """Round ``r``'s row order: rotated by one each round, reversed every other full cycle.

    Every row takes every position equally often (first after the barrier, last before the
    next one, in the middle), after every other row: no row keeps a place that favours it.
    """
    k = r % len(rows)
    order = rows[k:] + rows[:k]
    return order[::-1] if (r // len(rows)) % 2 else order


def _count(torch: Any, shape: str) -> tuple[int, int]:
    ps = list(make_model(torch, shape).parameters())
    return sum(p.numel() for p in ps), len(ps)


def launch(args: argparse.Namespace) -> dict[str, Any]:
    worker = ["--pairs", str(args.pairs), "--steps", str(args.steps)]
    worker += ["--check-steps", str(args.check_steps), "--shapes", ",".join(args.shapes)]
    if not args.before:
        return run_ranks(__file__, args.np, worker)
    # the optimizer as it was at a git commit, loaded next to the current one (same processes)
    root = Path(__file__).resolve().parent.parent

    def show(name: str) -> str | None:
        got = subprocess.run(["git", "show", f"{args.before}:kernels/hora/torch/{name}"],
                             cwd=root, capture_output=True, text=True)
        return got.stdout if got.returncode == 0 else None

    src, reducer = show("optimizer.py"), show("_reducer.py")
    if src is None:
        raise SystemExit(f"--before {args.before}: no kernels/hora/torch/optimizer.py there")
    with tempfile.TemporaryDirectory(prefix="hora-before-") as tmp:
        if reducer is not None:  # its own reducer, not the current one
            Path(tmp, "reducer_before.py").write_text(reducer)
            src = src.replace("from hora.torch._reducer import", "from reducer_before import")
        path = Path(tmp, "optimizer_before.py")
        path.write_text(src)
        return run_ranks(__file__, args.np, [*worker, "--before-file", str(path)])


def _median_ratios(rounds: list[dict[str, Any]], kind: str, base: str, i: int) -> dict[str, float]:
    ratios = [r[base][i] / r[kind][i] for r in rounds]
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def report(data: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Print the table; return shape -> row -> {sps, ratio, min, max, cpu}."""
    n, steps = data["np"], data["steps"]
    some = next(iter(data["shapes"].values()))
    print(f"training throughput, {n} processes, gloo, {data['threads']} thread(s) each, torch "
          f"{data['torch']}, SGD momentum, {steps} steps/run, {len(some['rounds'])} rounds")
    print("ratio = ddp time / row time in the same round (> 1: faster than DDP); cpu = the same "
          "ratio of CPU time (all threads of the process, rank 0); of ideal = samples/s over "
          f"{n} x those of one rank alone (row alone) in the same round")
    out: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'shape':>6} {'row':>11} {'samples/s med':>14} {'ratio med':>10} {'min':>6} "
          f"{'max':>6} {'cpu ratio':>10} {'of ideal':>9}")
    for shape, info in data["shapes"].items():
        samples = n * info["batch"] * steps
        rounds = info["rounds"]
        out[shape] = {}
        for kind in data["rows"]:
            row = _median_ratios(rounds, kind, "ddp", 0)
            per = samples if kind != "alone" else samples // n
            row["sps"] = statistics.median(per / r[kind][0] for r in rounds)
            row["cpu"] = _median_ratios(rounds, kind, "ddp", 1)["ratio"]
            # of ideal: (samples / t_row) / (n x (samples / n) / t_alone) = t_alone / t_row
            row["ideal"] = statistics.median(r["alone"][0] / r[kind][0] for r in rounds)
            out[shape][kind] = row
            print(f"{shape:>6} {kind:>11} {row['sps']:14.1f} {row['ratio']:10.3f} "
                  f"{row['min']:6.3f} {row['max']:6.3f} {row['cpu']:10.3f} "
                  f"{row['ideal'] if kind != 'alone' else 1.0:9.3f}")
        fp16 = _median_ratios(rounds, "hora_fp16", "ddp_fp16", 0)
        out[shape]["fp16_vs_ddp_fp16"] = fp16
        params, tensors = info["params"]
        check = ", ".join(f"{k} {v:.1e}" for k, v in info["check"].items())
        print(f"{shape:>6}   {params:,} params in {tensors} tensors, batch {info['batch']}/"
              f"process; hora_fp16 vs ddp_fp16: median {fp16['ratio']:.3f} "
              f"[{fp16['min']:.3f}, {fp16['max']:.3f}]; max relative param diff vs ddp after "
              f"{data['check_steps']} steps: {check}")
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
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--shapes", type=_shapes, default=list(SHAPES))
    p.add_argument("--before", metavar="GIT_REF",
                   help="add a row hora_before: the DistributedOptimizer of this commit")
    p.add_argument("--before-file", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.pairs, args.check_steps = 1, 3, 2
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    rows = report(launch(args))
    ratios = {s: round(r["hora"]["ratio"], 4) for s, r in rows.items()}
    ideal = {s: {k: round(r[k]["ideal"], 4) for k in ("hora", "ddp")} for s, r in rows.items()}
    worst = min(ratios, key=lambda s: ratios[s])
    ok = all(v >= TARGET for v in ratios.values()) and all(
        ideal[s]["hora"] >= TARGET_IDEAL for s in ideal if s in COMPUTE_HEAVY)
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"wall {time.monotonic() - t0:.0f}s")
    print(json.dumps({
        "bench": "train_throughput", "metric": "samples/s, hora/ddp median ratio, worst shape",
        "hora": round(rows[worst]["hora"]["sps"], 2),
        "baseline": round(rows[worst]["ddp"]["sps"], 2), "ratio": ratios[worst],
        "target": TARGET, "pass": ok, "ratios": ratios, "of_ideal": ideal,
        "target_ideal": TARGET_IDEAL, "compute_heavy": list(COMPUTE_HEAVY),
        "cpu_ratios": {s: round(r["hora"]["cpu"], 4) for s, r in rows.items()},
        "aa_ratios": {s: round(r["ddp_aa"]["ratio"], 4) for s, r in rows.items()},
        "gloo_ratios": {s: round(r["hora_gloo"]["ratio"], 4) for s, r in rows.items()},
        "fp16_ratios": {s: round(r["hora_fp16"]["ratio"], 4) for s, r in rows.items()},
        "fp16_vs_ddp_fp16": {s: round(r["fp16_vs_ddp_fp16"]["ratio"], 4)
                             for s, r in rows.items()},
        **({"before_ratios": {s: round(r["hora_before"]["ratio"], 4) for s, r in rows.items()}}
           if args.before else {})}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
