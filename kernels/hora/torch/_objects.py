"""barrier, join and the picklable-object collectives (data plane).

Objects travel on the gloo side group (so they work under NCCL too); ``join`` counts ranks in
the rendezvous store, so it needs no collective of its own and a missing rank is named.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from hora.errors import CollectiveTimeout
from hora.torch import _stall
from hora.torch._handles import begin
from hora.torch._process_sets import ProcessSet, check_process_set, global_process_set


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank reaches the barrier.

    Raises:
        CollectiveTimeout: ranks never arrived within the timeout (named).
        RankFailedError: a rank died (named).

    Example:
        >>> hvd.barrier()
    """
    state, name = begin("barrier", None)
    check_process_set(process_set)
    if state.size > 1:
        work = _stall.run_guarded(
            "barrier", name, dist.barrier, group=state.side_group, async_op=True
        )
        _stall.wait_work(work, "barrier", name)


def join(device: int = -1) -> int:
    """Wait until every rank has joined; return the rank that joined last.

    Unlike Horovod, a joined rank does not serve other ranks' allreduces with zeros: call
    ``join()`` after each rank's last collective (e.g. after a loop over uneven data, with
    collectives outside the uneven part).

    Args:
        device: accepted for Horovod compatibility (unused).

    Returns:
        The global rank of the last rank to join.

    Raises:
        CollectiveTimeout: ranks that never joined within the timeout (named).

    Example:
        >>> last = hvd.join()
    """
    state, _ = begin("join", None)
    state.join_epoch += 1
    key = f"hora/join/{state.join_epoch}"
    state.store.set(f"{key}/r{state.rank}", "1")
    if state.store.add(f"{key}/count", 1) == state.size:
        state.store.set(f"{key}/last", str(state.rank))
    try:
        state.store.wait([f"{key}/last"], datetime.timedelta(seconds=state.timeout_s))
    except Exception as e:
        missing = _not_joined(state, key)
        if missing is None:
            raise _stall.diagnose("join", "", e) from None
        raise CollectiveTimeout("join", missing, state.timeout_s) from None
    return int(state.store.get(f"{key}/last"))


def _not_joined(state: Any, key: str) -> list[int] | None:
    try:
        return [r for r in range(state.size) if not state.store.check([f"{key}/r{r}"])]
    except Exception:
        return None


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
        process_set: only the global set.

    Returns:
        Root's object (a copy on other ranks).

    Example:
        >>> cfg = hvd.broadcast_object({"lr": 0.1} if hvd.rank() == 0 else None)
    """
    state, name = begin("broadcast_object", name)
    check_process_set(process_set)
    if not isinstance(root_rank, int) or not 0 <= root_rank < state.size:
        raise ValueError(f"root_rank={root_rank!r} is outside the world of size {state.size}")
    box = [obj]
    if state.size > 1:
        _stall.run_guarded(
            "broadcast_object",
            name,
            dist.broadcast_object_list,
            box,
            src=root_rank,
            group=state.side_group,
        )
    return box[0]


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order.

    Example:
        >>> losses = hvd.allgather_object(float(loss))
    """
    state, name = begin("allgather_object", name)
    check_process_set(process_set)
    out: list[Any] = [None] * state.size
    if state.size == 1:
        return [obj]
    _stall.run_guarded(
        "allgather_object", name, dist.all_gather_object, out, obj, group=state.side_group
    )
    return out
