"""Broadcast model and optimizer state, and average metrics across ranks (data plane).

``broadcast_parameters`` and ``broadcast_optimizer_state`` mirror ``horovod.torch.functions``.
Both move tensors as one flat buffer per dtype and device (a few collectives instead of one per
tensor), after one metadata exchange that checks every rank passed the same names, shapes and
dtypes. ``allreduce_metrics`` and :class:`Metric` are the validation-metric recipe from the
Horovod examples, packed into one allreduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import TensorMismatchError
from hora.torch import _state
from hora.torch._engine import launch_planned
from hora.torch._kinds import Average, Max, Min, Sum
from hora.torch._objects import allgather_object, broadcast_object
from hora.torch._ops import allreduce_
from hora.torch._process_sets import comm_of, global_process_set
from hora.torch._stall import wait_work
from hora.torch.optimizer import local_step

__all__ = [
    "Metric", "allreduce_metrics", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters",
]

Numeric = float | int | torch.Tensor


def _items(params: Any) -> list[tuple[str, torch.Tensor]]:
    """Normalise Horovod's accepted forms: a state_dict, or (name, tensor) pairs / tensors."""
    if isinstance(params, Mapping):
        return sorted((str(k), v) for k, v in params.items())
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise ValueError(f"params must be a state_dict or a list of (name, tensor) pairs, "
                         f"got {type(params).__name__}")
    out = []
    for i, x in enumerate(params):
        name, t = (str(x[0]), x[1]) if isinstance(x, tuple) else (f"param.{i}", x)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"params entry {name!r} is a {type(t).__name__}, not a tensor")
        out.append((name, t))
    return out


def _root(comm: Any, root_rank: int) -> int:
    if not isinstance(root_rank, int) or root_rank not in comm.ranks:
        raise ValueError(f"root_rank={root_rank!r} is outside the ranks {comm.ranks}")
    return root_rank


def _check_same(op: str, items: list[tuple[str, torch.Tensor]], process_set: Any) -> None:
    """Every rank compares all ranks' (name, shape, dtype) lists; all raise the same error."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in items]
    every = allgather_object(mine, name=f"{op}.signature", process_set=process_set)
    bad = [r for r, sig in enumerate(every) if sig != every[0]]
    if not bad:
        return
    theirs = every[bad[0]]
    if len(theirs) != len(every[0]):
        raise TensorMismatchError(op, "*", f"rank 0 passes {len(every[0])} tensors, rank "
                                  f"{bad[0]} passes {len(theirs)}", [0, *bad])
    k = next(i for i, (a, b) in enumerate(zip(every[0], theirs, strict=True)) if a != b)
    detail = f"rank 0 has {every[0][k][1:]}, rank {bad[0]} has {theirs[k][1:]}"
    if every[0][k][0] != theirs[k][0]:
        detail = f"names differ: rank 0 {every[0][k][0]!r}, rank {bad[0]} {theirs[k][0]!r}"
    raise TensorMismatchError(op, every[0][k][0], detail, [0, *bad])


def _group_for(state: _state.RankState, comm: Any, device: torch.device) -> Any:
    return comm.side if device.type == "cpu" and state.backend == "nccl" else comm.group


def _broadcast_flat(
    op: str, tensors: list[torch.Tensor], root: int, state: _state.RankState, comm: Any
) -> None:
    """Broadcast root's tensors into every rank's tensors, one flat buffer per dtype/device."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            kinds.setdefault((t.dtype, t.device), []).append(t)
    works = []
    for (dtype, device), ts in kinds.items():
        if state.rank == root:
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
        else:
            flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)
        work = launch_planned(op, str(dtype), dist.broadcast, flat, src=root,
                           group=_group_for(state, comm, device), async_op=True)
        works.append((work, flat, ts, dtype))
    for work, flat, ts, dtype in works:
        wait_work(work, op, str(dtype))
        if state.rank != root:
            with torch.no_grad():
                for t, piece in zip(ts, flat.split([t.numel() for t in ts]), strict=True):
                    t.copy_(piece.view(t.shape))


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: Any = global_process_set) -> None:
    """Overwrite every rank's parameters (in place) with root's.

    Args:
        params: ``model.state_dict()`` (buffers included), ``model.named_parameters()``, or a
            list of ``(name, tensor)`` pairs or tensors; the same names and shapes on each rank.
        root_rank: the rank whose values everyone receives.
        process_set: the process set to run on (default: every rank).

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: ``params`` of the wrong type, or root_rank outside the world.
        TensorMismatchError: ranks passed different names, shapes or dtypes (names the ranks).

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    state = _state.require_init("broadcast_parameters")
    comm = comm_of(process_set, "broadcast_parameters")
    root = _root(comm, root_rank)
    items = _items(params)
    if comm.size == 1:
        return
    _check_same("broadcast_parameters", items, process_set)
    _broadcast_flat("broadcast_parameters", [t for _, t in items], root, state, comm)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was cut out of a nested structure (shape, dtype, device to rebuild it)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _cut(obj: Any, out: list[torch.Tensor]) -> Any:
    """Replace every tensor in nested dicts/lists/tuples by a _Slot, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _Slot(len(out) - 1, tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, dict):
        return {k: _cut(v, out) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cut(v, out) for v in obj)
    return obj


def _paste(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _paste(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_paste(v, tensors) for v in obj)
    return obj


def _wire_device(state: _state.RankState, device: str) -> torch.device:
    """NCCL moves CUDA tensors only; CPU state (Adam's step counts) travels on the device."""
    if state.backend == "nccl":
        return state.device
    return torch.device(device)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Any = global_process_set) -> None:
    """Make every rank's optimizer state (and param_groups: lr, momentum, ...) equal root's.

    Works when the state is still empty on some ranks (e.g. resuming from a checkpoint that
    only rank 0 loaded): root's structure is broadcast first, then its tensors, and each other
    rank loads the result with ``optimizer.load_state_dict``. Scalars (step counts, lr) and
    tensors are both carried. An optimizer with no state at all is first given one the way
    Horovod does it, by a local step with zero gradients: each parameter that requires grad
    and has none keeps that zero gradient afterwards (Horovod's behaviour), but unlike Horovod
    the parameters' values are put back, so weight decay does not move them.

    Args:
        optimizer: a torch optimizer or a DistributedOptimizer, over the same parameters on
            every rank.
        root_rank: the rank whose state everyone receives.
        process_set: the process set to run on (default: every rank).

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: root_rank outside the world, or an optimizer whose parameter groups do not
            match root's (raised by ``load_state_dict`` on that rank).

    Example:
        >>> if hvd.rank() == 0:
        ...     opt.load_state_dict(torch.load("ckpt.pt")["optimizer"])
        >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
    """
    state = _state.require_init("broadcast_optimizer_state")
    comm = comm_of(process_set, "broadcast_optimizer_state")
    root = _root(comm, root_rank)
    if comm.size == 1:
        return
    if not optimizer.state_dict()["state"]:
        _init_state(optimizer)
    tensors: list[torch.Tensor] = []
    skeleton = _cut(optimizer.state_dict(), tensors) if state.rank == root else None
    skeleton = broadcast_object(skeleton, root_rank=root, name="broadcast_optimizer_state",
                                process_set=process_set)
    slots: list[_Slot] = []
    _collect_slots(skeleton, slots)
    slots.sort(key=lambda s: s.index)
    if state.rank == root:
        wire = [t.to(_wire_device(state, s.device)) for t, s in zip(tensors, slots, strict=True)]
    else:
        wire = [torch.empty(s.shape, dtype=s.dtype, device=_wire_device(state, s.device))
                for s in slots]
    _broadcast_flat("broadcast_optimizer_state", wire, root, state, comm)
    if state.rank != root:
        received = [t.to(s.device) for t, s in zip(wire, slots, strict=True)]
        optimizer.load_state_dict(_paste(skeleton, received))


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's state by a step with zero gradients; keep the parameter values."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        if p.requires_grad and p.grad is None:
            zero = torch.zeros_like(p)
            p.grad = zero.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else zero
    saved = [p.detach().clone() for p in params]
    local_step(optimizer)
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)


def _collect_slots(obj: Any, out: list[_Slot]) -> None:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect_slots(v, out)


def _pack(values: Any, state: _state.RankState) -> tuple[torch.Tensor, list[tuple[str, Any]]]:
    """Flatten a number, a tensor or a dict of them into one float64 vector plus a recipe."""
    device = state.device if state.backend == "nccl" else torch.device("cpu")
    items = values.items() if isinstance(values, Mapping) else [("", values)]
    parts: list[torch.Tensor] = []
    recipe: list[tuple[str, Any]] = []
    for k, v in items:
        if isinstance(v, torch.Tensor):
            recipe.append((k, (tuple(v.shape), v.dtype, v.device)))
            parts.append(v.detach().to(device=device, dtype=torch.float64).reshape(-1))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            recipe.append((k, None))
            parts.append(torch.tensor([float(v)], dtype=torch.float64, device=device))
        else:
            raise TypeError(f"metric {k or 'value'!r} is a {type(v).__name__}; "
                            "pass numbers or tensors")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64), recipe


def allreduce_metrics(values: Any, op: int = Average, name: str | None = None) -> Any:
    """Average (or sum, min, max) metrics over all ranks in one collective.

    Args:
        values: a number, a tensor, or a dict of names to numbers/tensors (e.g. loss and
            accuracy of this rank's validation shard). Call it on every rank with the same keys.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min`` or ``hvd.Max``.
        name: a name for errors and the timeline.

    Returns:
        The same structure with reduced values: floats for numbers, tensors (original dtype
        and device) for tensors.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        TypeError: a value is not a number or tensor.
        TensorMismatchError: ranks passed different keys or shapes.

    Example:
        >>> m = hvd.allreduce_metrics({"val_loss": loss_sum / n, "val_acc": correct / n})
        >>> if hvd.rank() == 0:
        ...     print(m["val_acc"])
        0.625
    """
    state = _state.require_init("allreduce_metrics")
    if op not in (Average, Sum, Min, Max):
        raise ValueError(f"op={op!r}: allreduce_metrics supports Average, Sum, Min, Max")
    flat, recipe = _pack(values, state)
    allreduce_(flat, op=op, name=name or "allreduce_metrics." + ",".join(k for k, _ in recipe))
    out: dict[str, Any] = {}
    offset = 0
    for k, spec in recipe:
        if spec is None:
            out[k] = float(flat[offset])
            offset += 1
            continue
        shape, dtype, device = spec
        n = math.prod(shape)
        out[k] = flat[offset : offset + n].view(shape).to(dtype=dtype, device=device)
        offset += n
    return out if isinstance(values, Mapping) else out[""]


class Metric:
    """A running average of a metric over every sample seen on every rank.

    ``update`` is local (no communication); ``avg`` / ``compute()`` is one allreduce of
    (sum, count) and must be called on every rank. Weighting by count keeps the result exact
    when ranks see different numbers of samples (the last, shorter validation shard).

    Args:
        name: the metric's name (for errors and the timeline).

    Example:
        >>> val_loss = hvd.Metric("val_loss")
        >>> for x, y in val_loader:
        ...     val_loss.update(F.cross_entropy(model(x), y), n=len(y))
        >>> avg = val_loss.avg          # the same on every rank
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.sum = 0.0
        self.count = 0.0

    def update(self, value: Numeric, n: int | float = 1) -> None:
        """Add ``value``, the mean over ``n`` samples of this rank.

        Args:
            value: a number or a one-element tensor.
            n: how many samples ``value`` averages.
        """
        if isinstance(value, torch.Tensor):
            value = float(value.detach().float().mean())
        v = float(value)
        self.sum += v * n
        self.count += n

    def compute(self) -> float:
        """Return the average over all ranks' samples (a collective: call it on every rank).

        Returns:
            sum of values times counts over all ranks divided by the total count (nan if none).
        """
        total = allreduce_metrics({"sum": self.sum, "count": self.count}, op=Sum, name=self.name)
        return total["sum"] / total["count"] if total["count"] else float("nan")

    @property
    def avg(self) -> float:
        """The average over all ranks (see :meth:`compute`)."""
        return self.compute()

    def reset(self) -> None:
        """Forget every update (e.g. at the start of an epoch)."""
        self.sum = 0.0
        self.count = 0.0
