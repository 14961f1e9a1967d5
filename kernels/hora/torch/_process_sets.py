"""Horovod process sets: collectives on a subset of the ranks (data plane).

A process set is a list of global ranks with its own torch.distributed groups (a data group
on the job's backend and a gloo side group for negotiation), created by every rank together:
``hvd.add_process_set(ranks)`` and ``hvd.remove_process_set(ps)`` are collectives of the
whole world (as with Horovod's dynamic process sets, ``HOROVOD_DYNAMIC_PROCESS_SETS``, which
hora does not need set), and ``hvd.init(process_sets=[...])`` adds sets at start-up. Every
collective takes ``process_set=``; ranks outside the set must not call it. Root ranks are
global ranks, as in Horovod.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from hora.torch import _engine, _state, basics
from hora.torch._engine import Comm
from hora.torch._handles import SIG_LEN
from hora.torch._kinds import Kind


class ProcessSet:
    """A set of ranks that collectives can run on (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks: the global ranks in the set; None means every rank (the global set).

    Example:
        >>> evens = hvd.add_process_set(range(0, hvd.size(), 2))  # doctest: +SKIP
        >>> if evens.included():  # doctest: +SKIP
        ...     hvd.allreduce(t, process_set=evens)
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: int | None = 0 if ranks is None else None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return (self.process_set_id, self.ranks) == (other.process_set_id, other.ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def size(self) -> int:
        """Return the number of ranks in the set."""
        return basics.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """Return this rank's position in the set, or -1 when it is not a member."""
        me = basics.rank()
        if self.ranks is None:
            return me
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        """Return whether this rank belongs to the set."""
        return self.ranks is None or basics.rank() in self.ranks


global_process_set = ProcessSet()


def _global(state: _state.RankState) -> Comm:
    comm = state.comms.get(0)
    if comm is None:
        comm = Comm(0, list(range(state.size)), state.rank, state.group, state.side_group)
        state.comms[0] = comm
    return comm


def comm_of(process_set: Any, op: str) -> Comm:
    """Return the communication state of ``process_set`` (None: the global set).

    Raises:
        NotInitializedError: before ``init()``.
        ValueError: the set was never added (or was removed), or this rank is not in it.
    """
    state = _state.require_init(op)
    if process_set is None or process_set is global_process_set:
        return _global(state)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{op}: process_set must be a hvd.ProcessSet, got {process_set!r}")
    if process_set.process_set_id == 0 or process_set.ranks == list(range(state.size)):
        return _global(state)
    comm = state.comms.get(process_set.process_set_id if process_set.process_set_id else -1)
    if comm is None or comm.ranks != process_set.ranks:
        raise ValueError(
            f"{op}: {process_set!r} is not registered; add it with hvd.add_process_set() "
            "(on every rank) first"
        )
    if comm.index < 0:
        raise ValueError(
            f"{op}: rank {state.rank} is not in the process set {comm.ranks}; only its "
            "members may call collectives on it"
        )
    return comm


def _ranks_key(opcode: int, ranks: Sequence[int]) -> tuple[int, ...]:
    crc = zlib.crc32(repr(list(ranks)).encode())
    return (opcode, crc, len(ranks), *([0] * (SIG_LEN - 3)))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Create a process set; every rank of the world must call it, with the same ranks.

    Args:
        process_set: a :class:`ProcessSet` (not registered yet) or a list of global ranks.

    Returns:
        The registered set (``process_set_id`` assigned).

    Raises:
        ValueError: ranks outside the world, an empty set, a set that exists already, or
            ranks that passed different lists (named).

    Example:
        >>> odd = hvd.add_process_set([1, 3])  # in a world of 4 or more  # doctest: +SKIP
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    comm = comm_of(None, Kind.ADD_PROCESS_SET)
    state, name = _engine.begin(comm, Kind.ADD_PROCESS_SET, None)
    with _engine.refusal(comm, Kind.ADD_PROCESS_SET, name):
        if ps.ranks is None:
            raise ValueError("add_process_set: the global set exists already")
        if ps.process_set_id not in (None,):
            raise ValueError(f"add_process_set: {ps!r} is registered already")
        bad = [r for r in ps.ranks if not 0 <= r < state.size]
        if not ps.ranks or bad:
            raise ValueError(
                f"add_process_set: ranks {ps.ranks} must be a non-empty list of ranks in "
                f"[0, {state.size})"
            )
        if any(c.ranks == ps.ranks for c in state.comms.values()):
            raise ValueError(f"add_process_set: a process set with ranks {ps.ranks} exists already")
    ranks = list(ps.ranks)  # type: ignore[arg-type]

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        timeout = datetime.timedelta(seconds=state.timeout_s)
        group = dist.new_group(ranks=ranks, timeout=timeout, backend=state.backend)
        side = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
        set_id = max(state.comms) + 1 if state.comms else 1
        index = ranks.index(state.rank) if state.rank in ranks else -1
        if index < 0:  # a non-member gets a marker (GroupMember.NON_GROUP_MEMBER), not a group
            group = side = None
        state.comms[set_id] = Comm(set_id, ranks, index, group, side)
        ps.process_set_id = set_id
        return [], lambda: ps

    _global(state)
    key = _ranks_key(Kind.ADD_PROCESS_SET.code, ranks)
    return _engine.submit(comm, Kind.ADD_PROCESS_SET, name, key, [], launch).wait()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added before; every rank of the world must call it.

    Returns:
        True when the set was removed, False when it was not registered (or is the global set).

    Example:
        >>> hvd.remove_process_set(odd)  # doctest: +SKIP
    """
    comm = comm_of(None, Kind.REMOVE_PROCESS_SET)
    state, name = _engine.begin(comm, Kind.REMOVE_PROCESS_SET, None)
    set_id = getattr(process_set, "process_set_id", None)
    target = state.comms.get(set_id) if set_id else None
    ranks = target.ranks if target is not None else []

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        if target is None:
            return [], lambda: False
        del state.comms[target.set_id]
        for group in (target.group, target.side):
            if group is None:
                continue
            try:
                dist.destroy_process_group(group)
            except Exception:  # already gone with a failed world: nothing to free
                pass
        target.group = target.side = None  # an optimizer may still hold the Comm
        if target.shm_lane is not None:
            target.shm_lane.close()
            target.shm_lane = None
        if target.shm is not None:
            target.shm.close()
            target.shm = None
        process_set.process_set_id = None
        return [], lambda: True

    key = _ranks_key(Kind.REMOVE_PROCESS_SET.code, ranks)
    return bool(_engine.submit(comm, Kind.REMOVE_PROCESS_SET, name, key, [], launch).wait())


def add_initial(sets: Sequence[ProcessSet | Sequence[int]]) -> None:
    """Add ``init(process_sets=...)``'s sets (every rank passes the same list)."""
    for ps in sets:
        add_process_set(ps)


def _add_at_init(_environ: Mapping[str, str], sets: Sequence[Any] | None) -> None:
    """``init()``'s hook: add its ``process_sets`` (after the timeline started)."""
    if sets:
        add_initial(sets)


_state.register_init_hook(_add_at_init)
