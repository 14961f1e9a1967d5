"""Hierarchical allreduce for CPU buckets of a world spread over hosts (data plane).

Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` idea on hora's own paths. When the members of
the global process set run on several hosts, a DistributedOptimizer bucket is reduced in
three steps instead of one flat gloo allreduce over every rank:

1. the ranks of each host sum it through that host's shared-memory segment
   (:meth:`hora.torch._shm.Ring.allreduce_`);
2. one leader per host (its lowest rank) allreduces the host sums over a gloo group of the
   leaders only, so each host sends its bucket across the network once, not once per rank;
3. each leader hands the result to its host's ranks through the segment
   (:meth:`~hora.torch._shm.Ring.broadcast_`).

A host with one rank has no segment: its rank is its own leader. Every rank ends with the
same bits (the leaders' allreduce gives them the same sum; the others copy a leader's).

On by default when the world spans hosts and some host runs two or more ranks;
``HORA_HIERARCHICAL_ALLREDUCE=0`` (or Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE=0``) keeps the
flat gloo allreduce. Only the global set uses it (the leaders' group is created by every
rank of the world, at the same point: the first bucket). Which host a rank counts as is its
host name, or ``HORA_HOST_KEY``. Negotiation rounds across hosts stay on the side group.

A failure stays named: a leader whose gloo allreduce fails (a peer died, a timeout) aborts its
host's segment, so the ranks waiting there fail at once, naming it, instead of timing out.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from hora.torch import _cpus, _shm, _state
from hora.torch._stall import run_guarded

log = logging.getLogger(__name__)

_KNOBS = ("HORA_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE")


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether the hierarchical path may be used (the knobs above; default yes).

    Example:
        >>> wanted({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}), wanted({})
        (False, True)
    """
    env = os.environ if environ is None else environ
    for knob in _KNOBS:
        if env.get(knob, "").strip().lower() in ("0", "off", "false", "no"):
            return False
    return True


def by_host(hosts: list[Any]) -> list[list[int]]:
    """Member indices grouped by host, each group ascending, groups by their first member.

    Example:
        >>> by_host(["a", "b", "a", "b", "c"])
        [[0, 2], [1, 3], [4]]
    """
    groups: dict[Any, list[int]] = {}
    for i, h in enumerate(hosts):
        groups.setdefault(h, []).append(i)
    return sorted(groups.values())


class Hier:
    """The hierarchical path on this rank: its host's segment (None alone) and the leaders."""

    def __init__(self, local: _shm.Ring | None, leaders: Any, leader: bool) -> None:
        self.local, self.leaders, self.leader = local, leaders, leader

    def allreduce_(self, t: torch.Tensor, op: str, name: str) -> None:
        """Sum ``t`` (contiguous, CPU) over every member, in place (see the module docstring)."""
        if self.local is not None:
            self.local.allreduce_(t, op, name)
        if self.leader:
            try:
                run_guarded(op, name, dist.all_reduce, t, group=self.leaders)
            except BaseException as e:
                if self.local is not None:  # the host's ranks wait for this leader: tell them
                    self.local.abort(f"its host's leader failed in {op} {name!r} "
                                     f"({type(e).__name__})")
                raise
        if self.local is not None:
            self.local.broadcast_(t, op, name)

    def allgather_ints(self, mine: list[int], op: str, name: str,
                       what: str = "") -> list[list[int]] | None:
        """None: the negotiation tables of a world over hosts go over the side group."""
        return None

    def abort(self, reason: str = "the process group was aborted") -> None:
        if self.local is not None:
            self.local.abort(reason)

    def close(self, abort: bool = False) -> None:
        if self.local is not None:
            self.local.close(abort)
        self.leaders = None


def ring_of(comm: Any, op: str) -> _shm.Ring | Hier | None:
    """The process set's shared-memory path, decided together at every member's first call.

    The members tell each other their host (:func:`hora.torch._shm.host_key`), whether
    they want the hierarchical path and the CPUs they can run on (:mod:`hora.torch._cpus`):
    on one host, the host's segment (:func:`hora.torch._shm.ring_of`); on several, the
    hierarchical path when every member wants it and it can be set up, else None (gloo
    carries the buckets flat). Every member gets the same kind of answer.
    """
    if comm.shm_decided:
        return comm.shm  # type: ignore[no-any-return]
    if comm.size < 2 or comm.side is None:
        comm.shm_decided = True
        return None
    rows: list[Any] = [None] * comm.size
    run_guarded(op, "shm", dist.all_gather_object, rows, (_shm.host_key(), wanted(),
                _cpus.mine()), group=comm.side)  # fmt: skip
    hosts = [r[0] for r in rows]
    if len(set(hosts)) == 1:
        return _shm.ring_of(comm, op, cpus=_cpus.at_once(r[2] for r in rows))
    comm.shm_decided = True
    comm.shm = _across(comm, op, rows) if all(r[1] for r in rows) else None
    return comm.shm  # type: ignore[no-any-return]


def _across(comm: Any, op: str, rows: list[Any]) -> Hier | None:
    """Set up the path over hosts; None on every member when it cannot be used.

    ``rows``: every member's (host, wants the path, its CPUs), as gathered by :func:`ring_of`.
    """
    groups = by_host([r[0] for r in rows])
    if comm.set_id != 0 or max(len(g) for g in groups) < 2:
        return None
    me = comm.index
    mine = next(g for g in groups if me in g)
    n = len(mine)
    crowded = n > _cpus.at_once(rows[i][2] for i in mine)
    want = _shm.enabled()
    # the buckets' ring only: no lane over hosts
    made = _shm.create_for(n, crowded, rings=1) if (want and n > 1 and me == mine[0]) else ("", 0)
    made_by: list[Any] = [None] * comm.size
    run_guarded(op, "shm", dist.all_gather_object, made_by, made, group=comm.side)
    path, slot = made_by[mine[0]]
    local = None
    if n > 1 and want and path:
        mm = _shm.open_segment(path, _shm.segment_bytes(n, rings=1, slot=slot))
        if mm is not None:
            local = _shm.Ring(mm, [comm.ranks[i] for i in mine], mine.index(me), slot)
            local.publish_pid()
    flag = torch.tensor([1 if (n == 1 or local is not None) else 0], dtype=torch.int64)
    run_guarded(op, "shm", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=comm.side)
    if made[0]:
        with contextlib.suppress(OSError):
            os.unlink(made[0])
    if int(flag.item()) == 0:
        if local is not None:
            local.close()
        log.debug("%s: some host's ranks cannot share memory; gloo carries the buckets", op)
        return None
    if local is not None:
        local.read_pids()
    # every rank of the world creates the leaders' group (set 0 is the world)
    timeout = datetime.timedelta(seconds=_state.require_init(op).timeout_s)
    leaders = dist.new_group([comm.ranks[g[0]] for g in groups], timeout=timeout,
                             backend="gloo")
    run_guarded(op, "shm", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=comm.side)
    log.debug("%s: hierarchical allreduce over %d hosts", op, len(groups))
    return Hier(local, leaders, me == mine[0])
