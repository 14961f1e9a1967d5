"""Async handles, collective signatures and the int16 carrier of the collectives (data plane).

A :class:`Handle` is what every ``*_async`` collective returns: the torch.distributed Works in
flight and a ``finish`` callback (average, postscale, copy back, decompress) that
``synchronize`` runs once. A *signature* (op, reduce op or root, dtype, shape as SIG_LEN
ints) is what the ranks compare before the data moves (:mod:`hora.torch._engine`).
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.errors import NotInitializedError
from hora.torch import _stall, _state, timeline

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
MAXDIM = 6
SIG_LEN = 4 + MAXDIM + 1
_PAD = (-1,) * MAXDIM


def signature(opcode: int, extra: int, dtype: torch.dtype, shape: Sequence[int]) -> tuple[int, ...]:
    """Encode (op, extra, dtype, shape) as SIG_LEN ints; long shapes go into a CRC slot."""
    ndim = len(shape)
    if ndim <= MAXDIM:
        return (opcode, extra, _DTYPE_CODE.get(dtype, 99), ndim, *shape, *_PAD[ndim:], 0)
    dims = list(shape)
    tail = zlib.crc32(repr(dims[MAXDIM:]).encode())
    return (opcode, extra, _DTYPE_CODE.get(dtype, 99), ndim, *dims[:MAXDIM], tail)


def describe(sig: Sequence[int]) -> str:
    """Render a signature for an error message: dtype and shape."""
    dtype = _DTYPES[sig[2]] if sig[2] < len(_DTYPES) else "other"
    ndim = sig[3]
    shape = tuple(sig[4 : 4 + min(ndim, MAXDIM)])
    dots = "..." if ndim > MAXDIM else ""
    return f"{str(dtype).replace('torch.', '')}{list(shape)}{dots}"


def key_dtype(key: Sequence[int]) -> torch.dtype:
    """Return the dtype a signature names."""
    return _DTYPES[key[2]]


def key_shape(key: Sequence[int]) -> list[int]:
    """Return the shape a signature names (up to six dimensions are kept exactly)."""
    ndim = key[3]
    if ndim > MAXDIM:
        raise ValueError(f"a {ndim}-d tensor's shape is not kept in its signature")
    return list(key[4 : 4 + ndim])


class Handle:
    """A collective in flight; pass it to ``synchronize()`` or ``poll()``.

    A handle starts *launched* when its collective moved at once, or not launched while the
    other members have not submitted its name yet; ``progress`` then runs negotiation rounds
    until it is (see :mod:`hora.torch._engine`). ``t0`` (when the op was called) and ``tq``
    (when every rank had submitted it) feed the timeline's QUEUED phase; both are 0 when no
    timeline is recording.
    """

    __slots__ = (
        "__weakref__", "done", "error", "finish", "launched", "name", "nbytes", "on_done", "op",
        "progress", "result", "t0", "tq", "works",
    )  # fmt: skip

    def __init__(
        self,
        op: str,
        name: str,
        works: list[Any],
        finish: Callable[[], Any],
        nbytes: int = 0,
        t0: int = 0,
        tq: int = 0,
    ) -> None:
        self.op, self.name, self.works, self.finish = op, name, works, finish
        self.nbytes, self.t0, self.tq = nbytes, t0, tq
        self.done = False
        self.launched = True
        self.error: BaseException | None = None
        self.progress: Callable[[bool], None] | None = None
        self.on_done: Callable[[], None] | None = None
        self.result: Any = None
        _LIVE.add(self)

    def fail(self, error: BaseException) -> None:
        """End the collective with ``error`` (raised by ``synchronize``)."""
        self.error = error
        self.works = []

    def poll(self) -> bool:
        """Return True when the communication finished (``synchronize`` will not block).

        A collective still waiting for other ranks' submissions runs one negotiation round
        (which waits for every member to reach a hora call) and may launch.
        """
        if self.done or self.error is not None:
            return True
        if not self.launched:
            if self.progress is not None:
                self.progress(False)
            if not self.launched:
                return self.error is not None
        return all(w is None or w.is_completed() for w in self.works)

    def wait(self) -> Any:
        """Wait, run the finishing step once, and return the result."""
        if self.done:
            return self.result
        try:
            if not self.launched and self.error is None and self.progress is not None:
                self.progress(True)
            if self.error is not None:
                raise self.error
            for w in self.works:
                if w is not None:
                    _stall.wait_work(w, self.op, self.name)
            self.result = self.finish()
        finally:
            self.done = True
            if self.on_done is not None:
                self.on_done()
            self.progress = self.on_done = None  # they hold the process set and its groups
        if self.t0:
            self._record()
        return self.result

    def _record(self) -> None:
        tq = self.tq or self.t0
        timeline.record(self.name, "QUEUED", self.t0, tq, self.nbytes)
        timeline.record(self.name, self.op.upper(), tq, timeline.now_ns(), self.nbytes)


_LIVE: weakref.WeakSet[Handle] = weakref.WeakSet()
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()


def hold_works(holder: Any) -> None:
    """Register an object whose ``release_works()`` drops the Works it keeps in flight.

    ``shutdown()`` calls it, as it invalidates handles (the optimizer's buckets use it).
    """
    _HOLDERS.add(holder)


def _after_shutdown(op: str) -> Callable[[], Any]:
    def fail() -> Any:
        raise NotInitializedError(f"synchronize (of a {op} started before shutdown())")

    return fail


def release_all() -> None:
    """Drop the Works of every handle not synchronized yet (``shutdown()`` calls it).

    A Work keeps its process group's store, and so the rendezvous port, alive; Horovod's
    handles are invalid after shutdown too: ``synchronize`` then raises NotInitializedError.
    """
    for h in list(_LIVE):
        if not h.done:
            h.works, h.finish = [], _after_shutdown(h.op)
            h.progress = h.on_done = None  # they hold the process set, and so its groups
            h.launched = True
    for holder in list(_HOLDERS):
        holder.release_works()


# gloo has no int16 kernels: its worker thread fails and the collective never completes on
# any rank (a hang until the timeout). Such tensors travel as int32 and are copied back.
_NARROW = torch.int16
_WIDE = torch.int32


def widen(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` itself, or an int32 copy of an int16 ``t`` when gloo carries it."""
    if t.dtype is not _NARROW or t.device.type != "cpu":
        return t
    return t.to(_WIDE)


class _Widened:
    """A Work whose int32 stand-ins are copied back into the caller's int16 tensors."""

    def __init__(self, work: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.work, self.pairs = work, pairs

    def wait(self, timeout: Any = None) -> Any:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        for narrow, wide in self.pairs:
            narrow.copy_(wide)
        return ok

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _swap(arg: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(arg, torch.Tensor):
        wide = widen(arg)
        if wide is not arg:
            pairs.append((arg, wide))
        return wide
    if isinstance(arg, list) and arg and all(isinstance(a, torch.Tensor) for a in arg):
        return [_swap(a, pairs) for a in arg]
    return arg


def guarded(op: str, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Launch an async torch.distributed call, converting an immediate failure."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    args = tuple(_swap(a, pairs) for a in args)
    work = _stall.run_guarded(op, name, fn, *args, **kwargs)
    return _Widened(work, pairs) if pairs and work is not None else work


_state.register_release_hook(release_all)
