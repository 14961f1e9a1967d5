"""Autograd for the out-of-place collectives, with Horovod's backward rules (data plane).

The public out-of-place collectives live here too (re-exported by :mod:`hora.torch.mpi_ops`):
when an input requires grad (and grad mode is on), they run through these Functions so that
gradients flow back; otherwise through the ops layer (:mod:`hora.torch._ops`,
:mod:`~hora.torch._gather`, :mod:`~hora.torch._grouped`). Each backward is itself made of the
public collectives, on the same process set as the forward:

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

from hora.torch import _lane, basics
from hora.torch._collective import Collective
from hora.torch._gather import allgather_async, alltoall_async, scatter_async
from hora.torch._grouped import grouped_allgather_async, grouped_scatter_async
from hora.torch._kinds import Average, Kind, Sum
from hora.torch._ops import broadcast_async, grouped_reduce_async, reduce_async, synchronize
from hora.torch._process_sets import ProcessSet, comm_of, global_process_set
from hora.torch.compression import Compression

Grads = tuple[torch.Tensor | None, ...]


def set_rank(process_set: ProcessSet) -> int:
    """This rank's index inside ``process_set`` (its global rank for the global set)."""
    own = getattr(process_set, "rank", None)
    if callable(own):
        return int(own())
    ranks = getattr(process_set, "ranks", None)
    return basics.rank() if ranks is None else list(ranks).index(basics.rank())


def _offset(counts: torch.Tensor, process_set: ProcessSet) -> int:
    """Rows that ranks before this one contributed, from every rank's row counts."""
    return int(counts[: set_rank(process_set)].sum())


def _rows(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _factor(coll: Collective) -> float:
    """What a reducescatter's gathered gradient is multiplied by: the set's size for Sum.

    Raises:
        ValueError: for Min, Max and Product (raised before the backward communicates).
    """
    op = Average if coll.op is None else coll.op
    if op not in (Average, Sum):
        raise ValueError(
            f"reducescatter: gradients are defined for op=Average and op=Sum only, not op={op!r}"
            "; detach() the input or reduce with Average or Sum"
        )
    return (coll.process_set.size() if op == Sum else 1) * coll.prescale * coll.postscale


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor if factor == 1 else tensor * factor


def _reduce(tensor: torch.Tensor, coll: Collective) -> torch.Tensor:
    """The allreduce ``coll`` describes, through :class:`AllreduceFn` when grads flow."""
    if tensor.requires_grad and torch.is_grad_enabled():
        comm_of(coll.process_set, Kind.ALLREDUCE)
        return AllreduceFn.apply(tensor, coll)  # type: ignore[no-any-return]
    with _lane.Blocking():  # this thread runs the lane's part of it
        return reduce_async(tensor, coll, inplace=False).wait()  # type: ignore[no-any-return]


def _grouped_reduce(tensors: list[torch.Tensor], coll: Collective) -> list[torch.Tensor]:
    """The grouped allreduce ``coll`` describes (through :class:`GroupedAllreduceFn` for grads)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        comm_of(coll.process_set, Kind.GROUPED_ALLREDUCE)
        return list(GroupedAllreduceFn.apply(coll, *tensors))
    with _lane.Blocking():
        return synchronize(  # type: ignore[no-any-return]
            grouped_reduce_async(tensors, coll, inplace=False))


class AllreduceFn(torch.autograd.Function):
    """Differentiable allreduce: the gradient's allreduce, with the same op and scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, coll: Collective) -> torch.Tensor:
        ctx.coll = coll
        return _reduce(tensor, coll)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        return _reduce(grad, ctx.coll.unnamed()), None


class GroupedAllreduceFn(torch.autograd.Function):
    """Differentiable grouped allreduce: one grouped allreduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, coll: Collective, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.coll = coll
        return tuple(_grouped_reduce(list(tensors), coll))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Grads:
        return (None, *_grouped_reduce(list(grads), ctx.coll.unnamed()))


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
        if basics.rank() != ctx.root:  # root_rank is a global rank, as in Horovod
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
    def forward(ctx: Any, tensor: torch.Tensor, coll: Collective) -> torch.Tensor:
        ctx.coll = coll
        return synchronize(scatter_async(tensor, coll))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        coll = ctx.coll
        factor = _factor(coll)
        return _scaled(allgather(grad, process_set=coll.process_set), factor), None


class GroupedReducescatterFn(torch.autograd.Function):
    """Differentiable grouped reducescatter: one grouped allgather of the gradients."""

    @staticmethod
    def forward(ctx: Any, coll: Collective, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.coll = coll
        return tuple(synchronize(grouped_scatter_async(list(tensors), coll)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Grads:
        coll = ctx.coll
        factor = _factor(coll)
        gathered = grouped_allgather(list(grads), process_set=coll.process_set)
        return (None, *(_scaled(g, factor) for g in gathered))


# The public out-of-place collectives: through the Functions above when an input requires grad.


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce a tensor over all ranks; the input is not modified.

    Args:
        tensor: the tensor to reduce; same shape and dtype on every rank.
        average: deprecated Horovod flag; use ``op``.
        name: a name for error messages and the timeline.
        compression: ``hvd.Compression.none`` (default), ``fp16`` or ``bf16``: compress before
            sending, decompress the result.
        op: Average (default), Sum, Min, Max or Product. Average of integer tensors truncates
            toward zero.
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing (and averaging).
        process_set: the process set to run on (default: every rank).

    Returns:
        A new tensor with the reduced values.

    Raises:
        NotInitializedError: before ``init()``.
        TensorMismatchError: ranks passed different shapes or dtypes.
        CollectiveTimeout: ranks never arrived within the timeout (named).
        RankFailedError: a rank died (named).
        UnsupportedError: op=Adasum or another process set.

    Example:
        >>> avg = hvd.allreduce(torch.tensor([float(hvd.rank())]), name="r")
    """
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    if compression is None or compression is Compression.none:
        return _reduce(tensor, coll)
    wire, ctx = compression.compress(tensor)
    return compression.decompress(_reduce(wire, coll), ctx)  # type: ignore[no-any-return]


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors over all ranks in one fused collective (inputs unchanged).

    Args:
        tensors: the tensors; the same list of shapes and dtypes on every rank.
        average: deprecated; use ``op``.
        name: a name for errors and the timeline.
        compression: as in :func:`allreduce`.
        op: as in :func:`allreduce`.
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing.
        process_set: the process set to run on (default: every rank).

    Returns:
        New tensors, one per input.

    Example:
        >>> a, b = hvd.grouped_allreduce([torch.ones(2), torch.zeros(3)], op=hvd.Sum)
    """
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    plain = compression is None or compression is Compression.none
    packed = [(t, None) if plain else compression.compress(t) for t in tensors]
    out = _grouped_reduce([p[0] for p in packed], coll)
    if plain:
        return out
    return [compression.decompress(o, p[1]) for o, p in zip(out, packed, strict=True)]


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (the input is not modified).

    Args:
        tensor: same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives.
        name: a name for errors and the timeline.
        process_set: the process set to run on (default: every rank).

    Returns:
        A new tensor holding root's values.

    Raises:
        ValueError: root_rank outside the world.
        TensorMismatchError: shapes or dtypes differ across ranks.

    Example:
        >>> w = hvd.broadcast(torch.randn(3), root_rank=0, name="w")
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        comm_of(process_set, Kind.BROADCAST)
        return BroadcastFn.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return]
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank).

    Args:
        tensor: same dtype and trailing dimensions on every rank.
        name: a name for errors and the timeline.
        process_set: the process set to run on (default: every rank).

    Returns:
        A new tensor: rank 0's rows, then rank 1's, ...

    Raises:
        TensorMismatchError: dtype or trailing dimensions differ across ranks.

    Example:
        >>> everyone = hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        comm_of(process_set, Kind.ALLGATHER)
        return AllgatherFn.apply(tensor, name, process_set)  # type: ignore[no-any-return]
    return synchronize(allgather_async(tensor, name, process_set))


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send rows ``splits[i]`` of ``tensor`` to rank i, and receive every rank's rows for us.

    Args:
        tensor: the rows to scatter (first dimension = sum of splits).
        splits: rows for each rank, in rank order; default an equal split.
        name: a name for errors and the timeline.
        process_set: the process set to run on (default: every rank).

    Returns:
        The received tensor (rank order); with ``splits`` given, the pair
        ``(tensor, received_splits)`` like Horovod (received_splits: int32, one per rank).

    Raises:
        ValueError: bad splits, or an equal split that does not divide the first dimension.
        TensorMismatchError: dtype or trailing dimensions differ across ranks.

    Example:
        >>> x = torch.arange(2.0 * hvd.size())
        >>> out, got = hvd.alltoall(x, splits=[2] * hvd.size())   # 2 rows to every rank
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        out, got = AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, got = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, got)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> torch.Tensor:
    """Reduce over all ranks, then give rank r its block of rows (Horovod's split).

    The first dimension is split in rank order; when it does not divide evenly, the first
    ``rows % size`` ranks get one extra row.

    Args:
        tensor: same shape and dtype on every rank.
        name: a name for errors and the timeline.
        op: Average (default), Sum, Min, Max or Product.
        process_set: the process set to run on (default: every rank).
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing.
        compression: as in :func:`hora.torch.allreduce`.

    Returns:
        This rank's block of the reduced tensor.

    Raises:
        ValueError: for a scalar (0-d) tensor, on every rank alike (before any communication).

    Example:
        >>> block = hvd.reducescatter(torch.ones(4, 2), op=hvd.Sum)
    """
    coll = Collective(op, None, name, prescale_factor, postscale_factor, process_set)
    plain = compression is None or compression is Compression.none
    wire, ctx = (tensor, None) if plain else compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = ReducescatterFn.apply(wire, coll)
    else:
        out = synchronize(scatter_async(wire, coll))
    return out if plain else compression.decompress(out, ctx)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather each tensor of a list (Horovod's grouped form); return the list of results.

    Args:
        tensors: the tensors; each follows :func:`hora.torch.allgather`'s rules.
        name: a name for errors and the timeline (member i is named ``name.i``).
        process_set: the process set to run on (default: every rank).

    Returns:
        One gathered tensor per input, in order.

    Example:
        >>> outs = hvd.grouped_allgather([torch.ones(2), torch.zeros(3, 1)])
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(GroupedAllgatherFn.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))  # type: ignore[no-any-return]


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list (Horovod's grouped form).

    Args:
        tensors: the tensors; each follows :func:`hora.torch.reducescatter`'s rules.
        name: a name for errors and the timeline (member i is named ``name.i``).
        op: Average (default), Sum, Min, Max or Product.
        process_set: the process set to run on (default: every rank).
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing.

    Returns:
        This rank's block of each reduced tensor, in order.

    Raises:
        ValueError: for a scalar (0-d) tensor, which has no rows to scatter.

    Example:
        >>> blocks = hvd.grouped_reducescatter([torch.ones(4, 2), torch.ones(6)], op=hvd.Sum)
    """
    coll = Collective(op, None, name, prescale_factor, postscale_factor, process_set)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(GroupedReducescatterFn.apply(coll, *tensors))
    return synchronize(grouped_scatter_async(tensors, coll))  # type: ignore[no-any-return]
