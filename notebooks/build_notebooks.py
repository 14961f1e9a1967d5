"""Write the example notebooks (without outputs) from the cell sources below.

The ``.ipynb`` files are committed; this script is their source of truth, and
tests/unit/test_notebooks_clean.py checks that they match it and carry no outputs.
Run ``python notebooks/build_notebooks.py`` after editing a cell here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
# the hora kernel (``hora kernel install``; ``hora up`` installs it): the notebooks open on it
KERNELSPEC = {"name": "hora", "display_name": "Python 3 (hora)", "language": "python"}
Cell = tuple[str, str]  # ("md" | "code", source)


def md(text: str) -> Cell:
    return ("md", text.strip("\n"))


def code(text: str) -> Cell:
    return ("code", text.strip("\n"))


QUICKSTART: list[Cell] = [
    md("""
# hora quickstart

hora runs notebook cells on a set of persistent engines, one per rank (one per GPU on a GPU
machine, 2 on CPU). The process group is initialised once when the engines start, so models,
tensors and optimizers stay on their engines between cells.

This notebook starts two engines, says hello from each rank, runs an allreduce across the ranks
and moves variables between the notebook and the engines.
"""),
    md("Load the magics. With the **Python 3 (hora)** kernel (`hora kernel install`) this is "
       "already done; running it again is harmless."),
    code("%load_ext hora"),
    md("""
Start two engines. `%dist_start` returns when every engine has run `hora.torch.init()`, and
prints which rank runs where. (Without `%dist_start`, the first `%%distributed` cell starts the
engines itself.)
"""),
    code("%dist_start -n 2"),
    md("""
`%%distributed` runs the cell on every rank. By default only rank 0's output is shown;
`--all` shows every rank's output, prefixed with its rank.
"""),
    code("""
%%distributed --all
import os

import hora.torch as hvd

print(f"hello from rank {hvd.rank()} of {hvd.size()} (pid {os.getpid()})")
"""),
    md("""
The ranks form one process group: `hvd.allreduce` sums (or averages, the default) a tensor
across them. Rank r contributes r + 1, so the sum over 2 ranks is 3.
"""),
    code("""
%%distributed --all
import torch

contribution = torch.tensor([hvd.rank() + 1.0])
total = hvd.allreduce(contribution, op=hvd.Sum, name="quickstart.sum")
print(f"rank {hvd.rank()}: allreduce sum = {total.item():g}")
"""),
    md("State persists on the engines between cells: `total` is still there. `--out VAR` "
       "gathers the engines' `VAR` from every rank into a list named `VAR` in the notebook."),
    code("""
%%distributed --out total
total = total.item()
"""),
    code("total  # noqa: F821 (--out made it: one value per rank)"),
    md("""
`%dist_push` sends notebook variables to every engine (tensors go to each engine's device);
`%dist_pull` brings a variable back, from every rank or from one (`--rank R`).
"""),
    code("""
scale = 10.0
%dist_push scale
"""),
    code("""
%%distributed
scaled = scale * (hvd.rank() + 1)
"""),
    code("""
%dist_pull scaled
print("pulled from every rank:", scaled)  # noqa: F821 (%dist_pull defined it)
"""),
    code("""
%dist_pull scaled --rank 1
print("pulled from rank 1:", scaled)  # noqa: F821 (%dist_pull defined it)
"""),
    md("`%dist_status` shows each rank's liveness, device and memory; `%dist_stop` stops the "
       "engines (shutting the kernel down stops them too)."),
    code("%dist_status"),
    code("%dist_stop"),
]

TRAIN_DIGITS: list[Cell] = [
    md("""
# Data-parallel training on the digits data set

A small CNN learns scikit-learn's 8x8 handwritten digits, trained data-parallel on two engines
with `hora.torch` (Horovod's API on `torch.distributed`). Every step is its own cell, and the
model, data and optimizer stay on the engines between cells.
"""),
    code("""
%load_ext hora
%dist_start -n 2
"""),
    md("""
## Data: each rank keeps its own shard

Every rank loads the (tiny) data set with the same split, then keeps every `size`-th sample
starting at its rank. Both shards are cut to the same length so that every rank runs the same
number of steps.
"""),
    code("""
%%distributed --all
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import hora.torch as hvd

torch.manual_seed(0)
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    digits.images / 16.0, digits.target, test_size=0.25, random_state=0, stratify=digits.target
)


def shard(x, y):
    n = len(x) // hvd.size() * hvd.size()
    x = torch.tensor(x[hvd.rank() : n : hvd.size()], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(y[hvd.rank() : n : hvd.size()])


x_train, y_train = shard(x_train, y_train)
x_test, y_test = shard(x_test, y_test)
print(f"rank {hvd.rank()}: {len(x_train)} training images, {len(x_test)} test images")
"""),
    md("""
## Model and optimizer

The usual Horovod recipe: scale the learning rate by the number of ranks, wrap the optimizer in
`hvd.DistributedOptimizer` (gradients are averaged across ranks in `step()`), and broadcast rank
0's initial weights and optimizer state so that every rank starts from the same model.
"""),
    code("""
%%distributed
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8x8 -> 4x4
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4 -> 2x2
    nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
print(f"{sum(p.numel() for p in model.parameters())} parameters, the same on all ranks")
"""),
    md("""
## Train

Rank 0's output streams live while the cell runs. The epoch loss is averaged over the ranks
with `hvd.allreduce`, so every rank holds the same `losses` list.
"""),
    code("""
%%distributed
epochs, batch_size = 15, 32
losses = []
for epoch in range(epochs):
    model.train()
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
    running = 0.0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        optimizer.step()
        running += loss.item() * len(idx)
    epoch_loss = hvd.allreduce(torch.tensor(running / len(order)), name="epoch_loss").item()
    losses.append(epoch_loss)
    print(f"epoch {epoch + 1:2d}: loss {epoch_loss:.4f}")
"""),
    md("""
## Evaluate

Each rank scores its own test shard; `hvd.allreduce` averages the per-rank accuracies (the
shards have the same size, so that is the accuracy on the whole test set).
"""),
    code("""
%%distributed
model.eval()
with torch.no_grad():
    local_accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean()
accuracy = hvd.allreduce(local_accuracy, name="accuracy").item()
print(f"rank {hvd.rank()} accuracy {local_accuracy.item():.3f}; averaged over ranks {accuracy:.3f}")
"""),
    md("Bring the metric back to the notebook and check it."),
    code("""
%dist_pull accuracy --rank 0
test_accuracy = accuracy  # noqa: F821 (%dist_pull defined it)
print(f"test accuracy: {test_accuracy:.1%}")
assert test_accuracy >= 0.90, f"expected at least 90% test accuracy, got {test_accuracy:.1%}"
"""),
    md("## Loss curve\n\nPlots made on rank 0 are displayed in the notebook."),
    code("""
%%distributed
import matplotlib.pyplot as plt

if hvd.rank() == 0:
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(range(1, len(losses) + 1), losses, marker="o")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("digits CNN on 2 ranks")
    fig.tight_layout()
    plt.show()
"""),
    code("%dist_stop"),
]

HOROVOD_ORIGINAL = '''
```python
import horovod.torch as hvd

hvd.init()
torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(train_set, batch_size=32, sampler=sampler)
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {hvd.allreduce(loss, name='loss').item():.4f}")
```
'''

FROM_HOROVOD: list[Cell] = [
    md("""
# From Horovod to hora: change the import

`hora.torch` mirrors `horovod.torch`, so a Horovod training loop moves over by changing one line.
Under Horovod this loop would be exported to a script and started with `horovodrun -np 2` (or
`mpirun`); here it runs on the notebook's engines with `%%distributed`, and its model stays
there afterwards for the next cell.

The original Horovod code:
""" + HOROVOD_ORIGINAL),
    code("""
%load_ext hora
%dist_start -n 2
"""),
    md("""
The same loop with `import hora.torch as hvd` (the only change; the data is scikit-learn's
digits as a `TensorDataset`, and the model a small MLP).
"""),
    code("""
%%distributed
# import horovod.torch as hvd   <- before
import hora.torch as hvd  # <- after: nothing else changes

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

hvd.init()
torch.manual_seed(0)
digits = load_digits()
train_set = TensorDataset(
    torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        return self.out(F.relu(self.hidden(x)))


epochs = 5
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(train_set, batch_size=32, sampler=sampler)
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    mean_loss = hvd.allreduce(loss.detach(), name="loss").item()
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {mean_loss:.4f}")
"""),
    md("""
`hvd.init()` is harmless here: the engines initialised the process group when they started.
The trained model is still on the engines; check that every rank holds the same weights:
"""),
    code("""
%%distributed
checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
"""),
    code("""
%dist_pull checksum
checksums = checksum  # noqa: F821 (%dist_pull defined it: one value per rank)
print("parameter checksum per rank:", checksums)
assert len(set(checksums)) == 1, "ranks diverged"
"""),
    code("%dist_stop"),
]

NOTEBOOKS: dict[str, list[Cell]] = {
    "01-quickstart.ipynb": QUICKSTART,
    "02-train-digits.ipynb": TRAIN_DIGITS,
    "03-from-horovod.ipynb": FROM_HOROVOD,
}


def build(cells: list[Cell]) -> nbformat.NotebookNode:
    """Return a notebook without outputs from ``(kind, source)`` cells (ids are stable)."""
    nb = new_notebook(metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}})
    for i, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell["id"] = f"cell-{i:02d}"
        nb.cells.append(cell)
    return nb


def render(cells: list[Cell]) -> str:
    """Return the notebook's file contents, as written to disk."""
    return nbformat.writes(build(cells)) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else HERE
    for name, cells in NOTEBOOKS.items():
        (out / name).write_text(render(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
