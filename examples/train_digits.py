"""Data-parallel training of a small CNN on scikit-learn's digits, Horovod style, with hora.

Every step of the Horovod guides, on hora's Horovod-compatible API:

    hvd.init()                                   # world from hora run / torchrun / mpirun
    torch.cuda.set_device(hvd.local_rank())      # pin one GPU per process
    DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())
    lr * hvd.size()                              # scale the learning rate
    hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters / hvd.broadcast_optimizer_state   # same start everywhere
    checkpoint on rank 0 only; resume after a restart
    hvd.allreduce(metric)                        # average validation metrics

Runs unchanged under any launcher (see docs/run.md):

    hora run -np 2 python examples/train_digits.py
    torchrun --nproc_per_node 2 examples/train_digits.py
    mpirun -np 2 python examples/train_digits.py

The data (1,797 8x8 images of digits, 10 classes) ships with scikit-learn: no download.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import hora.torch as hvd
import torch
import torch.nn.functional as F  # noqa: N812 (the usual torch alias)
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="hora example: a CNN on sklearn digits")
    p.add_argument("--epochs", type=int, default=8, help="training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for ONE process")
    p.add_argument("--seed", type=int, default=42, help="random seed")
    p.add_argument("--checkpoint-dir", type=Path,
                   default=Path(tempfile.gettempdir(), "hora-train-digits"),
                   help="where rank 0 saves checkpoint.pt after each epoch")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint (automatic when HORA_RESTART_COUNT > 0)")
    return p.parse_args()


class Net(nn.Module):
    """A small CNN for 1x8x8 images: two conv layers, one pooling, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The same fixed 80/20 split on every rank (seeded), images scaled to [0, 1]."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=0.2, random_state=seed, stratify=digits.target)
    return TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_test], y[idx_test])


def restart_requested(args: argparse.Namespace) -> bool:
    # hora's job service sets HORA_RESTART_COUNT when it retries a job; torchrun its own name.
    restarts = os.environ.get("HORA_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return args.resume or int(restarts or 0) > 0


def save_checkpoint(path: Path, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a torn checkpoint


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy over the whole test set: each rank's shard summed with hvd.allreduce."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            totals[0] += F.cross_entropy(out, y, reduction="sum").item()
            totals[1] += (out.argmax(1) == y).sum().item()
            totals[2] += len(y)
    # Metric averaging across ranks: every rank gets the same numbers.
    totals = hvd.allreduce(totals, op=hvd.Sum, name="val_metrics")
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def main() -> None:
    args = parse_args()
    hvd.init()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # pin one GPU per process, by local rank
        device = torch.device("cuda", hvd.local_rank())
    else:
        torch.set_num_threads(1)  # one core per rank: ranks must not fight over the CPUs
    torch.manual_seed(args.seed)

    train_set, test_set = datasets(args.seed)
    # Shard the training data: each rank sees 1/size of every epoch.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                       shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    # Test shards without DistributedSampler's padding, so every image is counted exactly once.
    test_loader = DataLoader(Subset(test_set, range(hvd.rank(), len(test_set), hvd.size())),
                             batch_size=256)

    model = Net().to(device)
    # Scale the learning rate by the number of processes (the global batch grows with it).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    # Wrap the optimizer: step() applies gradients averaged over all ranks. Wrap it before
    # creating the LR scheduler, so the scheduler drives the wrapped optimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    # Resume: rank 0 reads the checkpoint; the broadcasts below hand it to every rank.
    ckpt = args.checkpoint_dir / "checkpoint.pt"
    start_epoch = 0
    if hvd.rank() == 0 and restart_requested(args) and ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1
        print(f"resumed from {ckpt} after epoch {start_epoch}", flush=True)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    scheduler.load_state_dict(hvd.broadcast_object(scheduler.state_dict(), root_rank=0,
                                                   name="scheduler"))
    # Every rank starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on all ranks
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        scheduler.step()
        val_loss, val_acc = evaluate(model, test_loader, device)
        if hvd.rank() == 0:  # only rank 0 prints and writes checkpoints
            save_checkpoint(ckpt, epoch, model, optimizer, scheduler)
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss.item():.4f}  "
                  f"test loss {val_loss:.4f}  test accuracy {val_acc:.4f}", flush=True)

    _, test_acc = evaluate(model, test_loader, device)
    if hvd.rank() == 0:
        print(f"trained on {hvd.size()} process(es) in {time.perf_counter() - t0:.1f}s", flush=True)
        print(f"final test accuracy: {test_acc:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
