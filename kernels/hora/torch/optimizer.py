"""DistributedOptimizer: Horovod's gradient-averaging optimizer wrapper (data plane).

:func:`DistributedOptimizer` checks its arguments like Horovod, builds one frozen
:class:`~hora.torch._reducer.ReducerConfig` and wraps the user's optimizer in a dynamic
subclass whose ``step()`` synchronizes first. The gradient hooks, fusion buckets and their
reduction are the :class:`~hora.torch._reducer.Reducer`'s (:mod:`hora.torch._reducer`).
The fusion threshold comes from ``HORA_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from hora.errors import HoraError
from hora.torch import _state
from hora.torch._kinds import Adasum, Average, Sum
from hora.torch._process_sets import comm_of, global_process_set
from hora.torch._reducer import GradientCountError, Reducer, ReducerConfig
from hora.torch.compression import Compression

__all__ = ["DistributedOptimizer", "GradientCountError", "fusion_threshold_bytes"]

# 25 MiB (DDP's bucket size) measured faster than Horovod's 64 MiB here: more buckets overlap
# more of backward (bench/RESULTS.md, section 2: the hora and hora_64MB rows).
DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024


def fusion_threshold_bytes(environ: dict[str, str] | None = None) -> int:
    """Return the fusion threshold: ``HORA_FUSION_THRESHOLD``, else ``HOROVOD_FUSION_THRESHOLD``.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        Bytes per fusion bucket; 0 means one bucket per gradient. Default 25 MiB (DDP's
        bucket size; Horovod's is 64 MiB).

    Raises:
        ValueError: the variable is not a non-negative integer.

    Example:
        >>> fusion_threshold_bytes({"HORA_FUSION_THRESHOLD": "0"})
        0
    """
    env = os.environ if environ is None else environ
    for key in ("HORA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"):
        raw = env.get(key)
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not an integer number of bytes") from None
            if value < 0:
                raise ValueError(f"{key}={raw!r} must be >= 0")
            return value
    return DEFAULT_FUSION_THRESHOLD

def _named(
    optimizer: torch.optim.Optimizer, named_parameters: Any
) -> list[tuple[str, torch.Tensor]]:
    """Return (name, param) for every optimizer parameter; check names like Horovod does."""
    groups = optimizer.param_groups
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(groups)
                for j, p in enumerate(g["params"])]
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)) for x in pairs):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    counts: dict[str, int] = {}
    for n, _ in pairs:
        counts[n] = counts.get(n, 0) + 1
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError(f"named_parameters must have unique names; duplicates: {', '.join(dups)}")
    names = {id(p): n for n, p in pairs}
    missing = [f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
               for i, g in enumerate(groups) for j, p in enumerate(g["params"])
               if id(p) not in names]
    if missing:
        raise ValueError("named_parameters was given but does not name these optimizer "
                         f"parameters: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return [(names[id(p)], p) for g in groups for p in g["params"]]


def _threshold(value: int | None) -> int:
    if value is None:
        return fusion_threshold_bytes()
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"fusion_threshold={value!r} must be an int >= 0 (bytes)")
    return value


def _check_op(op: int, predivide: float) -> None:
    if op == Adasum:
        from hora.errors import UnsupportedError

        raise UnsupportedError("op=Adasum is not supported by hora.torch; use Average or Sum")
    if op not in (Average, Sum):
        raise ValueError(f"op={op!r}: DistributedOptimizer reduces gradients with Average or Sum")
    if predivide != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor={predivide!r} must be > 0")

class _DistributedOptimizer:
    """Mixin placed before the user's optimizer class in a dynamic subclass."""

    _hora: Reducer | None
    _hora_cfg: ReducerConfig
    _hora_sync: bool
    _hora_synced: bool

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; gradients then hold the averaged values.

        Call it before modifying gradients (e.g. clipping), then call ``step()`` inside
        ``with optimizer.skip_synchronize():``.

        Example:
            >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            >>> loss.backward()
            >>> opt.synchronize()
            >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with opt.skip_synchronize():
            ...     opt.step()
        """
        if self._hora is not None:
            self._hora.synchronize()
        self._hora_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip its implicit ``synchronize()`` (you called it already).

        Yields:
            Nothing; ``step()`` inside the block does not synchronize.
        """
        self._hora_sync = False
        try:
            yield
        finally:
            self._hora_sync = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize gradients (unless inside ``skip_synchronize()``), then step."""
        if self._hora_sync:
            if self._hora_synced:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): gradients are reduced "
                              "twice; call step() inside `with optimizer.skip_synchronize():`",
                              stacklevel=2)
            self.synchronize()
        self._hora_synced = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refuses while gradients are being reduced (as Horovod does).

        Raises:
            HoraError: called after ``backward()`` but before ``step()``/``synchronize()``.
        """
        if self._hora is not None and self._hora.busy():
            raise HoraError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); call step() or synchronize() "
                "first (or zero the gradients before backward())")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before gradients are reduced."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step={passes!r} must be an int >= 1")
        self._hora_cfg = dataclasses.replace(self._hora_cfg, backward_passes_per_step=passes)
        if self._hora is not None:
            if self._hora.busy():
                raise HoraError("set_backward_passes_per_step() during a step; call step() first")
            self._hora.passes = passes
            self._hora._reset()

    @property
    def backward_passes_per_step(self) -> int:
        """How many backward passes are accumulated per ``step()``."""
        return self._hora_cfg.backward_passes_per_step

    def __reduce__(self) -> tuple[Any, ...]:
        base = type(self).__mro__[2]
        names = [n for n, _ in self._hora_named()]
        cfg = self._hora_cfg.factory_kwargs()
        return (_rebuild, (base, base.__getstate__(self), names, cfg))  # type: ignore[call-arg]

    def _hora_named(self) -> list[tuple[str, torch.Tensor]]:
        names = self._hora_cfg.names
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        return list(zip(names, params, strict=True))


# torch's Optimizer.__setstate__ (run by load_state_dict) wraps ``type(self).step`` with its
# step-hook runner unless it is marked; the base class's step is wrapped already, so marking
# ours keeps user step hooks from running twice.
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]


# Every DistributedOptimizer made in this process, so an elastic reset can rebind them
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def rebind_all() -> None:
    """Rebuild every DistributedOptimizer's reducer for the world ``init()`` just made.

    An elastic reset (:mod:`hora.torch.elastic`) replaces the world, maybe with another size:
    the reducers' groups, shared-memory segment and averaging factor belong to the old one.
    Gradient hooks move to the new reducer; the wrapped optimizer's state is untouched.
    """
    for opt in list(_LIVE):
        if opt._hora is not None:
            opt._hora.close()
        cfg = opt._hora_cfg
        member = cfg.process_set is None or cfg.process_set.included()
        comm = comm_of(cfg.process_set if member else None, "DistributedOptimizer")
        opt._hora = Reducer(opt._hora_named(), cfg) if member and comm.size > 1 else None


def local_step(optimizer: torch.optim.Optimizer) -> Any:
    """Step an optimizer on this rank's gradients as they are, with no reduction.

    For a DistributedOptimizer this is the wrapped class's ``step()`` (whose own ``step()``
    would reduce gradients, a collective); any other optimizer just steps.

    Args:
        optimizer: a torch optimizer or a DistributedOptimizer.

    Returns:
        What the optimizer's ``step()`` returned.

    Example:
        >>> local_step(opt)  # e.g. to create the state of an optimizer that never stepped
    """
    if isinstance(optimizer, _DistributedOptimizer):
        return super(_DistributedOptimizer, optimizer).step()  # type: ignore[misc]
    return optimizer.step()


def _rebuild(base: Any, state: dict[str, Any], names: list[str], cfg: dict[str, Any]) -> Any:
    """Unpickle a DistributedOptimizer: rebuild the inner optimizer, then wrap it again."""
    inner = base.__new__(base)
    inner.__setstate__(state)
    params = [p for g in inner.param_groups for p in g["params"]]
    cfg = {k: v for k, v in cfg.items() if k != "names"}
    named = list(zip(names, params, strict=True))
    return DistributedOptimizer(inner, named_parameters=named, **cfg)


def DistributedOptimizer(  # noqa: N802  (Horovod's name: a factory that looks like a class)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Sequence[Sequence[torch.Tensor]] | int | None = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
    *,
    fusion_threshold: int | None = None,
) -> Any:
    """Wrap an optimizer so that ``step()`` applies gradients averaged over all ranks.

    The returned object is an instance of a subclass of ``type(optimizer)`` sharing its state
    (use it instead of the original). Gradient allreduces start during ``backward()``, fused
    into buckets of ``HORA_FUSION_THRESHOLD`` (or ``HOROVOD_FUSION_THRESHOLD``) bytes, default
    25 MiB (a gradient of 4 MiB or more is reduced alone, in place); ``step()`` waits for them.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names for errors and the timeline.
            Every optimizer parameter must be named, names must be unique.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``, applied to
            each fusion bucket on the wire.
        backward_passes_per_step: backward passes accumulated locally before reducing.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: if > 0, split the gradients into this many buckets instead of by size.
        groups: explicit buckets: a list of lists of parameters (an int means num_groups).
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            ones, then turn the result back into a sparse tensor. Without it (the default)
            each sparse gradient is reduced Horovod's way, by allgathering every rank's
            indices and values, after the dense buckets.
        process_set: the process set whose ranks average their gradients (default: every
            rank); on a rank outside it the optimizer steps with its local gradients.
        fusion_threshold: bytes per fusion bucket (hora extension; 0 = one bucket per
            gradient). Default: the environment variables above, else 25 MiB.

    Returns:
        The distributed optimizer.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        ValueError: bad names, op, factor or pass count.
        UnsupportedError: Adasum or a process set other than the global one.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    # the arguments are checked before init, as Horovod does (duplicate names raise ValueError)
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer; wrap the original once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
    _check_op(op, float(gradient_predivide_factor))
    if isinstance(groups, int):
        num_groups, groups = groups, None
    named = _named(optimizer, named_parameters)
    _state.require_init("DistributedOptimizer")
    # as in Horovod, a rank outside the process set steps its optimizer locally
    member = process_set is None or process_set.included()
    comm = comm_of(process_set if member else None, "DistributedOptimizer")
    cfg = ReducerConfig(
        process_set=process_set,
        compression=compression if compression is not None else Compression.none,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=float(gradient_predivide_factor), num_groups=num_groups,
        sparse_as_dense=sparse_as_dense, names=tuple(n for n, _ in named),
        groups=tuple(tuple(g) for g in groups) if groups else None,
        fusion_threshold=_threshold(fusion_threshold),
    )
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    obj: Any = object.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    obj._hora_cfg = cfg
    obj._parameter_names = {p: n for n, p in named}  # Horovod's name for each parameter
    obj._hora_sync, obj._hora_synced = True, False
    obj._hora = Reducer(named, cfg) if member and comm.size > 1 else None
    _LIVE.add(obj)
    return obj
