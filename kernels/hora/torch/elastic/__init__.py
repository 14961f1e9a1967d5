"""hora.torch.elastic: Horovod's elastic training API on hora.torch (data plane).

A training function decorated with :func:`run` takes a :class:`TorchState` first. When a
collective fails because a peer died (:class:`~hora.errors.HorovodInternalError`), every
surviving rank goes back to the last ``state.commit()``, ``hvd.init()`` joins the driver's
next world (``hora run --min-np A --max-np B``: the survivors keep their processes; a
replacement joins at a later commit), the reset callbacks run, rank 0 (the lowest surviving
rank) syncs its state to the others, and the function is called again. When the driver adds
or removes workers, ``state.commit()`` raises :class:`~hora.errors.HostsUpdatedInterrupt`
on every rank at the same commit, and the world is re-formed without losing the commit::

    import hora.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch): ...
            state.commit()

    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

Outside an elastic ``hora run`` the same script runs as a fixed world (commits are kept in
memory; nothing can change the world).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from hora.errors import (
    CollectiveTimeout,
    HoraError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RankFailedError,
)
from hora.torch import _state, optimizer
from hora.torch.elastic import _world
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.state import ObjectState, State, StateHandler, TorchState

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "StateHandler",
    "TorchState",
    "run",
]

log = logging.getLogger("hora.torch.elastic")
_state.set_world_source(_world.elastic_world)

R = TypeVar("R")
# What a peer's death (or a broken world) looks like from a collective: Horovod's error
# (hora's PeerFailedError), hora's others, torch.distributed's when called directly
_WORLD_FAILURES = (HorovodInternalError, RankFailedError, CollectiveTimeout, dist.DistError)


def _is_world_failure(e: BaseException) -> bool:
    if isinstance(e, _WORLD_FAILURES):
        return True
    st = _state.current()
    return isinstance(e, HoraError) and (st is None or st.broken or bool(st.out_of_step))


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Make ``func(state, ...)`` elastic: retried from the last commit in each new world.

    Args:
        func: the training function; its first argument is a :class:`State`.

    Returns:
        The wrapped function (same signature); it returns what ``func`` returns.

    Raises:
        Whatever ``func`` raises other than a failed collective or a host update.

    Example:
        >>> @hvd.elastic.run
        ... def train(state): ...
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                log.info("elastic: the hosts changed; re-forming the world at this commit")
                skip_sync = e.skip_sync
            except Exception as e:
                if not _is_world_failure(e):
                    raise
                log.warning("elastic: %s; back to the last commit, re-forming the world", e)
                state.restore()
                skip_sync = False
            _reset()
            state.on_reset()

    return wrapper


def _reset() -> None:
    """Leave the current world and join the driver's next one.

    ``init()`` itself joins a later generation when a member dies while this one forms.
    """
    _world.forget_posted()
    st = _state.current()
    if st is not None:
        st.broken = True  # a world that failed may never finish its work: abort, not wait
    _state.shutdown()
    _state.init()
    optimizer.rebind_all()
