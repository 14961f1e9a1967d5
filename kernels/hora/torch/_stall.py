"""Turn hangs and backend failures into errors that name ranks (data plane).

Every rank counts the collectives it enters (``RankState.seq``, an int increment: no per-op
communication) and a heartbeat thread publishes the counter to the rendezvous store every
0.25 s. The backend's own timeout (``init(timeout=)``, default 60 s) bounds every wait; when a
collective fails or times out, :func:`diagnose` reads the other ranks' counters twice:

* a rank whose heartbeat stopped is dead -> :class:`RankFailedError` naming it;
* a rank whose counter is behind ours never arrived -> :class:`CollectiveTimeout` naming it.

Shape/dtype agreement is checked before the data moves (:mod:`hora.torch._engine`);
when a rank skipped that check and the ranks disagree, the heartbeats' signatures name them
here (:class:`TensorMismatchError`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hora.errors import CollectiveTimeout, HoraError, PeerFailedError, TensorMismatchError
from hora.torch import _heartbeat, _state

_BACKEND_ERRORS: tuple[type[BaseException], ...] = (RuntimeError,)


Beat = tuple[int, float, int, str]


def _read(store: Any, rank: int) -> Beat | None:
    key = f"{_heartbeat.KEY}{rank}"
    if not store.check([key]):
        return None
    seq, ts, sig, *op = store.get(key).decode().split(" ", 3)
    return int(seq), float(ts), int(sig), (op[0] if op else "")


def _snapshot(state: _state.RankState) -> dict[int, Beat | None]:
    store = state.heartbeat.store if state.heartbeat is not None else state.store
    return {r: _read(store, r) for r in range(state.size) if r != state.rank}


def diagnose(op: str, name: str, exc: BaseException | None = None) -> HoraError:
    """Explain why a collective failed: which ranks died or never arrived.

    Args:
        op: the collective's public name.
        name: the tensor name ("" when none).
        exc: the backend's exception, quoted in the detail.

    Returns:
        A RankFailedError (a rank stopped) or a CollectiveTimeout (ranks behind).
    """
    state = _state.require_init(op)
    state.broken = True  # the ranks may now disagree on what ran: init() starts anew
    detail = f"{op} {name!r}: {exc}" if exc is not None else f"{op} {name!r}"
    try:
        first = _snapshot(state)
        time.sleep(3 * _heartbeat.PERIOD_S + 0.3)
        second = _snapshot(state)
    except Exception as e:  # the store lives on rank 0: unreachable store means rank 0 is gone
        if state.rank != 0:
            return PeerFailedError(
                0, detail=f"rank 0 (host of the rendezvous store) is unreachable ({e}); {detail}"
            )
        return CollectiveTimeout(op, [], state.timeout_s, name=name)
    dead = [r for r in first if second[r] is None or first[r] == second[r]]
    if dead:
        return PeerFailedError(
            dead[0], detail=f"stopped responding during {detail}", others=dead[1:]
        )
    behind = [r for r, v in second.items() if v is not None and v[0] < state.seq]
    differ = [
        r
        for r, v in second.items()
        if v is not None and v[0] == state.seq and (v[2], v[3]) != (state.last_sig, state.last_op)
    ]
    if differ and not behind:
        ranks = sorted([state.rank, *differ])
        return TensorMismatchError(
            op,
            name,
            "ranks passed different ops, shapes or dtypes "
            f"(found when the {state.timeout_s:g}s timeout expired)",
            ranks,
        )
    return CollectiveTimeout(op, behind, state.timeout_s, name=name)


def wait_work(work: Any, op: str, name: str) -> None:
    """Wait for a torch.distributed Work within the configured timeout, converting failures.

    Args:
        work: what an ``async_op=True`` torch.distributed call returned.
        op: the public name of the collective, for the error.
        name: the tensor name, for the error.

    Raises:
        CollectiveTimeout: some ranks never arrived within the timeout (they are named).
        RankFailedError: a rank died (it is named).

    Example:
        >>> work = torch.distributed.all_reduce(t, async_op=True)
        >>> wait_work(work, "allreduce", "grad.0")
    """
    state = _state.require_init(op)
    try:
        ok = work.wait(timeout=state.timeout_td)
    except _BACKEND_ERRORS as e:
        raise diagnose(op, name, e) from None
    if ok is False:
        raise diagnose(op, name, TimeoutError(f"no completion in {state.timeout_s:g}s"))


def run_guarded(op: str, name: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Call a blocking torch.distributed function, converting its failure like :func:`wait_work`."""
    try:
        return fn(*args, **kwargs)
    except _BACKEND_ERRORS as e:
        if isinstance(e, HoraError):
            raise
        raise diagnose(op, name, e) from None


def mismatch_ranks(values: Sequence[object]) -> list[int]:
    """Return the ranks whose value differs from rank 0's, with rank 0 first."""
    bad = [r for r, v in enumerate(values) if v != values[0]]
    return [0, *bad] if bad else []
