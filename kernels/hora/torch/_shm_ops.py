"""The shared-memory ring's data operations: allreduce, broadcast, allgather (data plane).

Each function runs inside :meth:`hora.torch._shm.Ring.run` (which holds SIGINT and turns a
failure midway into an abort the members see) and moves data with whole-slice torch ops on
the segment's tensors; the only Python loop is over chunks of a slot's size (4 MiB for two
ranks).

**Allreduce**, ``n`` members, a tensor of ``S`` bytes cut into chunks of a slot: every member
copies the slices of chunk ``k`` that the others sum into its slot of a buffer (*A*: every
slice but its own), sums slice ``me`` of its own chunk and of every other member's slot into
its own slot (*R*: a reduce-scatter; its own slice is read where it is, never copied in; an
``average`` divides the summed slice there, still in the cache) and copies every member's
summed slice into its tensor (*O*: an allgather). With three buffers
used in turn, one barrier ends each step
``[O(k-2), R(k-1), A(k)]``: a chunk is summed one barrier after every member wrote it,
copied out one barrier after every member summed it, and its buffer is written again only
after every member copied it out. A tensor of ``T`` chunks passes ``T + 1`` barriers.

Passes over memory for one member (in units of ``S``): *A* reads and writes ``(n-1)/n``, *R*
reads 1 and writes ``1/n``, *O* reads 1 and writes 1; ``docs/dev/benchmarks.md`` turns that into the
bound the benchmark compares with. A tensor of at most ``SMALL_BYTES`` (64 KiB) passes one
barrier instead: every member copies it in, then reduces every member's slot, in member order,
into its own tensor (:func:`_allreduce_small`).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable
from typing import Protocol

import torch


class Ring(Protocol):
    """What these operations use of :class:`hora.torch._shm.Ring`."""

    index: int
    slot: int

    def next_buffer(self) -> list[torch.Tensor]:
        """The members' slots (uint8) of the buffer written before the next barrier."""

    def next_ints(self) -> list[memoryview]:
        """The same slots as int64 memoryviews."""

    def step(self, op: str, name: str, total: int, start: int, check: int) -> None:
        """Sign, pass the next barrier, check that every member signed the same."""


Reduce = Callable[[torch.Tensor, torch.Tensor], object]

REDUCERS: dict[str, Reduce] = {  # acc (op)= x, in place
    "sum": torch.Tensor.add_,
    "average": torch.Tensor.add_,  # then divided by the member count (:func:`divide`)
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "product": torch.Tensor.mul_,
}

INTO: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "sum": lambda a, b, out: torch.add(a, b, out=out),  # out = a (op) b
    "average": lambda a, b, out: torch.add(a, b, out=out),
    "min": lambda a, b, out: torch.minimum(a, b, out=out),
    "max": lambda a, b, out: torch.maximum(a, b, out=out),
    "product": lambda a, b, out: torch.mul(a, b, out=out),
}

# up to this many bytes an allreduce passes one barrier and every member reduces every slot
# (:func:`_allreduce_small`); at 64 KiB that reads 2 x 64 KiB a member for 2 members, less
# than the second barrier and the slices' extra ops cost
SMALL_BYTES = 64 * 1024

# dtypes the ring reduces with torch's own kernels, with gloo's results (integers wrap alike)
DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                    torch.int32, torch.int16, torch.int8, torch.uint8})


def divide(t: torch.Tensor, n: int) -> None:
    """Divide a sum by the member count in place, as Horovod's Average does (integers truncate).

    Example:
        >>> x = torch.tensor([7, -7]); divide(x, 2); x.tolist()
        [3, -3]
    """
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.div_(n, rounding_mode="trunc")


def checksum(what: str) -> int:
    """The 32-bit checksum of an operation's description that members sign at each barrier.

    Example:
        >>> checksum("negotiation tables") == checksum("negotiation tables")
        True
    """
    return zlib.crc32(what.encode())


_TABLES = checksum("negotiation tables")


def bounds(m: int, n: int, i: int) -> tuple[int, int]:
    """Slice ``i`` of ``n`` near-equal slices of ``m`` elements.

    Example:
        >>> [bounds(7, 3, i) for i in range(3)]
        [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(m, n)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


def reduce_slice(slots: list[torch.Tensor], me: int, reduce: str,
                 mine: torch.Tensor | None = None) -> None:
    """Reduce slice ``me`` of every member's ``slots`` into member ``me``'s, in place.

    With ``mine`` (this member's data, of a slot's length), slice ``me`` of ``mine`` stands for
    that of its own slot, which is then only written: the same operations in the same order.
    """
    lo, hi = bounds(slots[0].numel(), len(slots), me)
    if hi <= lo:
        return
    acc = slots[me][lo:hi]
    others = [s[lo:hi] for j, s in enumerate(slots) if j != me]
    if mine is not None:
        INTO[reduce](mine[lo:hi], others.pop(0), acc)
    fn = REDUCERS[reduce]
    for x in others:
        fn(acc, x)
    if reduce == "average":  # on the slice just summed, still in the cache
        divide(acc, len(slots))


def copy_others(slot: torch.Tensor, src: torch.Tensor, n: int, me: int) -> None:
    """Copy every slice of ``src`` but slice ``me`` into ``slot``: what the others sum."""
    m = src.numel()
    lo, hi = bounds(m, n, me)
    if lo > 0:
        slot[:lo].copy_(src[:lo])
    if hi < m:
        slot[hi:m].copy_(src[hi:m])


def gather_slices(slots: list[torch.Tensor], dst: torch.Tensor, skip: int = -1) -> None:
    """Copy slice ``j`` of member ``j``'s slot into ``dst`` for every member but ``skip``."""
    n = len(slots)
    for j, s in enumerate(slots):
        if j != skip:
            lo, hi = bounds(s.numel(), n, j)
            if hi > lo:
                dst[lo:hi].copy_(s[lo:hi])


def allreduce(ring: Ring, t: torch.Tensor, op: str, name: str, reduce: str, tag: str,
              source: torch.Tensor) -> None:
    """Reduce ``source`` over the ring's members into ``t`` (see the module docstring).

    ``t`` and ``source`` are contiguous CPU tensors of one size and dtype, possibly the same
    one; ``tag`` (with the dtype and the reduction) is what the members check they agree on.
    """
    flat, src = t.view(-1), source.view(-1)
    me, dtype = ring.index, t.dtype
    per = ring.slot // t.element_size()
    total = flat.numel()
    check = checksum(f"{tag}|{dtype}|{reduce}")
    if total * t.element_size() <= SMALL_BYTES:
        _allreduce_small(ring, flat, src, op, name, reduce, check)
        return
    chunks = [(s, min(per, total - s)) for s in range(0, total, per)]
    held: list[list[torch.Tensor]] = []  # the members' slots of each chunk written so far
    last = len(chunks)
    for k in range(last + 2):
        if k >= 2:  # O: every member summed chunk k-2 one barrier ago
            start, m = chunks[k - 2]
            gather_slices(held[k - 2], flat[start : start + m])
        if 1 <= k <= last:  # R: every member wrote chunk k-1 one barrier ago
            start, m = chunks[k - 1]
            reduce_slice(held[k - 1], me, reduce, src[start : start + m])
        if k < last:  # A
            start, m = chunks[k]
            slots = [s.view(dtype)[:m] for s in ring.next_buffer()]
            copy_others(slots[me], src[start : start + m], len(slots), me)
            held.append(slots)
        if k <= last:
            ring.step(op, name, total, chunks[k][0] if k < last else total, check)


def _allreduce_small(ring: Ring, flat: torch.Tensor, src: torch.Tensor, op: str, name: str,
                     reduce: str, check: int) -> None:
    """A tensor of at most SMALL_BYTES: one barrier, then every member reduces every slot.

    Each member copies its tensor into its slot; after the barrier each reduces all the
    slots, in member order, into its own tensor: the same bits on every member, from one
    barrier and two to four torch ops instead of two barriers and a slice's dozen. The
    buffer is read before the member reaches its next barrier, so it is free again two
    barriers later, as the chunked path needs.
    """
    total = flat.numel()
    slots = [s.view(flat.dtype)[:total] for s in ring.next_buffer()]
    slots[ring.index].copy_(src)
    ring.step(op, name, total, 0, check)
    flat.copy_(slots[0])
    fn = REDUCERS[reduce]
    for s in slots[1:]:
        fn(flat, s)
    if reduce == "average":
        divide(flat, len(slots))


def broadcast(ring: Ring, t: torch.Tensor, op: str, name: str) -> None:
    """Copy member 0's ``t`` into every member's, in place, one barrier per chunk."""
    flat = t.view(-1)
    per = ring.slot // t.element_size()
    total = flat.numel()
    root = ring.index == 0
    check = checksum(f"{name}|{t.dtype}|broadcast")
    src: torch.Tensor | None = None
    for start in range(0, total + per, per):
        if src is not None and not root:  # the previous chunk, written a barrier ago
            m = src.numel()
            flat[start - per : start - per + m].copy_(src)
        if start >= total:
            return
        m = min(per, total - start)
        src = ring.next_buffer()[0].view(t.dtype)[:m]
        if root:
            src.copy_(flat[start : start + m])
        ring.step(op, name, total, start, check)


def allgather_ints(ring: Ring, mine: list[int], op: str, name: str,
                   what: str = "") -> list[list[int]] | None:
    """Every member's list (in member order); None on every member when one is too long.

    ``what`` names the kind of exchange the members sign (default: a negotiation round's
    tables): members that reached different kinds raise TensorMismatchError instead of
    reading each other's lists as their own kind.
    """
    cap = ring.slot // 8 - 1
    slots = ring.next_ints()
    row, n = slots[ring.index], len(mine)
    row[0] = n
    if n <= cap:
        row[1 : 1 + n] = array("q", mine)
    ring.step(op, name, 0, 0, checksum(what) if what else _TABLES)
    lengths = [s[0] for s in slots]
    if max(lengths) > cap:
        return None
    return [s[1 : 1 + k].tolist() for s, k in zip(slots, lengths, strict=True)]
