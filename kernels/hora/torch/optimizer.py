"""DistributedOptimizer: Horovod's gradient-averaging optimizer wrapper (data plane).

Each parameter gets a post-accumulate-grad hook. When a gradient is final for this step, the
hook copies it (scaled by the pre-division factor) into its slot of a flat *fusion bucket*;
when every gradient of a bucket has arrived, the bucket's allreduce starts asynchronously on
the default process group, so communication overlaps the rest of backward. Buckets are built
in reverse registration order (the order backward produces gradients, like DDP) up to the
fusion threshold (``HORA_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD`` bytes) and are always
launched in bucket order, so every rank issues the same collectives in the same order even
when some parameters got no gradient on some ranks. A gradient of ``SOLO_BYTES`` or more gets a
bucket of its own and is scaled and reduced in place, in its own ``.grad``: no copy into a
fusion buffer and out again. With fp16/bf16 compression, gradients are cast straight into a
wire buffer kept across steps and cast straight back. ``synchronize()`` (called by ``step()``)
fills the slots whose hooks did not fire (with the existing gradient, or zeros), launches what
is left, waits, and points each ``param.grad`` at its slot of the reduced bucket (no copy back).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import HoraError
from hora.torch import _shm, _state, timeline
from hora.torch._engine import launch_planned
from hora.torch._grouped import sparse_allreduce_async
from hora.torch._handles import hold_works
from hora.torch._ops import Adasum, Average, Sum
from hora.torch._process_sets import comm_of, global_process_set
from hora.torch._stall import wait_work
from hora.torch.compression import Compression, cast_dtype

__all__ = ["DistributedOptimizer", "GradientCountError", "fusion_threshold_bytes"]

# 25 MiB (DDP's bucket size) measured faster than Horovod's 64 MiB here: more buckets overlap
# more of backward (bench/RESULTS.md, section 2: the hora and hora_64MB rows).
DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024
# Like DDP's first bucket: a small one closes early so communication starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024
# A gradient this large is reduced alone and in place (its own .grad, no fusion buffer), as soon
# as it is ready: fusing it saves no latency worth a copy in and out (bench/RESULTS.md, 2).
SOLO_BYTES = 4 * 1024 * 1024


class GradientCountError(HoraError):
    """A gradient was produced more often than ``backward_passes_per_step`` before ``step()``."""


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


class _Bucket:
    """Gradients of one dtype and device reduced by one collective.

    A fused bucket owns a flat buffer; each gradient is copied (scaled) into its slot and
    ``param.grad`` then points at that slot. A *solo* bucket holds one large gradient and
    reduces ``param.grad`` itself, in place: no fusion buffer, no copy in or out.
    """

    __slots__ = ("flat", "gathered", "index", "nbytes", "names", "params", "pending", "sparse",
                 "t_done",
                 "t_launch", "t_ready", "views", "wire", "wire_views", "ctx", "work", "left",
                 "solo", "cast")

    def __init__(self, index: int, params: list[torch.Tensor], names: list[str], solo: bool,
                 cast: torch.dtype | None) -> None:
        self.index, self.params, self.names, self.solo = index, params, names, solo
        total = sum(p.numel() for p in params)
        self.nbytes = total * params[0].element_size()
        dtype = params[0].dtype
        # compression by a cast: the wire buffer is kept across steps, gradients are cast
        # straight into it (one pass) and cast straight back after the reduction
        self.cast = cast if cast is not None and _narrows(dtype, cast) else None
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.wire_views: list[torch.Tensor] = []
        self.wire: torch.Tensor | None = None
        if not solo:
            self.flat = torch.zeros(total, dtype=dtype, device=params[0].device)
            self.views = _views(self.flat, params)
        if self.cast is not None:
            self.wire = torch.zeros(total, dtype=self.cast, device=params[0].device)
            self.wire_views = _views(self.wire, params)
        self.pending = len(params)
        self.left = [0] * len(params)
        self.sparse: list[int] = []  # sparse gradients reduced densely (sparse_as_dense)
        self.gathered: dict[int, torch.Tensor] = {}  # sparse gradients reduced by allgather
        self.work: Any = None
        self.ctx: Any = None
        self.t_ready: list[tuple[int, int]] = [(0, 0)] * len(params)
        self.t_launch = 0
        self.t_done = 0


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def _narrows(dtype: torch.dtype, wire: torch.dtype) -> bool:
    """Whether a cast compressor with this wire dtype casts tensors of ``dtype``."""
    return bool(dtype.is_floating_point and dtype != wire
                and torch.finfo(dtype).bits > torch.finfo(wire).bits)


def _plan(params: list[torch.Tensor], threshold: int, num_groups: int) -> list[list[int]]:
    """Split parameter indices into buckets, in reverse order, by dtype/device and size.

    A gradient of ``SOLO_BYTES`` or more (or of the threshold, if that is smaller) gets a
    bucket of its own, launched as soon as it is ready: the bucket still open for its kind
    closes first, so nothing queued before it waits for gradients that come later.
    """
    order = list(range(len(params)))[::-1]
    if num_groups > 0:
        per = -(-len(order) // num_groups)
        chunks = [order[i : i + per] for i in range(0, len(order), per)]
        return [c for chunk in chunks for c in _split_by_kind(params, chunk)]
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        if _solo(p, threshold):
            open_[key] = ([], 0)
            buckets.append([i])
            continue
        members, size = open_.get(key, ([], 0))
        if not members:
            buckets.append(members)
        members.append(i)
        size += p.numel() * p.element_size()
        limit = min(threshold, FIRST_BUCKET_BYTES) if len(buckets) == 1 else threshold
        open_[key] = ([], 0) if size >= limit else (members, size)
    return buckets


def _solo(p: torch.Tensor, threshold: int) -> bool:
    return p.numel() * p.element_size() >= min(threshold, SOLO_BYTES)


def _split_by_kind(params: list[torch.Tensor], idx: list[int]) -> list[list[int]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in idx:
        kinds.setdefault((params[i].dtype, params[i].device), []).append(i)
    return list(kinds.values())


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


class _Reducer:
    """Hooks, buckets and their in-order launching for one DistributedOptimizer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: dict[str, Any]) -> None:
        self.state = _state.require_init("DistributedOptimizer")
        self.process_set = cfg["process_set"]
        self.comm = comm_of(self.process_set, "DistributedOptimizer")
        self.compression = cfg["compression"]
        self.passes = int(cfg["backward_passes_per_step"])
        self.sparse_as_dense = bool(cfg["sparse_as_dense"])
        op, f, n = cfg["op"], float(cfg["gradient_predivide_factor"]), self.comm.size
        self.pre = (1.0 / f if f != 1.0 else 1.0 / n) if op == Average else 1.0
        self.post = (f / n if f != 1.0 else 1.0) if op == Average else 1.0
        live = [(name, p) for name, p in named if p.requires_grad]
        params = [p for _, p in live]
        plan = self._plan(params, cfg)
        cast = cast_dtype(self.compression)
        self.buckets = [
            _Bucket(b, [params[i] for i in idx], [live[i][0] for i in idx],
                    len(idx) == 1 and _solo(params[idx[0]], cfg["fusion_threshold"]), cast)
            for b, idx in enumerate(plan)]
        self.next = 0
        self.dirty = False
        self.tl = timeline.enabled()
        self._reset()
        # one bound hook per gradient: the hot path looks nothing up
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self.on_grad, b, k))
                        for b in self.buckets for k, p in enumerate(b.params)]
        hold_works(self)

    def release_works(self) -> None:
        """Drop the allreduces in flight (at ``shutdown()``: they hold the rendezvous port)."""
        for b in self.buckets:
            b.work = None

    def _plan(self, params: list[torch.Tensor], cfg: dict[str, Any]) -> list[list[int]]:
        groups = cfg.get("groups")
        if not groups:
            return _plan(params, cfg["fusion_threshold"], int(cfg["num_groups"]))
        index = {p: i for i, p in enumerate(params)}
        fixed = [[index[p] for p in g if p in index] for g in groups]
        taken = {i for g in fixed for i in g}
        rest = [i for i in range(len(params)) if i not in taken]
        rest_plan = _plan([params[i] for i in rest], cfg["fusion_threshold"], 0)
        out = [c for g in fixed for c in _split_by_kind(params, g)]
        return [b for b in out + [[rest[i] for i in b] for b in rest_plan] if b]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- hot path ---------------------------------------------------------------------------
    def on_grad(self, b: _Bucket, k: int, p: torch.Tensor) -> None:
        left = b.left[k] - 1
        b.left[k] = left
        if left > 0:
            return
        if left < 0:
            raise GradientCountError(
                "gradients were computed more than backward_passes_per_step="
                f"{self.passes} times before step() or synchronize(); increase "
                "backward_passes_per_step to accumulate gradients locally")
        self._copy_in(b, k, p)
        b.pending -= 1
        if b.pending == 0 and b.index == self.next:
            self._launch_ready()

    def _copy_in(self, b: _Bucket, k: int, p: torch.Tensor) -> None:
        self.dirty = True
        if not self.tl:
            self._copy(b, k, p)
            return
        t0 = timeline.now_ns()
        self._copy(b, k, p)
        b.t_ready[k] = (t0, timeline.now_ns())

    def _copy(self, b: _Bucket, k: int, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and g.is_sparse:
            if not self.sparse_as_dense:  # reduced in synchronize(), by allgather
                b.gathered[k] = g
                if b.solo:
                    return
                g = None
            else:
                b.sparse.append(k)
                g = g.to_dense()
        if b.solo:
            b.flat = g = self._solo_target(p, g, b.cast is None)
            if b.cast is None:
                if self.pre != 1.0:
                    g.mul_(self.pre)
                return
        dst = b.wire_views[k] if b.cast is not None else b.views[k]
        if g is None:
            dst.zero_()
        elif self.pre != 1.0:
            torch.mul(g, self.pre, out=dst)
        elif g.data_ptr() != dst.data_ptr():
            dst.copy_(g)

    @staticmethod
    def _solo_target(p: torch.Tensor, g: torch.Tensor | None, dense: bool) -> torch.Tensor:
        """The tensor a solo bucket reduces in place: the gradient itself where it can be."""
        if g is None:
            return torch.zeros_like(p, memory_format=torch.contiguous_format)
        if dense and not g.is_contiguous():
            return g.contiguous()
        return g

    def _launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.buckets[self.next].pending == 0:
            self._launch(self.buckets[self.next])
            self.next += 1

    def _launch(self, b: _Bucket) -> None:
        if b.solo and b.gathered:
            return  # its one gradient is sparse: nothing dense to reduce
        if b.cast is None:
            b.wire, b.ctx = self.compression.compress(b.flat)
        ring = self._ring(b.wire)
        if ring is not None:  # same host, CPU: through shared memory, run in bucket order
            label = f"DistributedOptimizer.bucket{b.index}:{b.names[0]}"
            b.work = launch_planned("allreduce", b.names[0], _shm.Work, ring, b.wire,
                                    "allreduce", label)
        else:
            b.work = launch_planned("allreduce", b.names[0], dist.all_reduce, b.wire,
                                    group=self.comm.group, async_op=True)
        if self.tl:
            b.t_launch = timeline.now_ns()
            b.work.get_future().add_done_callback(
                lambda _f, b=b: setattr(b, "t_done", timeline.now_ns()))

    def _ring(self, wire: torch.Tensor | None) -> Any:
        """The process set's shared-memory segment for a CPU bucket (None: use the group)."""
        if wire is None or wire.device.type != "cpu" or self.comm.size < 2:
            return None
        if self.comm.side is None and self.comm.shm is None:
            # the group was rebuilt (notebook engines after a failure): every member's
            # optimizer picks up the new set here, at the same bucket
            with contextlib.suppress(ValueError):
                self.comm = comm_of(self.process_set, "DistributedOptimizer")
        return _shm.ring_of(self.comm, "DistributedOptimizer")

    # -- synchronize ------------------------------------------------------------------------
    def synchronize(self) -> None:
        for b in self.buckets[self.next :]:
            if b.pending:
                for k, p in enumerate(b.params):
                    if b.left[k] > 0:
                        self._copy_in(b, k, p)
                b.pending = 0
        self._launch_ready()
        try:
            sparse = self._launch_sparse()
            for b in self.buckets:
                self._finish(b)
            for p, wait in sparse:
                p.grad = wait()
        finally:
            self._reset()

    def _launch_sparse(self) -> list[tuple[torch.Tensor, Any]]:
        """Start Horovod's sparse allreduce (an allgather) of each sparse gradient, in order.

        Every rank launches them after its dense buckets, in bucket order, so the collectives
        line up; the result keeps duplicate indices (sparse optimizers coalesce).
        """
        scale = self.pre * self.post  # Average: 1/size (with any predivide factor); Sum: 1
        started = []
        for b in self.buckets:
            for k, g in sorted(b.gathered.items()):
                g = g * scale if scale != 1.0 else g
                name = f"DistributedOptimizer.sparse:{b.names[k]}"
                wait = sparse_allreduce_async(g, name, op=Sum, process_set=self.process_set)
                started.append((b.params[k], wait))
        return started

    def _finish(self, b: _Bucket) -> None:
        if b.solo and b.gathered:
            return  # synchronize() sets its sparse gradient
        wait_work(b.work, "allreduce", f"DistributedOptimizer.bucket{b.index}:{b.names[0]}")
        if self.tl:
            self._record(b, b.t_done or timeline.now_ns())
        out = b.flat
        if out is None:  # a solo bucket gets its tensor in _copy, which synchronize() ensures
            raise HoraError(f"internal: bucket {b.index} ({b.names[0]}) was never filled")
        if b.cast is not None and b.wire is not None:
            wire = b.wire_views[0] if b.solo else b.wire
            torch.mul(wire, self.post, out=out) if self.post != 1.0 else out.copy_(wire)
        else:
            if b.wire is not out:
                out.copy_(self.compression.decompress(b.wire, b.ctx))
            if self.post != 1.0:
                out.mul_(self.post)
        views = [out] if b.solo else b.views
        for p, v in zip(b.params, views, strict=True):
            if p.grad is not v:
                p.grad = v
        for k in b.sparse:
            b.params[k].grad = views[k].to_sparse()

    def _record(self, b: _Bucket, t_end: int) -> None:
        args = {"bucket": b.index, "bucket_bytes": b.nbytes}
        for name, p, (t0, t1) in zip(b.names, b.params, b.t_ready, strict=True):
            nbytes = p.numel() * p.element_size()
            if t0:
                timeline.record(name, "MEMCPY_IN_FUSION_BUFFER", t0, t1, nbytes, args)
                timeline.record(name, "QUEUED", t1, b.t_launch, nbytes, args)
            timeline.record(name, "ALLREDUCE", b.t_launch, max(t_end, b.t_launch), nbytes, args)

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending = len(b.params)
            b.left = [self.passes] * len(b.params)
            b.work = b.ctx = None
            if b.cast is None:
                b.wire = None
            if b.solo:
                b.flat = None
            b.sparse.clear()
            b.gathered.clear()
            b.t_done = 0
        self.next = 0
        self.dirty = False
        self.tl = timeline.enabled()

    def busy(self) -> bool:
        return self.dirty or self.next > 0


class _DistributedOptimizer:
    """Mixin placed before the user's optimizer class in a dynamic subclass."""

    _hora: _Reducer | None
    _hora_cfg: dict[str, Any]
    _hora_sync: bool
    _hora_synced: bool

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; gradients then hold the averaged values.

        Call it before modifying gradients (e.g. clipping), then call ``step()`` inside
        ``with optimizer.skip_synchronize():``.

        Example:
            >>> loss.backward()
            >>> opt.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
        self._hora_cfg["backward_passes_per_step"] = passes
        if self._hora is not None:
            if self._hora.busy():
                raise HoraError("set_backward_passes_per_step() during a step; call step() first")
            self._hora.passes = passes
            self._hora._reset()

    @property
    def backward_passes_per_step(self) -> int:
        """How many backward passes are accumulated per ``step()``."""
        return int(self._hora_cfg["backward_passes_per_step"])

    def __reduce__(self) -> tuple[Any, ...]:
        base = type(self).__mro__[2]
        names = [n for n, _ in self._hora_named()]
        cfg = {k: v for k, v in self._hora_cfg.items() if k != "groups"}
        return (_rebuild, (base, base.__getstate__(self), names, cfg))  # type: ignore[call-arg]

    def _hora_named(self) -> list[tuple[str, torch.Tensor]]:
        names = self._hora_cfg["names"]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        return list(zip(names, params, strict=True))


# torch's Optimizer.__setstate__ (run by load_state_dict) wraps ``type(self).step`` with its
# step-hook runner unless it is marked; the base class's step is wrapped already, so marking
# ours keeps user step hooks from running twice.
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]


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
    cfg: dict[str, Any] = {
        "process_set": process_set,
        "compression": compression if compression is not None else Compression.none,
        "backward_passes_per_step": backward_passes_per_step, "op": op,
        "gradient_predivide_factor": float(gradient_predivide_factor), "num_groups": num_groups,
        "sparse_as_dense": sparse_as_dense, "names": [n for n, _ in named],
        "groups": [list(g) for g in groups] if groups else None,
        "fusion_threshold": _threshold(fusion_threshold),
    }
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    obj: Any = object.__new__(cls)
    obj.__dict__.update(optimizer.__dict__)
    obj._hora_cfg = cfg
    obj._parameter_names = {p: n for n, p in named}  # Horovod's name for each parameter
    obj._hora_sync, obj._hora_synced = True, False
    obj._hora = _Reducer(named, cfg) if member and comm.size > 1 else None
    return obj
