"""One worker of bench/elastic.py: a Horovod elastic training loop that logs its events.

``python _elastic_worker.py OUT MODE ...``; MODE is

* ``recover``: train ``--steps`` steps of the digits CNN (batch 32 per worker, SGD with
  momentum, ElasticSampler), ``state.commit()`` and a checkpoint file every ``--commit-every``
  steps (the script a torchrun user would write: it loads the checkpoint when it starts, so
  torchrun's restart-everything resumes from it). Each worker appends JSON events to
  ``OUT/events.<pid>``: start, each step (time, step, size), ``detect`` (a collective failed
  and ``hvd.elastic.run`` caught it), ``reset`` (the world re-formed), ``restored`` (the step
  the state went back to).
* ``throughput``: timed blocks of ``--block`` steps, alternately with a commit every
  ``--commit-every`` steps (``elastic``) and without (``plain``), ``--pairs`` pairs after one
  warm-up pair, the order alternating; rank 0 writes ``OUT/throughput.json`` (samples/s of
  each block and the time of each commit).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import hora.torch as hvd
import torch
import torch.nn.functional as F  # noqa: N812
from sklearn.datasets import load_digits
from torch import nn

BATCH = 32


class Net(nn.Module):
    """The digits CNN of examples/train_digits_elastic.py."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


class Events:
    """Append-only JSON lines, one file per process (a restarted worker gets its own)."""

    def __init__(self, out: Path) -> None:
        self.path = out / f"events.{os.getpid()}"

    def __call__(self, kind: str, **data: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "pid": os.getpid(), **data}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def _setup() -> tuple[torch.utils.data.TensorDataset, Net, Any, Any]:
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    data = torch.utils.data.TensorDataset(x, torch.tensor(digits.target, dtype=torch.long))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return data, model, opt, hvd.elastic.ElasticSampler(data, shuffle=True, seed=0)


def _step(model: Net, opt: Any, xb: torch.Tensor, yb: torch.Tensor) -> None:
    opt.zero_grad()
    F.nll_loss(model(xb), yb).backward()
    opt.step()


def recover(args: argparse.Namespace) -> None:
    ev = Events(args.out)
    ev("start", wid=os.environ.get("HORA_ELASTIC_WORKER", ""), rank=os.environ.get("RANK"))
    hvd.init()
    data, model, opt, sampler = _setup()
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    ckpt = args.out / "checkpoint.pt"
    if ckpt.exists():  # torchrun restarted everyone: resume from the last checkpoint
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sampler.load_state_dict(saved["sampler"])
        state.epoch, state.step = saved["epoch"], saved["step"]
        state.save()  # not commit(): a replacement under hora run alone does this (no collective)
        ev("restored", step=state.step, how="checkpoint")

    class Detect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "back to the last commit" in record.getMessage():
                ev("detect")

    logging.getLogger("hora.torch.elastic").addHandler(Detect())
    state.register_reset_callbacks([lambda: ev("reset", size=hvd.size(), step=state.step)])

    def commit() -> None:
        if hvd.rank() == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sampler": sampler.state_dict(), "epoch": state.epoch,
                        "step": state.step}, tmp)  # fmt: skip
            os.replace(tmp, ckpt)
        state.commit()
        ev("commit", step=state.step)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        ev("begin", step=state.step, size=hvd.size())
        while state.step < args.steps:
            loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
            for xb, yb in loader:
                _step(model, opt, xb, yb)
                sampler.record_batch(0, BATCH)
                state.step += 1
                ev("step", step=state.step, size=hvd.size())
                if state.step % args.commit_every == 0:
                    commit()
                if state.step >= args.steps:
                    return
            state.epoch += 1
            sampler.set_epoch(state.epoch)

    train(state)
    ev("done", step=state.step)


def throughput(args: argparse.Namespace) -> None:
    hvd.init()
    data, model, opt, sampler = _setup()
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0)
    batches = [(xb, yb) for xb, yb in torch.utils.data.DataLoader(data, batch_size=BATCH)]
    commits: list[float] = []
    blocks: list[tuple[str, float]] = []

    def block(kind: str) -> float:
        hvd.barrier()
        t0 = time.perf_counter()
        for i in range(args.block):
            xb, yb = batches[i % len(batches)]
            _step(model, opt, xb, yb)
            state.step += 1
            if kind == "elastic" and state.step % args.commit_every == 0:
                c0 = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - c0)
        hvd.barrier()
        return args.block * BATCH * hvd.size() / (time.perf_counter() - t0)

    for p in range(args.pairs + 1):
        order = ("elastic", "plain") if p % 2 == 0 else ("plain", "elastic")
        pair = {kind: block(kind) for kind in order}
        if p > 0:  # the first pair warms up
            blocks += [(k, pair[k]) for k in ("elastic", "plain")]
    if hvd.rank() == 0:
        result = {"blocks": blocks, "commit_s": commits[len(commits) // (args.pairs + 1):]}
        (args.out / "throughput.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=["recover", "throughput"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--block", type=int, default=40)
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    recover(args) if args.mode == "recover" else throughput(args)


if __name__ == "__main__":
    main()
