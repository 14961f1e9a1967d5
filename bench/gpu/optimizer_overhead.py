"""GPU check step: DistributedOptimizer at 1 rank vs plain single-GPU training (check.py runs it).

The same model (an MLP 2048 -> 4 x 2048 -> 1000, batch 256) from the same weights, trained with
plain ``torch.optim.SGD`` and with ``hvd.DistributedOptimizer`` over it (NCCL, world of one),
side by side in one process: correctness first (both end with the same weights after 3
steps), then 1 warm-up pair and ``--pairs`` timed pairs of blocks of ``--steps`` steps
(``torch.cuda.synchronize()`` around each block, the order alternating). Overhead = the
median of hora/plain block times - 1. Target: <= 2 %. Beside it, the wrapper's own cost:
``zero_grad()`` + ``step()`` with no gradients (no kernels launched), hora against plain, in
microseconds a step, as a fraction of a plain step: a bound on the overhead that no noise of
the GPU's clocks or the host's scheduling blurs. Prints a table and one JSON line.
``--cpu`` rehearses it on CPU with gloo and a small model (``check.sh --rehearse``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

TARGET = 0.02


WIDTH = 2048


def mlp(torch: Any) -> Any:
    layers: list[Any] = []
    for a, b in [(WIDTH, WIDTH)] * 4 + [(WIDTH, 1000)]:
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def build(torch: Any, dev: Any, hvd: Any, wrap: bool, init: dict[str, Any]) -> tuple[Any, Any]:
    model = mlp(torch)
    model.load_state_dict(init)
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if wrap:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt


def block(torch: Any, model: Any, opt: Any, x: Any, y: Any, steps: int) -> float:
    loss = torch.nn.functional.cross_entropy
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    sync()
    return time.perf_counter() - t0


def wrapper_us(rows: dict[str, tuple[Any, Any]], calls: int = 2000) -> dict[str, float]:
    """Microseconds of ``zero_grad()`` + ``step()`` with no gradients, best of 5 rounds."""
    best = {k: float("inf") for k in rows}
    for _ in range(5):
        for k, (_model, opt) in rows.items():
            opt.zero_grad()
            t0 = time.perf_counter()
            for _ in range(calls):
                opt.zero_grad()
                opt.step()
            best[k] = min(best[k], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU (gloo, a small model)")
    args = p.parse_args()
    import hora.torch as hvd
    import torch

    global WIDTH
    if args.cpu:
        WIDTH, args.steps, args.pairs = 128, 3, 2
    hvd.init(backend="gloo" if args.cpu else "nccl")
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", hvd.local_rank())
    torch.manual_seed(0)
    init = mlp(torch).state_dict()
    rows = {k: build(torch, dev, hvd, k == "hora", init) for k in ("plain", "hora")}
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(256, WIDTH, device=dev, generator=g)
    y = torch.randint(0, 1000, (256,), device=dev, generator=g)
    for model, opt in rows.values():
        block(torch, model, opt, x, y, 3)
    a, b = (torch.cat([q.detach().reshape(-1) for q in rows[k][0].parameters()])
            for k in ("plain", "hora"))
    diff = float((a - b).abs().max() / a.abs().max())
    pairs = []
    for i in range(args.pairs + 1):
        order = ["plain", "hora"] if i % 2 == 0 else ["hora", "plain"]
        t = {k: block(torch, *rows[k], x, y, args.steps) for k in order}
        pairs.append(t)
    pairs = pairs[1:]
    over = [t["hora"] / t["plain"] - 1 for t in pairs]
    sps = {k: statistics.median(256 * args.steps / t[k] for t in pairs) for k in rows}
    name = "cpu" if args.cpu else torch.cuda.get_device_name(dev)
    print(f"{name}; MLP {WIDTH}x4 -> 1000, batch 256, {args.steps} "
          f"steps a block, {args.pairs} pairs; max relative weight diff after 3 steps {diff:.1e}")
    print(f"samples/s plain {sps['plain']:.0f}, DistributedOptimizer {sps['hora']:.0f}; "
          f"overhead median {100 * statistics.median(over):+.2f}% "
          f"(min {100 * min(over):+.2f}%, max {100 * max(over):+.2f}%)")
    med = statistics.median(over)
    cost = wrapper_us(rows)
    extra_us = cost["hora"] - cost["plain"]
    step_us = 256 / sps["plain"] * 1e6
    print(f"the wrapper alone: {cost['hora']:.1f} us a step against plain {cost['plain']:.1f} us"
          f" (+{extra_us:.1f} us, {100 * extra_us / step_us:.2f}% of a {step_us:.0f} us step)")
    ok = diff <= 1e-5 and (med <= TARGET or args.cpu)  # a rehearsal checks it runs
    hvd.shutdown()
    print(json.dumps({"step": "optimizer_overhead", "bench": "gpu_optimizer_overhead",
                      "metric": "time per step, DistributedOptimizer (1 rank) / plain - 1",
                      "hora": round(sps["hora"], 1), "baseline": round(sps["plain"], 1),
                      "ratio": round(1 + med, 4), "target": TARGET, "pass": ok,
                      "weight_diff": diff, "wrapper_us": round(extra_us, 2),
                      "wrapper_fraction": round(extra_us / step_us, 5),
                      "summary": f"overhead {100 * med:+.2f}% "
                      f"(min {100 * min(over):+.2f}%, max {100 * max(over):+.2f}%), target "
                      f"<= {100 * TARGET:.0f}%; the wrapper +{extra_us:.1f} us a step "
                      f"({100 * extra_us / step_us:.2f}%)"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
