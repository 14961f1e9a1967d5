"""One negotiation round and what every member decides from it (data plane).

A round (:func:`run_round`) exchanges every member's row (:mod:`hora.torch._wire`); every
member then walks the same table and reaches the same decisions, in the same order:

1. the round itself failed: every pending collective of this rank fails with that error;
2. every member has joined: ``join()`` ends, naming the last member to join;
3. for each collective, in the order of the lowest active member's submissions and then
   the expired ones (:func:`_decision_order`), once every active member submitted it or
   someone published it expired (:func:`_decide`): an expired one fails with
   :class:`~hora.errors.CollectiveTimeout` (:func:`_expire`); a ready one gets its
   :func:`_verdict` (mismatch, refusal, unsupported while joined) and then fails, is served
   by a joined rank (:func:`_serve`) or is launched (:func:`launch`);
4. nothing was decided: the deadlock check (:func:`_break_deadlock`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hora.errors import (
    CollectiveDeadlock,
    CollectiveTimeout,
    HoraError,
    TensorMismatchError,
    UnsupportedError,
)
from hora.torch import _stall, _state, timeline
from hora.torch._comm import Comm, Entry, Launch, Serve
from hora.torch._handles import MAXDIM, Handle, describe
from hora.torch._kinds import Kind
from hora.torch._wire import DEADLOCK_GRACE_S, Row, decode, encode, exchange

OPC_REFUSED = -7
REFUSED_KEY = "hora/refused/"

# a pending collective as one member published it: (expired, signature, payload)
Published = tuple[bool, tuple[int, ...], list[int]]

SERVERS: dict[int, Serve] = {}


def launch(
    handle: Handle, launch: Launch, rows: list[list[int] | None], kind: str, name: str
) -> None:
    """Start ``launch`` for ``handle`` with every member's payload row; a failure fails it."""
    if handle.t0:
        handle.tq = timeline.now_ns()
    try:
        works, finish, *nbytes = launch(rows)  # type: ignore[misc]
    except HoraError as e:
        handle.fail(e)
        return
    except RuntimeError as e:
        handle.fail(_stall.diagnose(kind, name, e))
        return
    handle.works, handle.finish = works, finish
    if nbytes:
        handle.nbytes = nbytes[0]
    handle.launched = True


@dataclass
class _Round:
    """What one round decides from: the members' rows, who joined, and this rank's entries."""

    comm: Comm
    tables: list[Row]
    joined: list[int]
    active: list[int]
    by_member: list[dict[int, Published]]
    mine: dict[int, Entry]


def run_round(comm: Comm, op: str, name: str) -> bool:
    """Run one negotiation round on ``comm``; return whether anything was decided.

    ``op`` and ``name`` name the collective the caller waits for, in a timeout's error. When
    the round itself fails (a member never reached a hora call, or died), every pending
    collective of this rank fails with that error and the set leaves its joined state.
    """
    tables = _exchange_rows(comm, op, name)
    joined = [m for m, t in enumerate(tables) if t.joined_at]
    active = [m for m in range(comm.size) if m not in joined]
    if not active:
        _end_join(comm, tables, joined)
        return True
    comm.joined_before = frozenset(joined)
    by_member = [{h: (exp, key, payload) for h, exp, key, payload in t.entries} for t in tables]
    rnd = _Round(comm, tables, joined, active, by_member, {e.hashed: e for e in comm.pending})
    progressed = False
    for h in _decision_order(tables, active):
        progressed = _decide(rnd, h) or progressed
    if not progressed:
        progressed = _break_deadlock(comm, tables, active, by_member)
    return progressed


def _exchange_rows(comm: Comm, op: str, name: str) -> list[Row]:
    """Exchange this round's rows; when that fails, fail every pending collective here too."""
    try:
        return [decode(r) for r in exchange(comm, encode(comm), op, name)]
    except BaseException as e:
        pending, comm.pending = comm.pending, []
        comm.joined = False
        for failed in pending:
            if failed.handle is not None and failed.handle.error is None:
                failed.handle.fail(e)
        raise


def _end_join(comm: Comm, tables: list[Row], joined: list[int]) -> None:
    """Everyone joined: ``join()`` returns the last member to join."""
    new = [m for m in joined if m not in comm.joined_before] or joined
    last = max(new, key=lambda m: (tables[m].joined_at, m))
    comm.last_joined = comm.ranks[last]
    comm.joined_before = frozenset()
    comm.joined = False


def _decision_order(tables: list[Row], active: list[int]) -> list[int]:
    """The lowest active member's submissions, then the expired entries of anyone."""
    order = [h for h, *_ in tables[active[0]].entries]
    seen = set(order)
    for t in tables:  # an expired entry ends everywhere, whoever submitted it
        for h, exp, *_ in t.entries:
            if exp and h not in seen:
                seen.add(h)
                order.append(h)
    return order


def _decide(rnd: _Round, h: int) -> bool:
    """Decide the collective hashed ``h`` when it is ready or expired; return whether it was."""
    comm, by_member = rnd.comm, rnd.by_member
    present = [m for m in rnd.active if h in by_member[m]]
    expired = any(by_member[m][h][0] for m in range(comm.size) if h in by_member[m])
    if len(present) < len(rnd.active) and not expired:
        return False
    entry = rnd.mine.pop(h, None)
    if entry is not None:
        comm.pending.remove(entry)
    if expired:
        _expire(comm, entry, [comm.ranks[m] for m in rnd.active if m not in present])
        return True
    rows = [by_member[m].get(h) if m in present else None for m in range(comm.size)]
    error = _verdict(comm, rows, rnd.active, rnd.joined, entry)
    if entry is None:
        if error is None and comm.index in rnd.joined:
            _serve(comm, rows)
    elif entry.handle is None:  # this rank's refusal: its own error was raised already
        pass
    elif error is not None:
        comm.give_back(entry.name)
        entry.handle.fail(error)
    else:
        assert entry.launch is not None
        payloads = [None if r is None else r[2] for r in rows]
        launch(entry.handle, entry.launch, payloads, entry.kind, entry.name)
    return True


def _expire(comm: Comm, entry: Entry | None, missing: list[int]) -> None:
    """Fail this rank's entry of an expired collective, naming the ranks that never sent it."""
    if entry is None or entry.handle is None:
        return
    comm.give_back(entry.name)
    timeout_s = _state.require_init(entry.kind).timeout_s
    entry.handle.fail(CollectiveTimeout(entry.kind, missing, timeout_s, name=entry.name))


def _break_deadlock(
    comm: Comm,
    tables: list[Row],
    active: list[int],
    by_member: list[dict[int, Published]],
) -> bool:
    """End waits that can never end; return whether they were ended.

    When every member that has not joined is blocked, each on a collective that not every
    member submitted, and nothing was decided in this round, no member can submit what would
    unblock the others (each is inside a hora call): the ranks are at different points of
    the script (an exception skipped a collective on some of them, or they call collectives
    in different orders). Which side is right cannot be told from here: giving up on one
    side's collective lets that side run on into its next one, still a step apart. So once
    every member has waited ``DEADLOCK_GRACE_S``, every pending collective fails on every
    member with :class:`~hora.errors.CollectiveDeadlock` (naming where each rank waits), the
    world is marked out of step, and later collectives fail at once
    (:func:`hora.torch._engine.check_in_step`) until ``init()`` starts a new world.
    Every member reads the same table, so every member decides alike, in the same round.
    """
    if not active or any(not tables[m].waiting for m in active):
        return False
    if min(tables[m].waited_us for m in active) < DEADLOCK_GRACE_S * 1e6:
        return False
    state = _state.require_init("deadlock")
    waited = max(tables[m].waited_us for m in active) / 1e6
    pending, comm.pending = comm.pending, []
    mine: HoraError | None = None
    for entry in pending:
        missing = [m for m in active if entry.hashed not in by_member[m]]
        by_text: dict[str, list[int]] = {}
        for m in missing:
            by_text.setdefault(tables[m].wait_text or "a collective", []).append(comm.ranks[m])
        waits = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} in {t}"
            for t, r in by_text.items()
        )
        error = CollectiveDeadlock(entry.kind, [comm.ranks[m] for m in missing], entry.name,
                                   waits, waited)  # fmt: skip
        if entry.hashed == comm.waiting or mine is None:
            mine = error
        if entry.handle is not None and entry.handle.error is None:
            entry.handle.fail(error)
    comm.joined = False  # a member serving the others in join() leaves it too
    state.broken = True
    state.out_of_step = str(mine) if mine is not None else "a deadlock"
    return True


def _verdict(
    comm: Comm,
    rows: list[Published | None],
    active: list[int],
    joined: list[int],
    entry: Entry | None,
) -> HoraError | None:
    """Return the error every holder of a ready collective raises, or None when it may run."""
    kind = entry.kind if entry is not None else "collective"
    name = entry.name if entry is not None else ""
    held = {m: r for m, r in enumerate(rows) if r is not None and m in active}
    refused = [m for m, r in held.items() if r[1][0] == OPC_REFUSED]
    if refused:
        return TensorMismatchError(kind, name, _refusals(comm, name, refused),
                                   [comm.ranks[m] for m in refused])  # fmt: skip
    keys = [r[1] for r in held.values()]
    ranks = [comm.ranks[m] for m in held]
    if any(k[:2] != keys[0][:2] for k in keys):
        bad = _stall.mismatch_ranks([k[:2] for k in keys])
        return TensorMismatchError(
            kind, name,
            "ranks called different operations (or different root ranks / reduce ops)",
            [ranks[i] for i in bad],
        )  # fmt: skip
    if any(k[2:] != keys[0][2:] for k in keys):
        bad = _stall.mismatch_ranks([k[2:] for k in keys])
        seen = ", ".join(f"rank {ranks[i]}: {describe(keys[i])}" for i in bad)
        return TensorMismatchError(kind, name, f"shape or dtype differ ({seen})",
                                   [ranks[i] for i in bad])  # fmt: skip
    if joined and keys[0][0] not in SERVERS:
        return UnsupportedError(
            f"{kind} {name!r}: ranks {[comm.ranks[m] for m in joined]} have joined; as in "
            "Horovod, a joined rank serves allreduces only"
        )
    if joined and keys[0][3] > MAXDIM:  # the signature keeps six dimensions, not the shape
        return UnsupportedError(
            f"{kind} {name!r}: ranks {[comm.ranks[m] for m in joined]} have joined and cannot "
            f"serve a {keys[0][3]}-d tensor (at most {MAXDIM} dimensions; reshape it)"
        )
    return None


def _refusals(comm: Comm, name: str, members: list[int]) -> str:
    store = _state.require_init("refusal").store
    why = []
    for m in members:
        r = comm.ranks[m]
        try:
            why.append(
                f"rank {r} raised {store.get(f'{REFUSED_KEY}{comm.set_id}/{name}/{r}').decode()}"
            )
        except Exception:  # the refusing rank is gone: name it without its reason
            why.append(f"rank {r} refused its arguments")
    return "; ".join(why) + " before the data moved"


def _serve(comm: Comm, rows: list[Published | None]) -> None:
    key = next(r[1] for r in rows if r is not None)
    works = SERVERS[key[0]](comm, key, [None if r is None else r[2] for r in rows])
    for w in works:
        if w is not None:
            _stall.wait_work(w, Kind.JOIN, "")

