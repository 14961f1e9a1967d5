"""Elastic training of a small CNN on scikit-learn's digits, Horovod's elastic pattern, on hora.

Horovod's ``pytorch_mnist_elastic.py`` with its import line changed (``import hora.torch as
hvd``): the state (model, optimizer, sampler, epoch, batch) is committed every few batches; when
a worker dies the survivors go back to the last commit and go on with the others, and a
replacement joins at a later commit::

    hora run -np 3 --min-np 2 --max-np 3 python examples/train_digits_elastic.py

Kill one of its workers (``kill -9 PID``): the job goes on; the same script also runs under a
plain ``hora run -np 2`` (a fixed world) or alone.

The data (1,797 8x8 images of digits, 10 classes) ships with scikit-learn: no download.
"""

from __future__ import annotations

import argparse

import hora.torch as hvd
import torch
import torch.nn.functional as F  # noqa: N812 (the usual torch alias)
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="hora example: elastic CNN on sklearn digits")
    p.add_argument("--epochs", type=int, default=3, help="training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for ONE worker")
    p.add_argument("--batches-per-commit", type=int, default=5, help="commit every N batches")
    return p.parse_args()


class Net(nn.Module):
    """A small CNN for 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    dataset = TensorDataset(x, torch.tensor(digits.target, dtype=torch.long))

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    def train_epoch(state: hvd.elastic.TorchState) -> None:
        model.train()
        for batch_idx, (data, target) in enumerate(loader):
            state.batch = batch_idx
            if batch_idx % args.batches_per_commit == 0:
                state.commit()
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            sampler.record_batch(batch_idx, args.batch_size)
        loss = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: loss {loss.item():.4f} on {hvd.size()} workers")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            train_epoch(state)
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()

    def on_state_reset() -> None:
        for group in optimizer.param_groups:  # the learning rate follows the world size
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)


if __name__ == "__main__":
    main()
