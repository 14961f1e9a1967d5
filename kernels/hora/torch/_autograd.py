"""Autograd for the out-of-place collectives, with Horovod's backward rules (data plane).

When an input requires grad (and grad mode is on), the public collectives run through these
Functions so that gradients flow back. Each backward is itself made of the public
collectives, on the same process set as the forward:

- allreduce: the allreduce of the gradient, with the same op and scale factors;
- allgather: the gradient averaged over the ranks, then this rank's rows;
- broadcast: the gradient averaged over the ranks on the root, zeros elsewhere;
- alltoall: an alltoall of the gradient that sends back the rows each rank received;
- reducescatter: the allgather of the gradient, times the set's size for Sum, times the
  scale factors;
- the grouped forms: the same rule for each member, as one grouped collective.

The averaging in allgather and broadcast is Horovod's choice: it assumes every rank computed
the same loss from the gathered (or broadcast) tensor, so the ranks' gradients are copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.torch import _state
from hora.torch._gather import allgather, alltoall_async, reducescatter_async
from hora.torch._grouped import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter_async,
)
from hora.torch._process_sets import ProcessSet
from hora.torch.compression import Compression
from hora.torch.mpi_ops import (
    Average,
    Sum,
    allreduce,
    broadcast_async,
    grouped_allreduce,
    synchronize,
)

Grads = tuple[torch.Tensor | None, ...]


def set_rank(process_set: ProcessSet) -> int:
    """This rank's index inside ``process_set`` (its global rank for the global set)."""
    own = getattr(process_set, "rank", None)
    if callable(own):
        return int(own())
    ranks = getattr(process_set, "ranks", None)
    return _state.rank() if ranks is None else list(ranks).index(_state.rank())


def _offset(counts: torch.Tensor, process_set: ProcessSet) -> int:
    """Rows that ranks before this one contributed, from every rank's row counts."""
    return int(counts[: set_rank(process_set)].sum())


def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _factor(op: int | None, process_set: ProcessSet, pre: float, post: float) -> float:
    """What a reducescatter's gathered gradient is multiplied by: the set's size for Sum.

    Raises:
        ValueError: for Min, Max and Product (raised before the backward communicates).
    """
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise ValueError(
            f"reducescatter: gradients are defined for op=Average and op=Sum only, not op={op!r}"
            "; detach() the input or reduce with Average or Sum"
        )
    return (process_set.size() if op == Sum else 1) * pre * post


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor if factor == 1 else tensor * factor


class AllreduceFn(torch.autograd.Function):
    """Differentiable allreduce."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: Any,
        name: Any,
        op: Any,
        pre: float,
        post: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.args = (average, op, pre, post, process_set)
        return allreduce(tensor, average, name, Compression.none, op, pre, post, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        average, op, pre, post, process_set = ctx.args
        out = allreduce(grad, average, None, Compression.none, op, pre, post, process_set)
        return out, None, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    """Differentiable grouped allreduce: one grouped allreduce of the gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        average: Any,
        name: Any,
        op: Any,
        pre: float,
        post: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (average, op, pre, post, process_set)
        out = grouped_allreduce(
            list(tensors), average, name, Compression.none, op, pre, post, process_set
        )
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Grads:
        average, op, pre, post, process_set = ctx.args
        out = grouped_allreduce(
            list(grads), average, None, Compression.none, op, pre, post, process_set
        )
        return (None,) * 6 + tuple(out)


class AllgatherFn(torch.autograd.Function):
    """Differentiable allgather."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: Any, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.shape, ctx.rows, ctx.process_set = tensor.shape, _rows(tensor), process_set
        return allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        ps = ctx.process_set
        rows = ctx.rows
        summed = allreduce(grad, op=Average, process_set=ps)
        counts = allgather(torch.tensor([rows]), process_set=ps)
        mine = summed.narrow(0, _offset(counts, ps), rows).reshape(ctx.shape)
        return mine, None, None


class GroupedAllgatherFn(torch.autograd.Function):
    """Differentiable grouped allgather: one grouped allreduce, one allgather of row counts."""

    @staticmethod
    def forward(
        ctx: Any, name: Any, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        ctx.rows = [_rows(t) for t in tensors]
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Grads:
        ps = ctx.process_set
        rows = ctx.rows
        summed = grouped_allreduce(list(grads), op=Average, process_set=ps)
        counts = allgather(torch.tensor([rows]), process_set=ps)  # one row per rank
        offsets = counts[: set_rank(ps)].sum(dim=0)
        out = tuple(
            s.narrow(0, int(o), n).reshape(shape)
            for s, o, n, shape in zip(summed, offsets, rows, ctx.shapes, strict=True)
        )
        return (None, None, *out)


class BroadcastFn(torch.autograd.Function):
    """Differentiable broadcast."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        out = allreduce(grad, op=Average, process_set=ctx.process_set)
        if _state.rank() != ctx.root:  # root_rank is a global rank, as in Horovod
            out = torch.zeros_like(out)
        return out, None, None, None


class AlltoallFn(torch.autograd.Function):
    """Differentiable alltoall; returns (received tensor, received splits)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        splits: Sequence[int] | torch.Tensor | None,
        name: Any,
        process_set: ProcessSet,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, got = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.shape, ctx.got, ctx.process_set = tensor.shape, got, process_set
        ctx.mark_non_differentiable(got)
        return out, got

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _splits_grad: Any) -> Grads:
        back, _ = synchronize(alltoall_async(grad, ctx.got, None, ctx.process_set))
        return back.reshape(ctx.shape), None, None, None


class ReducescatterFn(torch.autograd.Function):
    """Differentiable reducescatter (op Average or Sum)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Any,
        op: int,
        process_set: ProcessSet,
        pre: float,
        post: float,
    ) -> torch.Tensor:
        ctx.args = (op, process_set, pre, post)
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        op, ps, pre, post = ctx.args
        factor = _factor(op, ps, pre, post)
        return _scaled(allgather(grad, process_set=ps), factor), *(None,) * 5


class GroupedReducescatterFn(torch.autograd.Function):
    """Differentiable grouped reducescatter: one grouped allgather of the gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        name: Any,
        op: int,
        process_set: ProcessSet,
        pre: float,
        post: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, process_set, pre, post)
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Grads:
        op, ps, pre, post = ctx.args
        factor = _factor(op, ps, pre, post)
        gathered = grouped_allgather(list(grads), process_set=ps)
        return (None,) * 5 + tuple(_scaled(g, factor) for g in gathered)

