"""allgather, alltoall and reducescatter with Horovod's semantics (data plane).

These need every rank's first dimension (or splits) before the data moves, so they first
all_gather a small int64 row per rank on the gloo side group; the same row carries the
dtype and trailing shape, which are verified (TensorMismatchError on disagreement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hora.torch import _state, timeline
from hora.torch._handles import SIG_LEN, Handle, SigCheck, begin, guarded, signature, start
from hora.torch._process_sets import ProcessSet, check_process_set, global_process_set
from hora.torch.compression import Compression
from hora.torch.mpi_ops import (
    _OPC_ALLGATHER,
    _OPC_ALLTOALL,
    _OPC_RSCATTER,
    _TORCH_OPS,
    Average,
    _average,
    _resolve_op,
    _scale,
    synchronize,
)

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows(
    state: _state.State, op: str, name: str, sig: tuple[int, ...], payload: list[int]
) -> list[list[int]]:
    if state.size == 1:
        return [list(sig) + payload]
    return [r[SIG_LEN:] for r in SigCheck(state, op, name, (*sig, *payload)).wait()]


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return (t.reshape(1) if t.dim() == 0 else t).contiguous()


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start an allgather; see :func:`allgather`."""
    state, name = begin("allgather", name)
    check_process_set(process_set)
    t0 = timeline.now_ns() if timeline.enabled() else 0
    src = _as_rows(tensor)
    rest = tuple(src.shape[1:])
    sig = signature(_OPC_ALLGATHER, 0, src.dtype, rest)
    dims = [r[0] for r in _rows(state, "allgather", name, sig, [src.shape[0]])]
    top = max(dims)
    if state.size == 1 or top == 0:
        return Handle(
            "allgather",
            name,
            [],
            lambda: src.clone() if state.size == 1 else src.new_empty((0, *rest)),
        )
    if all(d == top for d in dims):
        out = src.new_empty((top * state.size, *rest))
        work = guarded("allgather", name, _ALL_GATHER, out, src, async_op=True)
        return Handle("allgather", name, [work], lambda: out, out.numel() * out.element_size(), t0)
    padded = src.new_zeros((top, *rest))
    padded[: src.shape[0]] = src
    big = src.new_empty((top * state.size, *rest))
    work = guarded("allgather", name, _ALL_GATHER, big, padded, async_op=True)

    def finish() -> torch.Tensor:
        return torch.cat([big[r * top : r * top + d] for r, d in enumerate(dims)])

    return Handle(
        "allgather", name, [work], finish, sum(dims) * src[:1].numel() * src.element_size(), t0
    )


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank).

    Args:
        tensor: same dtype and trailing dimensions on every rank.
        name: a name for errors and the timeline.
        process_set: only the global set.

    Returns:
        A new tensor: rank 0's rows, then rank 1's, ...

    Raises:
        TensorMismatchError: dtype or trailing dimensions differ across ranks.

    Example:
        >>> everyone = hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        from hora.torch._autograd import AllgatherFn

        check_process_set(process_set)
        return AllgatherFn.apply(tensor, name, process_set)  # type: ignore[no-any-return]
    return synchronize(allgather_async(tensor, name, process_set))


def _check_splits(splits: Any, rows: int, size: int) -> list[int]:
    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall: first dimension {rows} is not divisible by size {size}; pass splits="
            )
        return [rows // size] * size
    sp = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(sp) != size or any(s < 0 for s in sp) or sum(sp) != rows:
        raise ValueError(
            f"alltoall: splits={sp} must be {size} non-negative ints summing to {rows}"
        )
    return sp


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start an alltoall; see :func:`alltoall`."""
    state, name = begin("alltoall", name)
    check_process_set(process_set)
    t0 = timeline.now_ns() if timeline.enabled() else 0
    src = _as_rows(tensor)
    send = _check_splits(splits, src.shape[0], state.size)
    rest = tuple(src.shape[1:])
    sig = signature(_OPC_ALLTOALL, 0, src.dtype, rest)
    table = _rows(state, "alltoall", name, sig, send)
    recv = [row[state.rank] for row in table]
    out = src.new_empty((sum(recv), *rest))
    got = torch.tensor(recv, dtype=torch.int32)
    work = None
    if state.size > 1 and any(sum(row) for row in table):
        work = guarded(
            "alltoall",
            name,
            dist.all_to_all_single,
            out,
            src,
            output_split_sizes=recv,
            input_split_sizes=send,
            async_op=True,
        )
    elif state.size == 1:
        out = src.clone()
    return Handle(
        "alltoall", name, [work], lambda: (out, got), out.numel() * out.element_size(), t0
    )


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
        process_set: only the global set.

    Returns:
        The received tensor (rank order); with ``splits`` given, the pair
        ``(tensor, received_splits)`` like Horovod (received_splits: int32, one per rank).

    Raises:
        ValueError: bad splits, or an equal split that does not divide the first dimension.
        TensorMismatchError: dtype or trailing dimensions differ across ranks.

    Example:
        >>> out, got = hvd.alltoall(x, splits=[1, 3])
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        from hora.torch._autograd import AlltoallFn

        out, got = AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, got = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, got)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter; see :func:`reducescatter`."""
    if tensor.dim() == 0:  # Horovod refuses it too: a scalar has no rows to scatter
        raise ValueError("reducescatter() needs a tensor of at least one dimension, got a scalar")
    state, name = begin("reducescatter", name)
    check_process_set(process_set)
    op = _resolve_op(op, None)
    t0 = timeline.now_ns() if timeline.enabled() else 0
    buf = _as_rows(tensor).clone()
    n, size, rank = buf.shape[0], state.size, state.rank
    counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
    lo = sum(counts[:rank])
    sig = signature(_OPC_RSCATTER, op, buf.dtype, buf.shape)
    tq = start(state, "reducescatter", name, sig, t0)
    _scale(buf, prescale_factor)
    work = None
    if size > 1 and buf.numel():
        work = guarded(
            "reducescatter", name, dist.all_reduce, buf, op=_TORCH_OPS[op], async_op=True
        )

    def finish() -> torch.Tensor:
        mine = buf[lo : lo + counts[rank]].clone()
        if op == Average:
            _average(mine, size, postscale_factor)
        else:
            _scale(mine, postscale_factor)
        return mine

    return Handle("reducescatter", name, [work], finish, buf.numel() * buf.element_size(), t0, tq)


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
        process_set: only the global set.
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
    plain = compression is None or compression is Compression.none
    wire, ctx = (tensor, None) if plain else compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        from hora.torch._autograd import ReducescatterFn

        out = ReducescatterFn.apply(
            wire, name, op, process_set, prescale_factor, postscale_factor
        )
    else:
        out = synchronize(
            reducescatter_async(wire, name, op, process_set, prescale_factor, postscale_factor)
        )
    return out if plain else compression.decompress(out, ctx)
