"""Async handles, signature checks and the timeline hooks shared by the collectives (data plane).

A :class:`Handle` is what every ``*_async`` collective returns: the torch.distributed Works in
flight and a ``finish`` callback (average, postscale, copy back, decompress) that
``synchronize`` runs once. Before any data moves, :func:`start` verifies that every rank passes
the same op, dtype and shape (one small all_gather on the gloo side group).
"""

from __future__ import annotations

import os
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import NotInitializedError, TensorMismatchError
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
_MAXDIM = 6
SIG_LEN = 4 + _MAXDIM + 1
_PAD = (-1,) * _MAXDIM
# The opcode of a rank that refused its own arguments (see :func:`refusal`).
_OPC_REFUSED = -7
_REFUSED_KEY = "hora/refused/"


def check_mode() -> str:
    """Return the shape/dtype check mode from ``HORA_CHECK_TENSORS``: changed, always or off.

    ``changed`` (default) checks a collective unless it repeats, on this rank, the signature
    (op, dtype, shape) that every rank agreed on last; ``always`` checks every call.
    """
    raw = os.environ.get("HORA_CHECK_TENSORS", "changed").lower()
    if raw in ("0", "off", "false", "no"):
        return "off"
    return "always" if raw in ("always", "2") else "changed"


def signature(opcode: int, extra: int, dtype: torch.dtype, shape: Sequence[int]) -> tuple[int, ...]:
    """Encode (op, extra, dtype, shape) as SIG_LEN ints; long shapes go into a CRC slot."""
    ndim = len(shape)
    if ndim <= _MAXDIM:
        return (opcode, extra, _DTYPE_CODE.get(dtype, 99), ndim, *shape, *_PAD[ndim:], 0)
    dims = list(shape)
    tail = zlib.crc32(repr(dims[_MAXDIM:]).encode())
    return (opcode, extra, _DTYPE_CODE.get(dtype, 99), ndim, *dims[:_MAXDIM], tail)


def describe(sig: Sequence[int]) -> str:
    """Render a signature for an error message: dtype and shape."""
    dtype = _DTYPES[sig[2]] if sig[2] < len(_DTYPES) else "other"
    ndim = sig[3]
    shape = tuple(sig[4 : 4 + min(ndim, _MAXDIM)])
    dots = "..." if ndim > _MAXDIM else ""
    return f"{str(dtype).replace('torch.', '')}{list(shape)}{dots}"


def key_dtype(key: Sequence[int]) -> torch.dtype:
    """Return the dtype a signature names."""
    return _DTYPES[key[2]]


def key_shape(key: Sequence[int]) -> list[int]:
    """Return the shape a signature names (up to six dimensions are kept exactly)."""
    ndim = key[3]
    if ndim > _MAXDIM:
        raise ValueError(f"a {ndim}-d tensor's shape is not kept in its signature")
    return list(key[4 : 4 + ndim])


class SigCheck:
    """An all_gather of every rank's signature on the side group, verified at wait().

    Ints after the first SIG_LEN are a payload (first dims, splits) that may differ by rank.
    """

    def __init__(self, state: _state.State, op: str, name: str, sig: Sequence[int]) -> None:
        self.op, self.name = op, name
        mine = torch.tensor(list(sig), dtype=torch.int64)
        self.rows = [torch.empty_like(mine) for _ in range(state.size)]
        self.work = dist.all_gather(self.rows, mine, group=state.side_group, async_op=True)

    def wait(self) -> list[list[int]]:
        _stall.wait_work(self.work, self.op, self.name)
        rows = [r.tolist() for r in self.rows]
        refused = [r for r, row in enumerate(rows) if row[0] == _OPC_REFUSED]
        if refused and len(refused) < len(rows):
            raise TensorMismatchError(self.op, self.name, _refusals(refused), refused)
        if any(r[:2] != rows[0][:2] for r in rows):
            bad = _stall.mismatch_ranks([r[:2] for r in rows])
            raise TensorMismatchError(
                self.op,
                self.name,
                "ranks called different operations (or different root ranks / reduce ops)",
                bad,
            )
        if any(r[2:SIG_LEN] != rows[0][2:SIG_LEN] for r in rows):
            bad = _stall.mismatch_ranks([r[2:SIG_LEN] for r in rows])
            seen = ", ".join(f"rank {r}: {describe(rows[r])}" for r in bad)
            raise TensorMismatchError(self.op, self.name, f"shape or dtype differ ({seen})", bad)
        return rows


def _refusals(ranks: list[int]) -> str:
    store = _state.require_init("refusal").store
    why = []
    for r in ranks:
        try:
            why.append(f"rank {r} raised {store.get(f'{_REFUSED_KEY}{r}').decode()}")
        except Exception:  # the refusing rank is gone: name it without its reason
            why.append(f"rank {r} refused its arguments")
    return "; ".join(why) + " before the data moved"


@contextmanager
def refusal(state: _state.State, op: str, name: str) -> Iterator[None]:
    """Run a collective's argument checks; when they raise, still take part in the check.

    A rank that refuses its arguments (``op=Adasum``, a root outside the world) after the
    others entered the collective would otherwise leave them waiting for it, and the next
    collectives would pair with the wrong calls on the side group: "different operations"
    for the rest of the run, or a gloo abort when the sizes differ. Instead the rank joins
    the signature check with a "refused" signature, after writing its reason to the store;
    the others raise TensorMismatchError quoting it, the refusing rank raises its own error,
    and every rank is at the same point again. Ranks that skip the check (``changed`` mode,
    repeating the last agreed call) find the refusal at the timeout instead.
    """
    try:
        yield
    except Exception as e:
        if state.size > 1 and state.check_mode != "off":
            state.store.set(f"{_REFUSED_KEY}{state.rank}", f"{type(e).__name__}: {e}")
            sig = (_OPC_REFUSED, 0, 0, 0, *_PAD, 0)
            state.last_sig = hash(sig) & 0x7FFFFFFF
            try:
                SigCheck(state, op, name, sig).wait()
            except TensorMismatchError:
                pass  # the others disagree, as expected: this rank's own error says why
        raise


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


def begin(op: str, name: str | None) -> tuple[_state.State, str]:
    """Enter a collective: check init, count it for the stall report, default the name."""
    state = _state.require_init(op)
    state.seq += 1
    state.last_op = op
    state.last_sig = 0
    return state, name if name is not None else f"{op}.noname.{state.seq}"


def start(state: _state.State, op: str, name: str, sig: tuple[int, ...] | None, t0: int = 0) -> int:
    """Verify op/dtype/shape across ranks before the data moves; return when it finished (ns).

    The check must finish first: gloo aborts the whole process when a peer sends more bytes
    than a rank expects. It is skipped when this call repeats the last signature all ranks
    agreed on: ``verified_sig`` is the same on every rank, so ranks skip together only when
    their signatures are equal; a rank that skips while another checks ends in the timeout,
    and the stall report (heartbeats carry ``last_sig``) then names the mismatching ranks.

    Returns:
        The end of negotiation for the timeline (0 when ``t0`` is 0: no timeline).
    """
    if sig is not None:
        state.last_sig = hash(sig) & 0x7FFFFFFF
        mode = state.check_mode
        if state.size > 1 and mode != "off" and (mode == "always" or sig != state.verified_sig):
            SigCheck(state, op, name, sig).wait()
            state.verified_sig = sig
    return timeline.now_ns() if t0 else 0


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
