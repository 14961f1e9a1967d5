"""The digits training loop that bench/notebook.py times on both paths (engines and hora run).

One function, ``train``, runs in each rank: in notebook engines it is loaded with ``runpy``
and called from a ``%%distributed``-style cell; under ``hora run -np 2`` this file is the
script. Same data shard, model, batch, steps and threads either way; only the training loop
is timed (data loading and model setup are not).

Usage as a script: python bench/_digits_train.py --epochs 4 --out result.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

WARMUP_STEPS = 5


def _shards(hvd: Any, torch: Any) -> tuple[Any, Any]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x, _, y, _ = train_test_split(digits.images / 16.0, digits.target, test_size=0.25,
                                  random_state=0, stratify=digits.target)
    n = len(x) // hvd.size() * hvd.size()
    x = torch.tensor(x[hvd.rank():n:hvd.size()], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(y[hvd.rank():n:hvd.size()])


def _model(torch: Any) -> Any:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
    )


def train(epochs: int = 4, batch_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """Train the digits CNN data-parallel on this rank's shard; return throughput and checksum."""
    import hora.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    x, y = _shards(hvd, torch)
    model = _model(torch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    def step(idx: Any) -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()

    # a few untimed steps first on both paths: a fresh process pays one-off costs (allocator,
    # autograd, gloo buffers) that warm engines have already paid
    for start in range(0, WARMUP_STEPS * batch_size, batch_size):
        step(torch.arange(start, start + batch_size))
    hvd.allreduce(torch.zeros(1), name="bench.start")  # every rank starts the clock together
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(order), batch_size):
            step(order[start:start + batch_size])
    hvd.allreduce(torch.zeros(1), name="bench.end")
    seconds = time.perf_counter() - t0
    samples = len(x) * epochs * hvd.size()
    return {"rank": hvd.rank(), "size": hvd.size(), "threads": torch.get_num_threads(),
            "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes its result here")
    args = p.parse_args()
    result = train(args.epochs, args.batch_size)
    if result["rank"] == 0:
        args.out.write_text(json.dumps(result))
    import hora.torch as hvd

    hvd.barrier()  # rank 0 hosts the rendezvous store: let rank 1 finish with it first
    hvd.shutdown()


if __name__ == "__main__":
    main()
