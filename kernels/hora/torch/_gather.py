"""allgather, alltoall and reducescatter with Horovod's semantics, without autograd (data plane).

These need every rank's first dimension (or splits) before the data moves, so they first
all_gather a small int64 row per rank on the gloo side group; the same row carries the
dtype and trailing shape, which are verified (TensorMismatchError on disagreement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hora.torch import _handles, _pages
from hora.torch._collective import Collective
from hora.torch._engine import Comm, begin, refusal, submit
from hora.torch._handles import Handle, guarded, signature
from hora.torch._kinds import Average, Kind
from hora.torch._ops import _TORCH_OPS, _average, _scale
from hora.torch._process_sets import ProcessSet, comm_of, global_process_set

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return (t.reshape(1) if t.dim() == 0 else t).contiguous()


def _gather_into(
    comm: Comm, src: torch.Tensor, dims: list[int], name: str
) -> tuple[list[Any], torch.Tensor, Any]:
    """Launch an all_gather of rows (``dims[m]`` from member m); return works, buffer, finish."""
    rest = tuple(src.shape[1:])
    top = max(dims)
    if top == 0:
        empty = src.new_empty((0, *rest))
        return [], empty, lambda: empty
    if all(d == top for d in dims):
        out = _pages.empty((top * comm.size, *rest), src)
        work = guarded(Kind.ALLGATHER, name, _ALL_GATHER, out, src,
                       group=comm.group, async_op=True)  # fmt: skip
        return [work], out, lambda: out
    padded = src.new_zeros((top, *rest))
    padded[: src.shape[0]] = src
    big = _pages.empty((top * comm.size, *rest), src)
    work = guarded(Kind.ALLGATHER, name, _ALL_GATHER, big, padded,
                   group=comm.group, async_op=True)  # fmt: skip

    def finish() -> torch.Tensor:
        return torch.cat([big[r * top : r * top + d] for r, d in enumerate(dims)],
                         out=_pages.empty((sum(dims), *rest), src))

    return [work], big, finish


def _dims(rows: list[list[int] | None]) -> list[int]:
    return [0 if r is None else r[0] for r in rows]


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Handle:
    """Start an allgather; see :func:`allgather`."""
    comm = comm_of(process_set, Kind.ALLGATHER)
    state, name = begin(comm, Kind.ALLGATHER, name)
    src = _as_rows(tensor)
    rest = tuple(src.shape[1:])
    key = signature(Kind.ALLGATHER.code, 0, src.dtype, rest)
    nbytes = src.numel() * src.element_size() * comm.size

    def launch(rows: list[list[int] | None]) -> tuple[Any, ...]:
        if comm.size == 1:
            return [], src.clone
        dims = _dims(rows)
        works, _buf, finish = _gather_into(comm, _handles.widen(src), dims, name)
        nbytes = sum(dims) * src[:1].numel() * src.element_size()
        if src.dtype == torch.int16:
            return works, lambda: finish().to(torch.int16), nbytes
        return works, finish, nbytes

    return submit(comm, Kind.ALLGATHER, name, key, [src.shape[0]], launch, nbytes)



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
    comm = comm_of(process_set, Kind.ALLTOALL)
    state, name = begin(comm, Kind.ALLTOALL, name)
    src = _as_rows(tensor)
    with refusal(comm, Kind.ALLTOALL, name):
        send = _check_splits(splits, src.shape[0], comm.size)
    rest = tuple(src.shape[1:])
    key = signature(Kind.ALLTOALL.code, 0, src.dtype, rest)

    def launch(rows: list[list[int] | None]) -> tuple[list[Any], Any]:
        if comm.size == 1:
            return [], lambda: (src.clone(), torch.tensor(send, dtype=torch.int32))
        recv = [0 if row is None else row[comm.index] for row in rows]
        got = torch.tensor(recv, dtype=torch.int32)
        wire = _handles.widen(src)
        out = wire.new_empty((sum(recv), *rest))
        work = None
        if any(sum(row) for row in rows if row is not None):
            work = guarded(Kind.ALLTOALL, name, dist.all_to_all_single, out, wire,
                           output_split_sizes=recv, input_split_sizes=send,
                           group=comm.group, async_op=True)  # fmt: skip
        narrow = src.dtype != wire.dtype
        return [work], lambda: (out.to(src.dtype) if narrow else out, got)

    return submit(comm, Kind.ALLTOALL, name, key, send, launch, src.numel() * src.element_size())



def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter; see :func:`reducescatter`."""
    coll = Collective(op, None, name, prescale_factor, postscale_factor, process_set)
    return scatter_async(tensor, coll)


def scatter_async(tensor: torch.Tensor, coll: Collective) -> Handle:
    """Start the reducescatter ``coll`` describes of ``tensor``."""
    if tensor.dim() == 0:  # Horovod refuses it too: a scalar has no rows to scatter
        raise ValueError("reducescatter() needs a tensor of at least one dimension, got a scalar")
    kind = Kind.REDUCESCATTER
    comm = comm_of(coll.process_set, kind)
    state, name = begin(comm, kind, coll.name)
    with refusal(comm, kind, name):
        op = coll.reduce_op()
    pre, post = coll.prescale, coll.postscale
    buf = _as_rows(tensor).clone()
    n, size, index = buf.shape[0], comm.size, max(comm.index, 0)
    counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
    lo = sum(counts[:index])
    key = signature(kind.code, op, buf.dtype, buf.shape)

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        _scale(buf, pre)
        wire = _handles.widen(buf)
        work = None
        if size > 1 and buf.numel():
            work = guarded(kind, name, dist.all_reduce, wire, op=_TORCH_OPS[op],
                           group=comm.group, async_op=True)  # fmt: skip

        def finish() -> torch.Tensor:
            if wire is not buf:
                buf.copy_(wire)
            mine = buf[lo : lo + counts[index]].clone()
            if op == Average:
                _average(mine, size, post)
            else:
                _scale(mine, post)
            return mine

        return [work], finish

    return submit(comm, kind, name, key, [], launch, buf.numel() * buf.element_size())

