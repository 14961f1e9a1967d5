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
  out of step until ``init()`` (:func:`hora.torch._negotiation._break_deadlock`).

The parts: :mod:`hora.torch._comm` holds a set's state, :mod:`hora.torch._wire` the row
format and its exchange, :mod:`hora.torch._negotiation` the round and its decisions; this
module is the entry point the ops call (submit, refuse, wait, join).

Submitting a collective runs one round (so the data moves while the caller goes on, as with
Horovod's background thread); ``synchronize``, ``poll``, ``barrier`` and ``join`` run rounds
until what they wait for is launched. ``HORA_CHECK_TENSORS=off`` skips negotiation: calls
launch at once in call order (no name matching, no join serving, no shape checks).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import HoraError
from hora.torch import _negotiation, _stall, _state, timeline
from hora.torch._comm import Comm, Entry, Launch, name_hash
from hora.torch._handles import SIG_LEN, Handle
from hora.torch._kinds import Kind
from hora.torch._negotiation import OPC_REFUSED, REFUSED_KEY, SERVERS, run_round

__all__ = [
    "SERVERS",
    "Comm",
    "GroupHandle",
    "begin",
    "check_in_step",
    "join",
    "launch_planned",
    "negotiate",
    "refusal",
    "refuse",
    "submit",
    "wait_launched",
]

_BACKOFF_S = (0.0, 0.0002, 0.001, 0.003, 0.01)


def negotiate() -> bool:
    """Return whether collectives are negotiated (``HORA_CHECK_TENSORS`` is not ``off``)."""
    raw = os.environ.get("HORA_CHECK_TENSORS", "on").lower()
    return raw not in ("0", "off", "false", "no")



def begin(comm: Comm, op: str, name: str | None) -> tuple[_state.RankState, str]:
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
        _negotiation.launch(handle, launch, rows, kind, name)
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
        f"{REFUSED_KEY}{comm.set_id}/{name}/{state.rank}", f"{type(error).__name__}: {error}"
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


def check_in_step(state: _state.RankState, op: str, name: str) -> None:
    """Refuse a collective once a deadlock left the ranks out of step (until ``init()``).

    Raises:
        HoraError: naming the deadlock and what to do.
    """
    if state.out_of_step:
        raise HoraError(
            f"{op} {name!r} not started: the ranks are out of step since a deadlock "
            f"({state.out_of_step}); call hvd.init() on every rank to start a new world"
        )



def join(comm: Comm) -> int:
    """Serve the other members' collectives until every member joined; return the last joiner."""
    state = _state.require_init(Kind.JOIN)
    check_in_step(state, Kind.JOIN, "")
    if comm.size == 1:
        return state.rank
    if not negotiate():  # no serving: wait for every member, name the last to arrive
        mine = torch.tensor([int(time.time() * 1e6), comm.index], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(comm.size)]
        _stall.run_guarded(Kind.JOIN, "", dist.all_gather, rows, mine, group=comm.side)
        return comm.ranks[int(max(rows, key=lambda r: (int(r[0]), int(r[1])))[1])]
    comm.joined = True
    comm.joined_at = int(time.time() * 1e6)
    comm.last_joined = -1
    backoff = 0
    while comm.joined:
        progressed = run_round(comm, Kind.JOIN, "")
        backoff = 0 if progressed else min(backoff + 1, len(_BACKOFF_S) - 1)
        if _BACKOFF_S[backoff] and comm.joined:
            time.sleep(_BACKOFF_S[backoff])
    check_in_step(state, Kind.JOIN, "")  # the members still in collectives deadlocked meanwhile
    return comm.last_joined

