"""barrier, join and the picklable-object collectives (data plane).

Objects travel on the gloo side group (so they work under NCCL too); ``join`` takes part in
the negotiation rounds (:mod:`hora.torch._engine`) and serves the others' allreduces.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from hora.torch import _engine, _stall
from hora.torch._engine import begin, refusal, submit
from hora.torch._handles import SIG_LEN
from hora.torch._kinds import Kind
from hora.torch._process_sets import ProcessSet, comm_of, global_process_set


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) reaches the barrier.

    Raises:
        CollectiveTimeout: ranks never arrived within the timeout (named).
        RankFailedError: a rank died (named).

    Example:
        >>> hvd.barrier()
    """
    comm = comm_of(process_set, Kind.BARRIER)
    state, name = begin(comm, Kind.BARRIER, None)
    key = (Kind.BARRIER.code, *([0] * (SIG_LEN - 1)))
    submit(comm, Kind.BARRIER, name, key, [], lambda _rows: ([], lambda: None)).wait()


def join(device: int = -1) -> int:
    """Serve the other ranks' collectives until every rank has joined; return the last to join.

    As in Horovod, a rank that ran out of work calls ``join()``; until every rank has, it takes
    part in the others' allreduces with zeros (an average still divides by the world size).
    Any other collective (allgather, broadcast, alltoall, reducescatter, barrier, objects)
    fails with UnsupportedError on every rank that called it while a rank has joined, as
    Horovod's do.

    Args:
        device: accepted for Horovod compatibility (unused).

    Returns:
        The global rank of the last rank to join (the same on every rank).

    Raises:
        CollectiveTimeout: ranks that never joined within the timeout (named).

    Example:
        >>> last = hvd.join()
    """
    comm = comm_of(None, Kind.JOIN)
    begin(comm, Kind.JOIN, None)
    return _engine.join(comm)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return root's picklable ``obj`` on every rank.

    Args:
        obj: any picklable object (only root's value matters).
        root_rank: the rank whose object everyone receives.
        name: a name for error messages.
        process_set: the process set to run on (default: every rank).

    Returns:
        Root's object (a copy on other ranks).

    Example:
        >>> cfg = hvd.broadcast_object({"lr": 0.1} if hvd.rank() == 0 else None)
    """
    comm = comm_of(process_set, Kind.BROADCAST_OBJECT)
    state, name = begin(comm, Kind.BROADCAST_OBJECT, name)
    with refusal(comm, Kind.BROADCAST_OBJECT, name):
        if not isinstance(root_rank, int) or root_rank not in comm.ranks:
            raise ValueError(f"root_rank={root_rank!r} is outside the ranks {comm.ranks}")
    key = (Kind.BROADCAST_OBJECT.code, root_rank, *([0] * (SIG_LEN - 2)))

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        box = [obj]
        if comm.size > 1:
            _stall.run_guarded(Kind.BROADCAST_OBJECT, name, dist.broadcast_object_list, box,
                               src=root_rank, group=comm.side)  # fmt: skip
        return [], lambda: box[0]

    return submit(comm, Kind.BROADCAST_OBJECT, name, key, [], launch).wait()


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order.

    Example:
        >>> losses = hvd.allgather_object(float(loss))
    """
    comm = comm_of(process_set, Kind.ALLGATHER_OBJECT)
    state, name = begin(comm, Kind.ALLGATHER_OBJECT, name)
    key = (Kind.ALLGATHER_OBJECT.code, *([0] * (SIG_LEN - 1)))

    def launch(_rows: Any) -> tuple[list[Any], Any]:
        out: list[Any] = [None] * comm.size
        if comm.size == 1:
            return [], lambda: [obj]
        _stall.run_guarded(Kind.ALLGATHER_OBJECT, name, dist.all_gather_object, out, obj,
                           group=comm.side)  # fmt: skip
        return [], lambda: out

    return submit(comm, Kind.ALLGATHER_OBJECT, name, key, [], launch).wait()  # type: ignore[no-any-return]
