"""The one launch path of every collective: negotiation by name, then launch (data plane).

Horovod matches collectives by *name*, not by call order: a rank may submit ``a`` then ``b``
while another submits ``b`` then ``a``; a rank that has called ``join()`` serves the others'
collectives with zeros; two in-flight collectives with one name are an error on the rank that
submitted the second. torch.distributed matches by order only. This module bridges the two.

Each process set has a :class:`Comm`: its data group, a gloo side group and the collectives
submitted on this rank but not launched yet (``pending``). A *round* is one small all_gather
on the side group in which every member publishes its pending entries (name, signature, the
per-rank payload such as first dimensions or splits) and whether it has joined. Every member
gets the same table, so every member reaches the same decision without a coordinator:

* a name every member (that has not joined) submitted is *ready*: if the signatures agree,
  it is launched, on every rank, in the order of the lowest such member's submissions;
  otherwise every holder gets :class:`~hora.errors.TensorMismatchError` with the true reason;
* a member that joined serves a ready allreduce it did not submit with zeros, so the others'
  allreduces complete (any other collective fails on every holder while a member has
  joined, as in Horovod);
* an entry whose submitter has waited longer than the timeout is published as *expired*: every
  holder then gets :class:`~hora.errors.CollectiveTimeout` naming the ranks that never
  submitted it, and the entry leaves every table at once, so the world stays in step;
* when every member is blocked (each publishes the collective it waits on), none in a
  collective all of them submitted, nobody can ever go on: after ``DEADLOCK_GRACE_S`` every
  pending collective fails with :class:`~hora.errors.CollectiveDeadlock` and the world is
  out of step until ``init()`` (:func:`_break_deadlock`).

Submitting a collective runs one round (so the data moves while the caller goes on, as with
Horovod's background thread); ``synchronize``, ``poll``, ``barrier`` and ``join`` run rounds
until what they wait for is launched. ``HORA_CHECK_TENSORS=off`` skips negotiation: calls
launch at once in call order (no name matching, no join serving, no shape checks).
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import (
    CollectiveDeadlock,
    CollectiveTimeout,
    HoraError,
    TensorMismatchError,
    UnsupportedError,
)
from hora.torch import _shm, _stall, _state, timeline
from hora.torch._handles import MAXDIM, SIG_LEN, Handle, describe

# A launcher gets every member's payload row (None for a member that joined and serves) and
# returns the Works in flight and the finishing step (average, copy back) for the handle, and
# optionally the bytes moved when only the rows tell (allgather).
Launch = Callable[[list[list[int] | None]], tuple[Any, ...]]
# A server launches, on a rank that joined, its part of a collective it did not submit.
Serve = Callable[["Comm", Sequence[int], list[list[int] | None]], list[Any]]

OPC_REFUSED = -7
OPC_BARRIER = 9
_CAP = 96  # ints in the first all_gather of a round; longer tables take a second one
_REFUSED_KEY = "hora/refused/"
_BACKOFF_S = (0.0, 0.0002, 0.001, 0.003, 0.01)
# How long every member must have been blocked, none in a collective all of them submitted,
# before the longest waiter gives up (CollectiveDeadlock): time for a submission from
# another thread of some rank, which would unblock them, to arrive
DEADLOCK_GRACE_S = 1.0
_WAIT_TEXT_MAX = 120  # bytes of "kind 'name'" a blocked member publishes

SERVERS: dict[int, Serve] = {}


def negotiate() -> bool:
    """Return whether collectives are negotiated (``HORA_CHECK_TENSORS`` is not ``off``)."""
    raw = os.environ.get("HORA_CHECK_TENSORS", "on").lower()
    return raw not in ("0", "off", "false", "no")


def name_hash(name: str) -> int:
    """A 62-bit hash of a collective's name, the same in every process."""
    data = name.encode()
    return (zlib.crc32(data) << 30) ^ zlib.adler32(data)


@dataclass(eq=False)
class Entry:
    """A collective submitted on this rank and not launched yet."""

    kind: str
    name: str
    key: tuple[int, ...]
    payload: list[int]
    launch: Launch | None
    handle: Handle | None
    deadline: float
    expired: bool = False
    hashed: int = 0
    since: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.hashed = name_hash(self.name)


@dataclass(eq=False)
class Comm:
    """A process set's communication state on this rank.

    Attributes:
        set_id: the process set's id (0: the global set).
        ranks: the members' global ranks, ascending.
        index: this rank's position in ``ranks`` (-1 when not a member).
        group: the data group (the default group for the global set).
        side: the gloo group the rounds and object collectives use.
        pending: entries submitted here and not launched, in submission order.
        inflight: names of this rank's collectives not finished yet (duplicate check).
        counters: per-op counters for unnamed collectives ("allreduce.noname.3").
        joined: this rank called ``join()`` and serves the others until all joined.
        joined_before: members seen joined in the last round (to name the last joiner).
        shm: the members' shared-memory segment (:mod:`hora.torch._shm`), when they have one.
        shm_decided: whether the members decided on ``shm`` yet (they do it once, together).
        waiting: the name hash of the collective this rank blocks on (in ``synchronize``,
            ``barrier``, a blocking call), 0 while it does not; published in every round.
    """

    set_id: int
    ranks: list[int]
    index: int
    group: Any
    side: Any
    pending: list[Entry] = field(default_factory=list)
    inflight: dict[str, Handle] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    joined: bool = False
    joined_at: int = 0
    joined_before: frozenset[int] = frozenset()
    last_joined: int = -1
    shm: Any = None
    shm_decided: bool = False
    waiting: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def member(self, global_rank: int) -> int:
        """Return the position of a global rank in this set (ValueError when not a member)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in the process set {self.ranks}") from None

    def auto_name(self, op: str) -> str:
        n = self.counters.get(op, 0) + 1
        self.counters[op] = n
        return f"{op}.noname.{n}"

    def give_back(self, name: str) -> None:
        """Return the number of a failed unnamed collective, when it was the last one issued.

        A rank whose unnamed collective failed without the others submitting it (it timed out
        waiting for them) would otherwise be one number ahead of them for good, and every
        later unnamed collective of that kind would pair with the wrong one.
        """
        op, sep, n = name.rpartition(".noname.")
        if sep and n.isdigit() and self.counters.get(op) == int(n):
            self.counters[op] = int(n) - 1


def begin(comm: Comm, op: str, name: str | None) -> tuple[_state.State, str]:
    """Enter a collective: count it for the stall report and default its name."""
    state = _state.require_init(op)
    state.seq += 1
    state.last_op = op
    state.last_sig = 0
    return state, name if name is not None else comm.auto_name(op)


_INFLIGHT_PRUNE = 4096


def _in_flight(comm: Comm, name: str) -> bool:
    """Whether a collective named ``name`` was submitted here and not synchronized yet.

    Horovod refuses a name while its collective is queued in its background thread, which in
    practice covers an unsynchronized handle; hora makes that rule exact: a name is taken
    from submission until ``synchronize`` (so a second ``allreduce_async(name=...)`` before
    the first is synchronized always raises, whatever the timing).
    """
    h = comm.inflight.get(name)
    return h is not None and not h.done


def _prune(comm: Comm) -> None:
    """Forget finished collectives whose handles were dropped without ``synchronize``."""
    if len(comm.inflight) > _INFLIGHT_PRUNE:
        for name, h in list(comm.inflight.items()):
            if h.done or (h.launched and h.poll()):
                del comm.inflight[name]


def submit(
    comm: Comm,
    kind: str,
    name: str,
    key: Sequence[int],
    payload: Sequence[int],
    launch: Launch,
    nbytes: int = 0,
) -> Handle:
    """Submit a collective: negotiate it with the other members (one round) and return its handle.

    Args:
        comm: the process set's state.
        kind: the public op name ("allreduce", ...), for errors and the timeline.
        name: the collective's name; members match collectives by it.
        key: SIG_LEN ints every member must agree on (op code, reduce op or root, dtype,
            shape); see :func:`hora.torch._handles.signature`.
        payload: ints that may differ by member (first dimension, splits).
        launch: starts the data movement once every member submitted ``name``.
        nbytes: bytes moved, for the timeline.

    Raises:
        ValueError: a collective named ``name`` is already in flight on this rank.
    """
    if _in_flight(comm, name):
        raise ValueError(
            f"{kind}: a collective named {name!r} is already in flight on this rank; "
            "concurrent collectives need distinct names"
        )
    state = _state.require_init(kind)
    check_in_step(state, kind, name)
    t0 = timeline.now_ns() if timeline.enabled() else 0
    handle = Handle(kind, name, [], _not_launched, nbytes, t0)
    handle.launched = False
    _prune(comm)
    comm.inflight[name] = handle
    handle.on_done = lambda c=comm, n=name, h=handle: _forget(c, n, h)
    handle.progress = functools.partial(_progress, comm, handle)
    if comm.size == 1 or not negotiate():
        rows: list[list[int] | None] = [list(payload)] * comm.size
        _launch(handle, launch, rows, kind, name)
        return handle
    entry = Entry(kind, name, tuple(key), list(payload), launch, handle,
                  time.monotonic() + state.timeout_s)  # fmt: skip
    comm.pending.append(entry)
    run_round(comm, kind, name)
    return handle


def _progress(comm: Comm, handle: Handle, block: bool) -> None:
    if block:
        wait_launched(comm, handle)
    else:
        run_round(comm, handle.op, handle.name)


def launch_planned(op: str, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Launch one collective of a fixed plan that every rank builds alike, without a round.

    The DistributedOptimizer's gradient buckets, SyncBatchNorm's statistics and the flat
    buffers of ``broadcast_parameters`` (after its negotiated name/shape check) are launched
    from hooks and inner loops where a negotiation round per call would cost what DDP does
    not pay. They are counted for the stall report and their failures are converted exactly
    like negotiated collectives (:func:`hora.torch._stall.run_guarded`); ``fn`` is the
    torch.distributed call (``async_op=True`` returns its Work).
    """
    state = _state.require_init(op)
    check_in_step(state, op, name)
    state.seq += 1
    state.last_op = op
    return _stall.run_guarded(op, name, fn, *args, **kwargs)


def _forget(comm: Comm, name: str, handle: Handle) -> None:
    if comm.inflight.get(name) is handle:
        del comm.inflight[name]


def _not_launched() -> Any:
    raise HoraError("internal: a collective finished before it was launched")


def _launch(
    handle: Handle, launch: Launch, rows: list[list[int] | None], kind: str, name: str
) -> None:
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


def refuse(comm: Comm, kind: str, name: str, error: BaseException) -> None:
    """Publish that this rank refused its arguments for ``name``; the others' call fails too.

    The reason is written to the store, and a *refused* entry takes part in the rounds like a
    collective: when every member has submitted ``name``, the holders of a real entry raise
    TensorMismatchError quoting it. The refusing rank raises its own error (the caller does).
    """
    if comm.size == 1 or not negotiate():
        return
    state = _state.require_init(kind)
    state.store.set(
        f"{_REFUSED_KEY}{comm.set_id}/{name}/{state.rank}", f"{type(error).__name__}: {error}"
    )
    key = (OPC_REFUSED, *([0] * (SIG_LEN - 1)))
    entry = Entry(kind, name, key, [], None, None, time.monotonic() + state.timeout_s)
    comm.pending.append(entry)
    run_round(comm, kind, name)


@contextmanager
def refusal(comm: Comm, kind: str, name: str) -> Iterator[None]:
    """Run a collective's argument checks; when they raise, publish the refusal (:func:`refuse`)."""
    try:
        yield
    except Exception as e:
        refuse(comm, kind, name, e)
        raise


class GroupHandle(Handle):
    """One handle for several collectives (grouped ops): done when every member is."""

    __slots__ = ("members",)

    def __init__(
        self, op: str, name: str, members: list[Handle], finish: Callable[[], Any]
    ) -> None:
        super().__init__(op, name, [], finish, sum(h.nbytes for h in members))
        self.members = members

    def poll(self) -> bool:
        return self.done or all(h.poll() for h in self.members)


def wait_launched(comm: Comm, handle: Handle) -> None:
    """Run rounds until ``handle``'s collective was launched or failed (bounded by the timeout).

    Meanwhile the rounds tell the other members that this rank is blocked on it, so that a
    set whose members all wait, none in a collective they all submitted, is found
    (:func:`_break_deadlock`).
    """
    backoff = 0
    before, comm.waiting = comm.waiting, name_hash(handle.name)
    try:
        while not handle.launched and handle.error is None:
            progressed = run_round(comm, handle.op, handle.name)
            backoff = 0 if progressed else min(backoff + 1, len(_BACKOFF_S) - 1)
            if _BACKOFF_S[backoff]:
                time.sleep(_BACKOFF_S[backoff])
    finally:
        comm.waiting = before


# -- rounds ----------------------------------------------------------------------------------


@dataclass
class Table:
    """One member's row of a round, decoded.

    Attributes:
        joined_at: when the member joined, in µs (0 when it has not).
        waiting: the name hash of the collective the member blocks on (0: not blocked).
        waited_us: how long ago the member submitted that collective.
        wait_text: "kind 'name'" of it, once the member has waited half the grace period.
        entries: (name hash, expired, signature, payload) of each pending collective.
    """

    joined_at: int
    waiting: int
    waited_us: int
    wait_text: str
    entries: list[tuple[int, bool, tuple[int, ...], list[int]]]


def _pack(text: str) -> list[int]:
    raw = text.encode()[:_WAIT_TEXT_MAX]
    raw += b"\0" * (-len(raw) % 8)
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _unpack(ints: list[int]) -> str:
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in ints)
    return raw.rstrip(b"\0").decode(errors="replace")


def _encode(comm: Comm) -> list[int]:
    now = time.monotonic()
    waited = next((e for e in comm.pending if e.hashed == comm.waiting), None)
    text: list[int] = []
    if waited is not None and now - waited.since >= DEADLOCK_GRACE_S / 2:
        text = _pack(f"{waited.kind} {waited.name!r}")
    out = [
        1 if comm.joined else 0,
        comm.joined_at,
        0 if waited is None else waited.hashed,
        0 if waited is None else int((now - waited.since) * 1e6),
        len(text),
        *text,
        len(comm.pending),
    ]
    for e in comm.pending:
        if not e.expired and now > e.deadline:
            e.expired = True
        out += [e.hashed, 1 if e.expired else 0, *e.key, len(e.payload), *e.payload]
    return out


def _decode(row: list[int]) -> Table:
    """Decode one member's row of a round (what :func:`_encode` wrote)."""
    tlen = row[4]
    text = _unpack(row[5 : 5 + tlen]) if tlen else ""
    i = 5 + tlen
    n = row[i]
    entries, i = [], i + 1
    for _ in range(n):
        h, exp = row[i], bool(row[i + 1])
        key = tuple(row[i + 2 : i + 2 + SIG_LEN])
        plen = row[i + 2 + SIG_LEN]
        payload = row[i + 3 + SIG_LEN : i + 3 + SIG_LEN + plen]
        entries.append((h, exp, key, payload))
        i += 3 + SIG_LEN + plen
    return Table(row[1] if row[0] else 0, row[2], row[3], text, entries)


def _exchange(comm: Comm, mine: list[int], op: str, name: str) -> list[list[int]]:
    """All-gather every member's table.

    Through the members' shared memory when they share a machine (:mod:`hora.torch._shm`,
    set up by every member at its first round), else one all_gather on the side group (two
    when a table is long).
    """
    ring = _shm.ring_of(comm, op)
    if ring is not None:
        tables = ring.allgather_ints(mine, op, name)
        if tables is not None:
            return tables
    first = torch.zeros(_CAP + 1, dtype=torch.int64)
    first[0] = len(mine)
    head = mine[:_CAP]
    first[1 : 1 + len(head)] = torch.tensor(head, dtype=torch.int64)
    rows = [torch.empty_like(first) for _ in range(comm.size)]
    # blocking: the side group's own timeout (init's) bounds it, and on this machine a
    # blocking all_gather costs a third of an async one plus a timed wait (270 vs 780 µs)
    _stall.run_guarded(op, name, dist.all_gather, rows, first, group=comm.side)
    lengths = [int(r[0]) for r in rows]
    if max(lengths) <= _CAP:
        return [r[1 : 1 + n].tolist() for r, n in zip(rows, lengths, strict=True)]
    top = max(lengths)
    full = torch.zeros(top, dtype=torch.int64)
    full[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    big = [torch.empty_like(full) for _ in range(comm.size)]
    _stall.run_guarded(op, name, dist.all_gather, big, full, group=comm.side)
    return [r[:n].tolist() for r, n in zip(big, lengths, strict=True)]


def run_round(comm: Comm, op: str, name: str) -> bool:
    """Run one negotiation round on ``comm``; return whether anything was decided.

    ``op`` and ``name`` name the collective the caller waits for, in a timeout's error. When
    the round itself fails (a member never reached a hora call, or died), every pending
    collective of this rank fails with that error and the set leaves its joined state.
    """
    try:
        tables = [_decode(r) for r in _exchange(comm, _encode(comm), op, name)]
    except BaseException as e:
        pending, comm.pending = comm.pending, []
        comm.joined = False
        for failed in pending:
            if failed.handle is not None and failed.handle.error is None:
                failed.handle.fail(e)
        raise
    joined = [m for m, t in enumerate(tables) if t.joined_at]
    active = [m for m in range(comm.size) if m not in joined]
    progressed = False
    if not active:  # everyone joined: join() returns the last member to join
        new = [m for m in joined if m not in comm.joined_before] or joined
        last = max(new, key=lambda m: (tables[m].joined_at, m))
        comm.last_joined = comm.ranks[last]
        comm.joined_before = frozenset()
        comm.joined = False
        return True
    comm.joined_before = frozenset(joined)
    by_member = [{h: (exp, key, payload) for h, exp, key, payload in t.entries} for t in tables]
    mine = {e.hashed: e for e in comm.pending}
    order = [h for h, *_ in tables[active[0]].entries]
    seen = set(order)
    for m in range(comm.size):  # an expired entry ends everywhere, whoever submitted it
        for h, exp, *_ in tables[m].entries:
            if exp and h not in seen:
                seen.add(h)
                order.append(h)
    for h in order:
        present = [m for m in active if h in by_member[m]]
        expired = any(by_member[m][h][0] for m in range(comm.size) if h in by_member[m])
        if len(present) < len(active) and not expired:
            continue
        progressed = True
        entry: Entry | None = mine.pop(h, None)
        if entry is not None:
            comm.pending.remove(entry)
        rows = [by_member[m].get(h) if m in present else None for m in range(comm.size)]
        if expired:
            missing = [comm.ranks[m] for m in active if m not in present]
            if entry is not None and entry.handle is not None:
                comm.give_back(entry.name)
                entry.handle.fail(
                    CollectiveTimeout(
                        entry.kind,
                        missing,
                        _state.require_init(entry.kind).timeout_s,
                        name=entry.name,
                    )  # fmt: skip
                )
            continue
        error = _verdict(comm, rows, active, joined, entry)
        if entry is None:
            if error is None and comm.index in joined:
                _serve(comm, rows)
            continue
        if entry.handle is None:  # this rank's refusal: its own error was raised already
            continue
        if error is not None:
            comm.give_back(entry.name)
            entry.handle.fail(error)
            continue
        payloads = [None if r is None else r[2] for r in rows]
        assert entry.launch is not None
        _launch(entry.handle, entry.launch, payloads, entry.kind, entry.name)
    if not progressed:
        progressed = _break_deadlock(comm, tables, active, by_member)
    return progressed


def _break_deadlock(
    comm: Comm,
    tables: list[Table],
    active: list[int],
    by_member: list[dict[int, tuple[bool, tuple[int, ...], list[int]]]],
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
    world is marked out of step, and later collectives fail at once (:func:`check_in_step`)
    until ``init()`` starts a new world. Every member reads the same table, so every member
    decides alike, in the same round.
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


def check_in_step(state: _state.State, op: str, name: str) -> None:
    """Refuse a collective once a deadlock left the ranks out of step (until ``init()``).

    Raises:
        HoraError: naming the deadlock and what to do.
    """
    if state.out_of_step:
        raise HoraError(
            f"{op} {name!r} not started: the ranks are out of step since a deadlock "
            f"({state.out_of_step}); call hvd.init() on every rank to start a new world"
        )


def _verdict(
    comm: Comm,
    rows: list[tuple[bool, tuple[int, ...], list[int]] | None],
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
                f"rank {r} raised {store.get(f'{_REFUSED_KEY}{comm.set_id}/{name}/{r}').decode()}"
            )
        except Exception:  # the refusing rank is gone: name it without its reason
            why.append(f"rank {r} refused its arguments")
    return "; ".join(why) + " before the data moved"


def _serve(comm: Comm, rows: list[tuple[bool, tuple[int, ...], list[int]] | None]) -> None:
    key = next(r[1] for r in rows if r is not None)
    works = SERVERS[key[0]](comm, key, [None if r is None else r[2] for r in rows])
    for w in works:
        if w is not None:
            _stall.wait_work(w, "join", "")


def join(comm: Comm) -> int:
    """Serve the other members' collectives until every member joined; return the last joiner."""
    state = _state.require_init("join")
    check_in_step(state, "join", "")
    if comm.size == 1:
        return state.rank
    if not negotiate():  # no serving: wait for every member, name the last to arrive
        mine = torch.tensor([int(time.time() * 1e6), comm.index], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(comm.size)]
        _stall.run_guarded("join", "", dist.all_gather, rows, mine, group=comm.side)
        return comm.ranks[int(max(rows, key=lambda r: (int(r[0]), int(r[1])))[1])]
    comm.joined = True
    comm.joined_at = int(time.time() * 1e6)
    comm.last_joined = -1
    backoff = 0
    while comm.joined:
        progressed = run_round(comm, "join", "")
        backoff = 0 if progressed else min(backoff + 1, len(_BACKOFF_S) - 1)
        if _BACKOFF_S[backoff] and comm.joined:
            time.sleep(_BACKOFF_S[backoff])
    check_in_step(state, "join", "")  # the members still in collectives deadlocked meanwhile
    return comm.last_joined


def drop_all(comm: Comm) -> None:
    """Forget pending entries (shutdown)."""
    comm.pending.clear()
    comm.inflight.clear()
