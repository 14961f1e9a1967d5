"""The shared helpers and allreduce / broadcast without autograd (data plane).

The reduce ops (Horovod's values) and the operations' names are in
:mod:`hora.torch._collective`; here are :func:`synchronize` and :func:`poll`, and the
allreduce and broadcast forms that need no autograd: ``_async`` forms return a handle, ``_``
forms work in place; every allreduce form passes one :class:`Collective` down. The
differentiable out-of-place forms are in :mod:`hora.torch._autograd`; every public name is
re-exported by :mod:`hora.torch.mpi_ops`. Each collective runs on its process set's
group once every member submitted its name: the ranks negotiate on a gloo side group first
(:mod:`hora.torch._engine`), so ranks passing different tensors get
:class:`~hora.errors.TensorMismatchError` instead of garbage, a hang or a gloo abort.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from hora.torch import _engine, _handles, _lane, _pages, _shm_ops, _state, timeline
from hora.torch._collective import Collective
from hora.torch._engine import Comm, GroupHandle, begin, refusal, refuse, submit
from hora.torch._handles import Handle, guarded, signature
from hora.torch._kinds import Average, Kind, Max, Min, Product, Sum
from hora.torch._process_sets import ProcessSet, comm_of, global_process_set

_TORCH_OPS = {
    Average: dist.ReduceOp.SUM,
    Sum: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}
# how the shared-memory ring reduces each op (Average: a sum, each slice divided in the ring)
_SHM_OPS = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}
# read once: the allreduce path runs per call, where an Enum attribute costs a lookup each time
_ALLREDUCE, _ALLREDUCE_CODE = Kind.ALLREDUCE, Kind.ALLREDUCE.code


def _scale(t: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors truncate toward zero like Horovod's ScaleBuffer."""
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.double() * factor))


def _average(t: torch.Tensor, n: int, postscale: float) -> None:
    if postscale != 1.0 and (t.is_floating_point() or t.is_complex()):
        t.mul_(postscale / n)  # one rounding, as Horovod scales by postscale / size
        return
    _shm_ops.divide(t, n)  # the division the ring applies to its slices
    _scale(t, postscale)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shm_lane(comm: Comm, t: torch.Tensor, op: int) -> _lane.Lane | None:
    """The members' shared-memory lane when it carries this allreduce (the same on every member).

    A CPU tensor of a dtype the ring reduces, in a CPU world whose members share a host and
    decided on the ring (at their first round): the lane's thread runs the data's moves in
    launch order, which is the same on every member (:mod:`hora.torch._lane`).
    """
    lane = comm.shm_lane
    if not isinstance(lane, _lane.Lane) or t.device.type != "cpu" or op not in _SHM_OPS:
        return None
    if t.dtype not in _shm_ops.DTYPES or _state.require_init("allreduce").device.type != "cpu":
        return None
    return lane


def _allreduce_buffer(
    comm: Comm,
    kind: Kind,
    name: str,
    op: int,
    coll: Collective,
    out: torch.Tensor,
    src: torch.Tensor | None = None,
    *,
    ret: torch.Tensor | None = None,
    key: tuple[int, ...] | None = None,
    source: torch.Tensor | None = None,
) -> Handle:
    """Reduce ``out`` in place (contiguous); copy into ``src`` at the end when it is a view.

    ``name`` and ``op`` are ``coll``'s, resolved (:meth:`Collective.reduce_op`); ``coll``
    gives the scale factors. With ``source``, ``out`` is empty and the values come from
    ``source`` (out of place), read when the collective launches. The handle's result is
    ``ret`` when given (the caller's tensor for in-place forms).
    """
    key = key or signature(_ALLREDUCE_CODE, op, out.dtype, out.shape)
    pre, post = coll.prescale, coll.postscale

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        lane = _shm_lane(comm, out, op) if out.numel() and comm.size > 1 else None
        if source is not None and (lane is None or pre != 1.0):
            out.copy_(source)
        _scale(out, pre)
        wire = out if lane is not None else _handles.widen(out)
        work: Any = None
        if lane is not None:
            work = lane.allreduce(out, kind, name, _SHM_OPS[op], tag=_ALLREDUCE,
                                  source=source if pre == 1.0 else None)
        elif out.numel() and comm.size > 1:
            work = dist.all_reduce(wire, op=_TORCH_OPS[op], group=comm.group, async_op=True)

        def finish() -> torch.Tensor:
            if isinstance(work, _lane.LaneWork):
                work.raise_error()
            if wire is not out:
                out.copy_(wire)
            if op == Average and lane is None:  # the lane divides each slice as it sums it
                _average(out, comm.size, post)
            else:
                _scale(out, post)
            if src is not None:
                src.copy_(out)
            return out if ret is None else ret

        return [work], finish

    return submit(comm, kind, name, key, [], launch, _nbytes(out))


def _serve_allreduce(comm: Comm, key: Sequence[int], _rows: Any) -> list[Any]:
    """A joined rank's part of an allreduce: zeros (through the ring when the others use it)."""
    zeros = torch.zeros(_handles.key_shape(key), dtype=_handles.key_dtype(key))
    lane = _shm_lane(comm, zeros, key[1]) if zeros.numel() else None
    if lane is not None:
        return [lane.allreduce(zeros, Kind.JOIN, "", _SHM_OPS[key[1]], tag=Kind.ALLREDUCE)]
    zeros = _handles.widen(zeros)
    return [dist.all_reduce(zeros, op=_TORCH_OPS[key[1]], group=comm.group, async_op=True)]


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing ``tensor`` over all ranks without changing it; see :func:`allreduce`.

    Returns:
        A handle for :func:`synchronize` (which returns the reduced tensor) or :func:`poll`.
    """
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    return reduce_async(tensor, coll, inplace=False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing ``tensor`` in place over all ranks; see :func:`allreduce`.

    Returns:
        A handle; :func:`synchronize` returns ``tensor`` holding the result.
    """
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    return reduce_async(tensor, coll, inplace=True)


def reduce_async(tensor: torch.Tensor, coll: Collective, inplace: bool) -> Handle:
    """Start the allreduce ``coll`` describes of ``tensor`` (in place or into a new tensor)."""
    comm = comm_of(coll.process_set, _ALLREDUCE)
    state, name = begin(comm, _ALLREDUCE, coll.name)
    try:  # what refusal() does, without a context manager's cost on this per-call path
        op = coll.reduce_op()
    except Exception as e:
        refuse(comm, _ALLREDUCE, name, e)
        raise
    t = tensor.detach()
    run = _allreduce_buffer
    if not inplace and t.is_contiguous() and _shm_lane(comm, t, op) is not None:
        # the ring reads t as it copies in: no clone first
        buf = _pages.empty(t.shape, t)
        return run(comm, _ALLREDUCE, name, op, coll, buf, source=t)
    if not inplace:
        buf = _pages.clone(t)
        return run(comm, _ALLREDUCE, name, op, coll, buf)
    if t.is_contiguous():
        return run(comm, _ALLREDUCE, name, op, coll, t, ret=tensor)
    return run(comm, _ALLREDUCE, name, op, coll, t.contiguous(), t, ret=tensor)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce a tensor over all ranks in place; see :func:`allreduce`.

    Returns:
        ``tensor``, now holding the reduced values.

    Example:
        >>> t = torch.ones(3)
        >>> hvd.allreduce_(t, op=hvd.Sum) is t
        True
    """
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    with _lane.Blocking():  # this thread runs the lane's part of it
        return reduce_async(tensor, coll, inplace=True).wait()  # type: ignore[no-any-return]


def grouped_reduce_async(
    tensors: Sequence[torch.Tensor], coll: Collective, inplace: bool
) -> Handle:
    """Start the allreduce ``coll`` describes of a list of tensors, as one fused collective."""
    kind = Kind.GROUPED_ALLREDUCE
    comm = comm_of(coll.process_set, kind)
    state, name = begin(comm, kind, coll.name)
    try:  # refusal(), inline (see reduce_async)
        op = coll.reduce_op()
    except Exception as e:
        refuse(comm, kind, name, e)
        raise
    tensors = list(tensors)
    if not tensors:
        return Handle(kind, name, [], list)
    t0 = timeline.now_ns() if timeline.enabled() else 0
    if len({t.dtype for t in tensors}) != 1:
        return _grouped_per_tensor(tensors, inplace, name, op, coll)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors],
                     out=_pages.empty((sum(t.numel() for t in tensors),), tensors[0].detach()))
    if t0:
        timeline.record(name, "MEMCPY_IN_FUSION_BUFFER", t0, timeline.now_ns(), _nbytes(flat))
    shapes = [t.shape for t in tensors]
    crc = zlib.crc32(repr([list(s) for s in shapes]).encode())
    key = (*signature(kind.code, op, flat.dtype, flat.shape)[:-1], crc)
    inner = _allreduce_buffer(comm, kind, name, op, coll, flat, key=key)

    def split(out: torch.Tensor) -> list[torch.Tensor]:
        pieces = [
            p.view(s) for p, s in zip(out.split([s.numel() for s in shapes]), shapes, strict=True)
        ]
        if inplace:
            for t, p in zip(tensors, pieces, strict=True):
                t.detach().copy_(p)
            return tensors
        return pieces

    return GroupHandle(kind, name, [inner], lambda: split(inner.wait()))


def _grouped_per_tensor(
    tensors: list[torch.Tensor], inplace: bool, name: str, op: int, coll: Collective
) -> Handle:
    """Tensors of several dtypes: one allreduce each, named ``name.i``, one handle for all."""
    handles = [
        reduce_async(t, replace(coll, op=op, average=None, name=f"{name}.{i}"), inplace)
        for i, t in enumerate(tensors)
    ]
    return GroupHandle(
        Kind.GROUPED_ALLREDUCE, name, handles, lambda: [h.wait() for h in handles]
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing a list of tensors as one fused collective; see :func:`grouped_allreduce`."""
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    return grouped_reduce_async(tensors, coll, inplace=False)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start reducing a list of tensors in place as one fused collective."""
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    return grouped_reduce_async(tensors, coll, inplace=True)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place in one fused collective; returns the same tensors."""
    coll = Collective(op, average, name, prescale_factor, postscale_factor, process_set)
    with _lane.Blocking():
        return synchronize(  # type: ignore[no-any-return]
            grouped_reduce_async(tensors, coll, inplace=True))


def _broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool, process_set: ProcessSet
) -> Handle:
    comm = comm_of(process_set, Kind.BROADCAST)
    state, name = begin(comm, Kind.BROADCAST, name)
    with refusal(comm, Kind.BROADCAST, name):
        if not isinstance(root_rank, int) or root_rank not in comm.ranks:
            where = (
                f"the world of size {state.size}"
                if comm.set_id == 0
                else f"process set {comm.ranks}"
            )
            raise ValueError(f"root_rank={root_rank!r} is outside {where}")
    src = tensor.detach()
    direct = inplace and src.is_contiguous()
    buf = src if direct else _pages.clone(src)
    key = signature(Kind.BROADCAST.code, root_rank, buf.dtype, buf.shape)

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        work = None
        if buf.numel() and comm.size > 1:
            work = guarded(Kind.BROADCAST, name, dist.broadcast, buf, src=root_rank,
                           group=comm.group, async_op=True)  # fmt: skip

        def finish() -> torch.Tensor:
            if inplace and not direct:
                src.copy_(buf)
                return tensor
            return tensor if direct else buf

        return [work], finish

    return submit(comm, Kind.BROADCAST, name, key, [], launch, _nbytes(buf))


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting root's ``tensor`` into a new tensor on every rank."""
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start broadcasting root's ``tensor`` into ``tensor`` on every rank."""
    return _broadcast(tensor, root_rank, name, True, process_set)



def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with root's values on every rank and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def synchronize(handle: Handle) -> Any:
    """Wait for an async collective and return its result (Horovod's ``synchronize``).

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The output tensor (a list for grouped forms, a pair for alltoall with splits).

    Example:
        >>> h = hvd.allreduce_async(t); out = hvd.synchronize(h)
    """
    if not isinstance(handle, Handle):
        raise TypeError(
            f"synchronize() expects a handle from an *_async call, got {type(handle).__name__}"
        )
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Return True when the async collective behind ``handle`` has finished.

    Example:
        >>> h = hvd.allreduce_async(t)
        >>> while not hvd.poll(h):
        ...     pass  # compute something else meanwhile
        >>> out = hvd.synchronize(h)
    """
    if not isinstance(handle, Handle):
        raise TypeError(
            f"poll() expects a handle from an *_async call, got {type(handle).__name__}"
        )
    return handle.poll()


_engine.SERVERS[Kind.ALLREDUCE.code] = _serve_allreduce
