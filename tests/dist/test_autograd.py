"""Gradients through the collectives, and the optimizer behaviours Horovod's suite relies on.

Part of the shared world of 2 and 3 ranks (conftest.py): ``suite`` runs on every rank and
each test checks one op's gradient. Rank r weighs its output by ``r + 1`` so that a wrong
reduction (sum instead of average, another rank's rows) shows. The backward rules are
Horovod's (hora/torch/_autograd.py): allgather and broadcast average the output gradients,
reducescatter with Sum multiplies the gathered gradient by the world size.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn


# ------------------------------------------------------------------------- rank side
def _grad(fn: Any, *shapes_or_tensors: Any) -> list[list[Any]]:
    """Call ``fn(*leaves)`` (it returns the loss), backward, return each leaf's gradient."""
    leaves = [t.clone().requires_grad_(True) for t in shapes_or_tensors]
    fn(*leaves).backward()
    return [leaf.grad.tolist() for leaf in leaves]


def _single_ops(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    w = float(rank + 1)
    res: dict[str, Any] = {}
    x = torch.tensor([1.0, -2.0])
    for op in ("Average", "Sum"):
        res[f"allreduce_{op}"] = _grad(
            lambda t, op=op: (hvd.allreduce(t * 1.0, op=getattr(hvd, op)) * w).sum(), x
        )
    res["allreduce_fp16"] = _grad(
        lambda t: (hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16) * w).sum(), x
    )

    def gathered(t: torch.Tensor) -> torch.Tensor:
        y = hvd.allgather(t, name="ag.gather")
        return (y * torch.arange(y.numel()).view_as(y) * w).sum()

    res["allgather"] = _grad(gathered, torch.ones(rank + 1, 2))
    res["broadcast"] = _grad(
        lambda t: (hvd.broadcast(t, root_rank=size - 1) * w).sum(), torch.full((3,), 1.0 * rank)
    )

    def scattered(t: torch.Tensor) -> torch.Tensor:
        out, got = hvd.alltoall(t, splits=[rank + 1] * size)
        res["alltoall_got"] = got.tolist()
        coef = 100.0 * rank + torch.arange(out.shape[0], dtype=torch.float32)
        return (out * coef[:, None]).sum()

    res["alltoall"] = _grad(scattered, torch.zeros((rank + 1) * size, 2))
    res["alltoall_equal"] = _grad(lambda t: (hvd.alltoall(t) * w).sum(), torch.ones(2 * size, 3))
    uneven = torch.ones(2 * size + 1, 2)  # rank 0 gets one row more
    res["reducescatter_Sum"] = _grad(
        lambda t: (hvd.reducescatter(t, op=hvd.Sum) * w).sum(), uneven
    )
    res["reducescatter_Average"] = _grad(lambda t: (hvd.reducescatter(t) * w).sum(), uneven)
    res["reducescatter_prescale"] = _grad(
        lambda t: (hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5) * w).sum(), uneven
    )
    leaf = torch.ones(2 * size, requires_grad=True)
    out = hvd.reducescatter(leaf, op=hvd.Max)
    try:
        out.sum().backward()
        res["reducescatter_Max"] = "no error"
    except ValueError as e:
        res["reducescatter_Max"] = str(e)
    with torch.no_grad():
        res["no_grad"] = hvd.allgather(torch.ones(1, requires_grad=True)).requires_grad
    return res


def _grouped_ops(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    w = float(rank + 1)
    res: dict[str, Any] = {}
    res["allreduce"] = _grad(
        lambda a, b: sum(
            (y * w * k).sum()
            for k, y in enumerate(hvd.grouped_allreduce([a, b], op=hvd.Sum), start=1)
        ),
        torch.ones(2),
        torch.ones(3, 1),
    )

    def gathered(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ya, yb = hvd.grouped_allgather([a, b])
        return (ya * torch.arange(ya.numel()) * w).sum() + (yb * w).sum()

    res["allgather"] = _grad(gathered, torch.ones(rank + 1), torch.ones(2, 2))
    res["reducescatter"] = _grad(
        lambda a, b: sum((y * w).sum() for y in hvd.grouped_reducescatter([a, b], op=hvd.Sum)),
        torch.ones(2 * size),
        torch.ones(size, 3),
    )
    return res


def _sparse(hvd: Any, rank: int, sparse_as_dense: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=sparse_as_dense,
    )
    res: dict[str, Any] = {}
    for step in range(2):
        opt.zero_grad()
        emb(torch.tensor([[rank, rank + 1, 4]])).sum().backward()
        opt.synchronize()
        res[f"sparse{step}"] = emb.weight.grad.is_sparse
        res[f"grad{step}"] = emb.weight.grad.to_dense().tolist()
        with opt.skip_synchronize():
            opt.step()
    res["weight"] = emb.weight.detach().clone()
    return res


def _step_after_synchronize(hvd: Any) -> list[str]:
    model = nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(1, 1)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(w.message) for w in caught]


def _state_of_fresh_optimizer(hvd: Any) -> dict[str, Any]:
    """Horovod's test_broadcast_state_no_grad: a frozen int parameter and a trained one."""
    model = nn.Module()
    model.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    model.b = nn.Parameter(torch.rand(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.b.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return {
        "a_grad": model.a.grad,
        "b_grad": None if model.b.grad is None else model.b.grad.tolist(),
        "b_unchanged": bool(torch.equal(model.b.detach(), before)),
        "state": sorted(opt.state[model.b]),
    }


def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Run every part on this rank (called by the shared world, after ``hvd.init()``)."""
    return {
        "single": _single_ops(hvd, rank, size),
        "grouped": _grouped_ops(hvd, rank, size),
        "sparse": {d: _sparse(hvd, rank, d) for d in (False, True)},
        "step_warnings": _step_after_synchronize(hvd),
        "fresh_state": _state_of_fresh_optimizer(hvd),
    }


# ------------------------------------------------------------------------ test side
def _blocks(size: int, rows: int) -> list[int]:
    """reducescatter's split of ``rows`` rows: the first ``rows % size`` ranks get one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _by_block(size: int, rows: int, value: Any, width: int) -> list[list[float]]:
    """A (rows, width) gradient whose block q (reducescatter's split) holds ``value(q)``."""
    return [[float(value(q))] * width for q, n in enumerate(_blocks(size, rows)) for _ in range(n)]


def test_allreduce_gradient_is_the_allreduce_of_the_gradients(world: Any) -> None:
    n = world.size
    total = sum(range(1, n + 1))
    for r in world.results(__file__):
        g = r["single"]
        assert g["allreduce_Average"] == [pytest.approx([total / n] * 2)]
        assert g["allreduce_Sum"] == [pytest.approx([total] * 2)]
        assert g["allreduce_fp16"] == [pytest.approx([total] * 2)]  # float32 again


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient(world: Any) -> None:
    n = world.size
    mean = sum(range(1, n + 1)) / n
    for rank, r in enumerate(world.results(__file__)):
        lo = sum(range(1, rank + 1)) * 2
        want = np.arange(lo, lo + (rank + 1) * 2).reshape(rank + 1, 2) * mean
        np.testing.assert_allclose(r["single"]["allgather"][0], want)
        assert r["single"]["no_grad"] is False


def test_broadcast_gradient_is_the_averaged_gradient_on_the_root_only(world: Any) -> None:
    n = world.size
    mean = sum(range(1, n + 1)) / n
    for rank, r in enumerate(world.results(__file__)):
        assert r["single"]["broadcast"] == [pytest.approx([mean if rank == n - 1 else 0.0] * 3)]


def test_alltoall_gradient_returns_to_the_sender(world: Any) -> None:
    n = world.size
    for s, r in enumerate(world.results(__file__)):
        g = r["single"]
        assert g["alltoall_got"] == [q + 1 for q in range(n)]
        before = sum(range(1, s + 1))  # rows that lower ranks put first in every receiver
        # row i of the block sent to rank q is row before + i there, weighed 100 q + row
        want = [[100.0 * q + before + i] * 2 for q in range(n) for i in range(s + 1)]
        assert g["alltoall"] == [want]
        assert g["alltoall_equal"] == [[[float(q + 1)] * 3 for q in range(n) for _ in (0, 1)]]


@pytest.mark.parametrize(("key", "factor"), [
    ("reducescatter_Sum", "size"), ("reducescatter_Average", 1.0),
    ("reducescatter_prescale", "half size"),
])
def test_reducescatter_gradient_is_the_gathered_gradient(
    world: Any, key: str, factor: Any
) -> None:
    n = world.size
    f = {"size": n, "half size": n / 2}.get(factor, factor)
    for r in world.results(__file__):
        assert r["single"][key] == [_by_block(n, 2 * n + 1, lambda q: (q + 1) * f, 2)]


def test_reducescatter_max_has_no_gradient(world: Any) -> None:
    for r in world.results(__file__):
        assert "op=Average and op=Sum only" in r["single"]["reducescatter_Max"]


def test_grouped_gradients_follow_the_single_ops(world: Any) -> None:
    n = world.size
    total = sum(range(1, n + 1))
    for rank, r in enumerate(world.results(__file__)):
        g = r["grouped"]
        assert g["allreduce"] == [[float(total)] * 2, [[2.0 * total]] * 3]
        lo = sum(range(1, rank + 1))
        want = (np.arange(lo, lo + rank + 1) * total / n).tolist()
        assert g["allgather"][0] == pytest.approx(want)
        assert g["allgather"][1] == [[total / n] * 2] * 2
        assert g["reducescatter"] == [
            [float((q + 1) * n) for q in range(n) for _ in (0, 1)],
            _by_block(n, n, lambda q: (q + 1) * n, 3),
        ]


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["allgather", "dense"])
def test_sparse_gradients_stay_sparse_and_are_averaged(
    world: Any, sparse_as_dense: bool
) -> None:
    n = world.size
    counts = np.zeros(10)
    for rank in range(n):
        for i in (rank, rank + 1, 4):
            counts[i] += 1
    want = np.repeat(counts[:, None] / n, 3, axis=1)
    res = [r["sparse"][sparse_as_dense] for r in world.results(__file__)]
    for r in res:
        for step in (0, 1):
            assert r[f"sparse{step}"] is True  # SparseAdam refuses dense gradients
            np.testing.assert_allclose(r[f"grad{step}"], want, rtol=1e-6)
    for r in res[1:]:
        torch.testing.assert_close(r["weight"], res[0]["weight"], atol=0, rtol=0)


def test_step_after_synchronize_warns_once(world: Any) -> None:
    for r in world.results(__file__):
        assert len(r["step_warnings"]) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in (
            r["step_warnings"][0]
        )


def test_broadcast_optimizer_state_creates_an_empty_state(world: Any) -> None:
    for r in world.results(__file__):
        s = r["fresh_state"]
        assert s["a_grad"] is None  # requires_grad=False: left alone
        assert s["b_grad"] == [0.0] * 4  # Horovod leaves the zero gradient in place
        assert s["b_unchanged"] is True  # the weight-decay step was undone
        assert s["state"] == ["momentum_buffer"]
