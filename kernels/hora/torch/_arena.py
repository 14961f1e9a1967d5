"""The DistributedOptimizer's CPU buckets in shared memory, reduced in place (data plane).

Through the ring's slots (:mod:`hora.torch._shm_ops`) a bucket is copied in (all but the
slice this member sums), summed and copied out. When the members of a process set share a
ring, their fusion buckets can live in shared memory themselves: an *arena* is one file with
a region per member, every member maps all of them, and a member's bucket buffers (the ones
its gradients are packed into, and that ``param.grad`` points at after ``synchronize()``)
are views of its own region. The reduction then works on the buckets where they are:

1. barrier: every member has packed every bucket;
2. each member sums its slice of every bucket, over every member's region, into its own
   region (a reduce-scatter, in place);
3. barrier; each member copies every other member's summed slice into its own region (an
   allgather, in place);
4. barrier: no member reads another's region any more, so each may write its own again
   (``clip_grad_norm_`` after ``synchronize()``, the next step's packing).

Three barriers per step whatever the number of buckets, no copy into or out of the ring,
every member ends with the same bits (each slice is summed by one member). The arena is set
up through the ring after the first ``synchronize()`` that reduced a CPU bucket through it
(every member is then at the same point), sized for the optimizer's buckets; when any member
cannot map it (``/dev/shm`` full), every member keeps the ring's chunked path, through
:class:`Work`: a bucket's reduction through the ring, run when waited for, in bucket order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from hora.torch import _shm, _shm_ops

log = logging.getLogger(__name__)

ALIGN = 64  # every bucket starts on its own cache line
_MAGIC = 0x686F7261_6172656E  # "horaaren"
_PATH_MAX = 4096
_REDUCE = _shm_ops.checksum("DistributedOptimizer arena")
_SETUP = _shm_ops.checksum("DistributedOptimizer arena set-up")


def layout(sizes: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offsets of buffers of ``(dtype, numel)`` in a region, and the region's size.

    Buffers of one dtype are laid out next to each other, so that one reduction covers each
    dtype's run (see :func:`runs`).

    Example:
        >>> layout([(torch.float32, 3), (torch.float16, 5), (torch.float32, 16)])
        ([64, 0, 128], 192)
    """
    order = sorted(range(len(sizes)), key=lambda i: (str(sizes[i][0]), i))
    offsets, at = [0] * len(sizes), 0
    for i in order:
        dtype, numel = sizes[i]
        offsets[i] = at
        at += -(-numel * dtype.itemsize // ALIGN) * ALIGN
    return offsets, at


class Arena:
    """The members' regions of one optimizer's arena, mapped on this rank.

    Args:
        ring: the process set's ring (its barriers order the reduction).
        mm: the mapped file (``ring.size`` regions of ``region`` bytes, after one page).
        region: bytes per member.
        sizes: ``(dtype, numel)`` of each buffer, in bucket order.
    """

    def __init__(self, ring: _shm.Ring, mm: mmap.mmap, region: int,
                 sizes: list[tuple[torch.dtype, int]]) -> None:
        self.ring, self.mm = ring, mm
        n, me = ring.size, ring.index
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=_shm.ALIGN, count=n * region)
        regions = [data[j * region : (j + 1) * region] for j in range(n)]
        offsets, _ = layout(sizes)
        # per buffer, every member's view of it (member j's region)
        self.views = [[r[off : off + numel * dtype.itemsize].view(dtype) for r in regions]
                      for (dtype, numel), off in zip(sizes, offsets, strict=True)]
        self.mine = [v[me] for v in self.views]
        self.runs = runs(regions, sizes, offsets)
        self.total = sum(numel for _, numel in sizes)
        self.passes = 0
        self.current = Pass(self)

    def next_step(self) -> None:
        """Start a new step: its buckets wait on one new reduction."""
        self.current = Pass(self)

    def reduce(self, op: str, name: str) -> None:
        """Sum every member's buffers into every member's, in place (the module docstring)."""
        self.ring.run(op, name, self._reduce, op, name)
        self.passes += 1

    def _reduce(self, op: str, name: str) -> None:
        ring, me, total = self.ring, self.ring.index, self.total
        ring.step(op, name, total, 0, _REDUCE)
        for slots in self.runs:
            _shm_ops.reduce_slice(slots, me, "sum")
        ring.step(op, name, total, 1, _REDUCE)
        for slots in self.runs:
            _shm_ops.gather_slices(slots, slots[me], skip=me)
        ring.step(op, name, total, 2, _REDUCE)

    def close(self) -> None:
        """Drop this rank's views; the mapping goes when the last gradient view does."""
        self.views, self.mine, self.runs = [], [], []
        with contextlib.suppress(BufferError):
            self.mm.close()


def runs(regions: list[torch.Tensor], sizes: list[tuple[torch.dtype, int]],
         offsets: list[int]) -> list[list[torch.Tensor]]:
    """Per dtype, every member's view of that dtype's contiguous run of buffers."""
    spans: dict[torch.dtype, tuple[int, int]] = {}
    for (dtype, numel), off in zip(sizes, offsets, strict=True):
        lo, hi = spans.get(dtype, (off, off))
        spans[dtype] = (min(lo, off), max(hi, off + numel * dtype.itemsize))
    out = []
    for dtype, (lo, hi) in spans.items():
        hi -= (hi - lo) % dtype.itemsize
        out.append([r[lo:hi].view(dtype) for r in regions])
    return out


class Deferred:
    """A torch Work whose reduction runs once, in the thread that first waits for it.

    Waiting in bucket order on every rank keeps the members in step; the optimizer's
    ``synchronize()`` does that. ``get_future()`` completes when the reduction has run.
    """

    def __init__(self, run: Callable[[], object]) -> None:
        self.run = run
        self.done = False
        self.future: Any = torch.futures.Future()

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.done = True
            self.run()
            self.future.set_result(None)
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> Any:
        return self.future


class Pass(Deferred):
    """A Work for every bucket of one step: waiting for any runs the arena's reduction once."""

    def __init__(self, arena: Arena) -> None:
        super().__init__(functools.partial(arena.reduce, "allreduce", "DistributedOptimizer.arena"))
        self.arena = arena


class Work(Deferred):
    """A bucket reduced through the ring, not in the arena: it runs when waited for, in order."""

    def __init__(self, ring: _shm.Ring, tensor: torch.Tensor, op: str, name: str) -> None:
        super().__init__(functools.partial(ring.allreduce_, tensor, op, name))


def build(ring: _shm.Ring, sizes: list[tuple[torch.dtype, int]], op: str) -> Arena | None:
    """Set up an arena for buffers of ``sizes`` through ``ring``, with every member.

    Every member must call it at the same point. Returns None on every member alike when
    any member cannot create or map it; raises like any ring operation.
    """
    _, region = layout(sizes)
    if region == 0:
        return None
    size = _shm.ALIGN + ring.size * region
    mm = ring.run(op, "arena", _share, ring, size, op)
    return Arena(ring, mm, region, sizes) if mm is not None else None


def _share(ring: _shm.Ring, size: int, op: str) -> mmap.mmap | None:
    """Member 0 creates the file and publishes its path; every member maps it; all agree."""
    path = _shm.create(size, _MAGIC) if ring.index == 0 else ""
    slots = ring.next_buffer()
    raw = path.encode()
    if ring.index == 0:
        slots[0][:8].view(torch.int64)[0] = len(raw)
        slots[0][8 : 8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ring.step(op, "arena", size, 0, _SETUP)
    n_raw = int(slots[0][:8].view(torch.int64)[0])
    path = bytes(slots[0][8 : 8 + min(n_raw, _PATH_MAX)].tolist()).decode()
    mm = _shm.open_segment(path, size, _MAGIC) if path else None
    flags = ring.next_buffer()
    flags[ring.index][:8].view(torch.int64)[0] = 1 if mm is not None else 0
    ring.step(op, "arena", size, 1, _SETUP)
    ok = all(int(f[:8].view(torch.int64)[0]) == 1 for f in flags)
    if ring.index == 0 and path:
        with contextlib.suppress(OSError):
            os.unlink(path)  # every member has mapped it (or given up): nothing stays behind
    if not ok:
        if mm is not None:
            mm.close()
        log.debug("%s: some member cannot map the arena; buckets go through the ring", op)
        return None
    return mm

