"""The gradient reducer behind DistributedOptimizer: fusion buckets and their reduction.

Each parameter gets a post-accumulate-grad hook. When a gradient is final for this step, the
hook copies it (scaled by the pre-division factor) into its slot of a flat *fusion bucket*;
when every gradient of a bucket has arrived, the bucket's allreduce starts asynchronously on
the process set's group, so communication overlaps the rest of backward. Buckets are built
in reverse registration order (the order backward produces gradients, like DDP) up to the
fusion threshold and are always launched in bucket order, so every rank issues the same
collectives in the same order even when some parameters got no gradient on some ranks. A
gradient of ``SOLO_BYTES`` or more gets a bucket of its own and is scaled and reduced in
place, in its own ``.grad``: no copy into a fusion buffer and out again. With fp16/bf16
compression, gradients are cast straight into a wire buffer kept across steps and cast
straight back. :meth:`Reducer.synchronize` fills the slots whose hooks did not fire (with
the existing gradient, or zeros), launches what is left, waits, and points each
``param.grad`` at its slot of the reduced bucket (no copy back).

CPU buckets of ranks on one host go through the process set's shared-memory ring
(:mod:`hora.torch._shm`), deferred to ``synchronize()`` and reduced there in bucket order.
After the first such ``synchronize()`` the buckets move into shared memory themselves (an
arena, :mod:`hora.torch._arena`) and are reduced where they are, all in one pass.

The reducer is configured by one frozen :class:`ReducerConfig`, built and checked by
:func:`hora.torch.optimizer.DistributedOptimizer`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import HoraError
from hora.torch import _arena, _hier, _shm, _state, timeline
from hora.torch._engine import launch_planned
from hora.torch._grouped import sparse_allreduce_async
from hora.torch._handles import hold_works
from hora.torch._kinds import Average, Sum
from hora.torch._process_sets import comm_of
from hora.torch._stall import wait_work
from hora.torch.compression import NoneCompressor, cast_dtype

# Like DDP's first bucket: a small one closes early so communication starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024
# A gradient this large is reduced alone and in place (its own .grad, no fusion buffer), as soon
# as it is ready: fusing it saves no latency worth a copy in and out (bench/RESULTS.md, 2).
SOLO_BYTES = 4 * 1024 * 1024


class GradientCountError(HoraError):
    """A gradient was produced more often than ``backward_passes_per_step`` before ``step()``."""


@dataclass(frozen=True, eq=False)
class ReducerConfig:
    """A DistributedOptimizer's configuration, checked once by its factory.

    Attributes:
        process_set: the process set whose ranks average their gradients.
        compression: the compressor applied to each fusion bucket on the wire.
        backward_passes_per_step: backward passes accumulated locally before reducing.
        op: ``Average`` or ``Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum.
        num_groups: if > 0, this many buckets instead of buckets by size.
        sparse_as_dense: reduce sparse gradients as dense ones.
        names: every optimizer parameter's name, in ``param_groups`` order.
        groups: explicit buckets of parameters (None: by size or ``num_groups``).
        fusion_threshold: bytes per fusion bucket (0: one bucket per gradient).
    """

    process_set: Any
    compression: Any
    backward_passes_per_step: int
    op: int
    gradient_predivide_factor: float
    num_groups: int
    sparse_as_dense: bool
    names: tuple[str, ...]
    groups: tuple[tuple[torch.Tensor, ...], ...] | None
    fusion_threshold: int

    def factory_kwargs(self) -> dict[str, Any]:
        """The fields as the factory's keyword arguments, ``groups`` left out (for pickling)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "groups"}
        out["names"] = list(self.names)
        return out


class _Bucket:
    """Gradients of one dtype and device reduced by one collective.

    A fused bucket owns a flat buffer; each gradient is copied (scaled) into its slot and
    ``param.grad`` then points at that slot. A *solo* bucket holds one large gradient and
    reduces ``param.grad`` itself, in place: no fusion buffer, no copy in or out.
    """

    __slots__ = ("flat", "gathered", "index", "nbytes", "names", "params", "pending", "sparse",
                 "t_done",
                 "t_launch", "t_ready", "views", "wire", "wire_views", "ctx", "work", "left",
                 "solo", "cast", "shared")

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
        self.shared = False  # its wire buffer lives in the optimizer's arena
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

class Reducer:
    """Hooks, buckets and their in-order launching for one DistributedOptimizer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: ReducerConfig) -> None:
        self.state = _state.require_init("DistributedOptimizer")
        self.process_set = cfg.process_set
        self.comm = comm_of(self.process_set, "DistributedOptimizer")
        self.compression = cfg.compression
        self.passes = cfg.backward_passes_per_step
        self.sparse_as_dense = cfg.sparse_as_dense
        op, f, n = cfg.op, cfg.gradient_predivide_factor, self.comm.size
        self.pre = (1.0 / f if f != 1.0 else 1.0 / n) if op == Average else 1.0
        self.post = (f / n if f != 1.0 else 1.0) if op == Average else 1.0
        live = [(name, p) for name, p in named if p.requires_grad]
        params = [p for _, p in live]
        plan = self._plan(params, cfg)
        cast = cast_dtype(self.compression)
        self.buckets = [
            _Bucket(b, [params[i] for i in idx], [live[i][0] for i in idx],
                    len(idx) == 1 and _solo(params[idx[0]], cfg.fusion_threshold), cast)
            for b, idx in enumerate(plan)]
        self.next = 0
        self.dirty = False
        self.tl = timeline.enabled()
        self.arena: _arena.Arena | None = None
        self.arena_tried = False
        self.used_ring: Any = None  # the ring a CPU bucket went through this step
        self._reset()
        # one bound hook per gradient: the hot path looks nothing up
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self.on_grad, b, k))
                        for b in self.buckets for k, p in enumerate(b.params)]
        hold_works(self)

    def release_works(self) -> None:
        """Drop the allreduces in flight (at ``shutdown()``: they hold the rendezvous port)."""
        for b in self.buckets:
            b.work = None

    def _plan(self, params: list[torch.Tensor], cfg: ReducerConfig) -> list[list[int]]:
        groups = cfg.groups
        if not groups:
            return _plan(params, cfg.fusion_threshold, cfg.num_groups)
        index = {p: i for i, p in enumerate(params)}
        fixed = [[index[p] for p in g if p in index] for g in groups]
        taken = {i for g in fixed for i in g}
        rest = [i for i in range(len(params)) if i not in taken]
        rest_plan = _plan([params[i] for i in rest], cfg.fusion_threshold, 0)
        out = [c for g in fixed for c in _split_by_kind(params, g)]
        return [b for b in out + [[rest[i] for i in b] for b in rest_plan] if b]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None

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
        if ring is not None and self.arena is not None and self.arena.ring is not ring:
            # the set was rebuilt: the buffers go through the new ring, then a new arena
            self.arena, self.arena_tried = None, False
            for other in self.buckets:
                other.shared = False
        if ring is not None and b.shared and self.arena is not None:
            b.work = launch_planned("allreduce", b.names[0], self._arena_pass)
        elif ring is not None:  # same host, CPU: through shared memory, run in bucket order
            self.used_ring = ring
            label = f"DistributedOptimizer.bucket{b.index}:{b.names[0]}"
            b.work = launch_planned("allreduce", b.names[0], _arena.Work, ring, b.wire,
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
        return _hier.ring_of(self.comm, "DistributedOptimizer")

    def _arena_pass(self) -> _arena.Pass:
        assert self.arena is not None  # noqa: S101  (only shared buckets call it)
        return self.arena.current

    def _share(self) -> None:
        """Move the CPU buckets into an arena, with every member (after a synchronize)."""
        ring, self.used_ring = self.used_ring, None
        if self.arena_tried or not isinstance(ring, _shm.Ring) or ring.broken or ring.closed:
            return
        self.arena_tried = True
        plain = getattr(self.compression, "compress", None) is NoneCompressor.compress
        fit = [b for b in self.buckets if b.params[0].device.type == "cpu" and not b.shared
               and (b.cast is not None or plain)]
        sizes = [(b.cast or b.params[0].dtype, sum(p.numel() for p in b.params)) for b in fit]
        arena = _arena.build(ring, sizes, "DistributedOptimizer") if fit else None
        if arena is None:
            return
        for b, buf in zip(fit, arena.mine, strict=True):
            b.shared = True
            if b.cast is not None:  # the wire buffer moves; the gradients are cast back
                b.wire, b.wire_views = buf, _views(buf, b.params)
            else:  # a solo gradient is now packed too: cheaper than a copy in and out
                b.solo, b.flat, b.views = False, buf, _views(buf, b.params)
        self.arena = arena

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
            if self.used_ring is not None:
                self._share()
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
        self.used_ring = None
        if self.arena is not None:
            self.arena.next_step()

    def busy(self) -> bool:
        return self.dirty or self.next > 0
