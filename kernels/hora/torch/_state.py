"""Process-wide state of hora.torch: the lifecycle core (data plane).

``init()`` reads the world from whichever launcher started the process
(:func:`hora.env.detect_world`, or the elastic layer's world source), meets the other ranks
and creates torch.distributed's *default* process group (:mod:`hora.torch._rendezvous`), so
plain ``torch.distributed`` calls and DDP work in the same script, and starts the rank's
:class:`~hora.torch._heartbeat.StallHeartbeat`. If the user already called
``init_process_group`` that group is adopted instead. ``shutdown()``, the exit handler, a
failed world's drop and ``rebuild()`` release what it made. :func:`current` is the one way
other modules read the state; the world queries are :mod:`hora.torch.basics`.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import socket
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hora.env import World, detect_world
from hora.errors import (
    CollectiveTimeout,
    NotInitializedError,
    RendezvousError,
    UnsupportedError,
)
from hora.torch import _dist, _rendezvous
from hora.torch._heartbeat import StallHeartbeat, await_os_threads_end, torch_thread_ids

log = logging.getLogger("hora.torch")



@dataclass
class RankState:
    """Everything hora.torch knows about this process's place in the job.

    Attributes:
        rank: global rank.
        size: world size.
        local_rank: rank on this host.
        local_size: ranks on this host.
        cross_rank: host index.
        cross_size: number of hosts.
        device: ``cuda:local_rank`` with NCCL, else ``cpu``.
        backend: torch.distributed backend name ("nccl" or "gloo").
        timeout_s: timeout for each collective, in seconds (the rendezvous waits
            ``HORA_START_TIMEOUT`` instead when that is set).
        group: the default process group.
        side_group: a gloo group for small CPU metadata exchanges (shape checks, objects).
        store: the rendezvous store (heartbeats, join).
        launcher: which launcher started the process.
        owns_group: whether init() created the default group (shutdown then destroys it).
        seq: number of collectives this rank has entered (the stall report compares them).
        last_op: the collective this rank entered last, for the stall report.
        last_sig: CRC of the last collective's op/dtype/shape, for the stall report.
        comms: the process sets' communication state by id (0: the global set), see
            :mod:`hora.torch._engine`.
        broken: a collective timed out, lost a rank or deadlocked: ``init()`` starts anew.
        out_of_step: why the ranks are at different points of the script (a deadlock);
            collectives are refused until ``init()`` ("" while they are in step).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    device: torch.device
    backend: str
    timeout_s: float
    group: Any
    side_group: Any
    store: Any
    launcher: str
    owns_group: bool
    seq: int = 0
    last_op: str = ""
    last_sig: int = 0
    broken: bool = False
    out_of_step: str = ""
    rdzv_file: Path | None = None
    heartbeat: Any = None  # hora.torch._heartbeat.StallHeartbeat, while init()'s world lives
    comms: dict[int, Any] = field(default_factory=dict)
    host_watch: socket.socket | None = None
    excepthooks: tuple[Any, Any] | None = None
    timeout_td: datetime.timedelta = field(init=False)

    def __post_init__(self) -> None:
        self.timeout_td = datetime.timedelta(seconds=self.timeout_s)



_STATE: RankState | None = None
# whether the last world this process left (shutdown(), or init() after a failure) had failed
_LEFT_BROKEN: list[bool] = [False]

# Hooks of the upper layers (timeline, handles, process sets), registered when they are
# imported (``hora.torch`` imports them all), so this module imports none of them.
InitHook = Callable[[Mapping[str, str], Sequence[Any] | None], None]
StopHook = Callable[[bool], None]
_INIT_HOOKS: list[InitHook] = []
_STOP_HOOKS: list[StopHook] = []
_RELEASE_HOOKS: list[Callable[[], None]] = []


# Where init() learns its world: ``source(environ, failure)`` returns it; after a failed
# rendezvous it is asked again with the failure, and raises to give up. By default the
# launcher's variables, once; hora.torch.elastic (under ``hora run --min-np/--max-np``)
# registers its rendezvous, whose next generation replaces a member that died meanwhile.
WorldSource = Callable[[dict[str, str], "CollectiveTimeout | RendezvousError | None"], World]


def _launcher_world(
    environ: dict[str, str], failure: CollectiveTimeout | RendezvousError | None
) -> World:
    if failure is not None:
        raise failure
    return detect_world(environ)


_WORLD_SOURCE: list[WorldSource] = [_launcher_world]


def set_world_source(fn: WorldSource) -> None:
    """Make ``init()`` ask ``fn(environ, failure)`` for its world (see ``WorldSource``)."""
    _WORLD_SOURCE[0] = fn


def register_init_hook(fn: InitHook) -> None:
    """Call ``fn(environ, process_sets)`` at the end of every ``init()``, in registration order.

    The timeline registers before the process sets (it is a lower layer, imported first), so
    ``init(process_sets=...)`` adds its sets with the timeline already recording.
    """
    _INIT_HOOKS.append(fn)


def register_stop_hook(fn: StopHook) -> None:
    """Call ``fn(exiting)`` first thing in ``shutdown()`` (False) and at exit without it (True)."""
    _STOP_HOOKS.append(fn)


def register_release_hook(fn: Callable[[], None]) -> None:
    """Call ``fn()`` once the state is dropped by ``shutdown()`` or after a failed collective."""
    _RELEASE_HOOKS.append(fn)


def current() -> RankState | None:
    """The state ``init()`` made, None before it (or after ``shutdown()``).

    What the engines, the timeline and the elastic layer read; they never assign it.
    """
    return _STATE


def require_init(op: str) -> RankState:
    """Return the state, or raise NotInitializedError naming ``op``.

    Args:
        op: the public name of the operation being called (e.g. "allreduce").

    Returns:
        The process-wide :class:`RankState`.

    Raises:
        NotInitializedError: when ``init()`` has not run (or ``shutdown()`` ran).
    """
    if _STATE is None:
        raise NotInitializedError(op)
    return _STATE


def _start(world: World, backend: str, start_s: float, timeout_s: float) -> RankState:
    state = _connect(world, backend, start_s, timeout_s)
    state.heartbeat = StallHeartbeat(state, state.store)
    if state.owns_group:  # rank 0 hosts the store: it leaves only once no rank needs it
        try:
            _rendezvous.all_ready(state.store, state.rank, state.size, start_s)
        except CollectiveTimeout:
            _stop_heartbeat(state)
            _dist.abort_default_group()  # a later try must not adopt this half-made world
            raise
    return state


def _connect(world: World, backend: str, start_s: float, timeout_s: float) -> RankState:
    """Rendezvous, create (or adopt) the default group and the side group; no heartbeat yet."""
    adopted = dist.is_initialized()
    hook = sys.excepthook
    world, backend, store, rdzv = _rendezvous.create_group(world, backend, start_s, timeout_s)
    watch = None if adopted else _watch_host(world)
    device = torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", _rendezvous.world_device_index(world))
        torch.cuda.set_device(device)
    try:
        side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:  # rank 0, the store's host, went away
        if not adopted:  # a later try must not adopt this half-made world
            _dist.abort_default_group()
        where = f"{world.master_addr}:{world.master_port}"
        raise RendezvousError(where, f"the side group could not be formed: {e}") from None
    state = RankState(
        rank=world.rank,
        size=world.size,
        local_rank=world.local_rank,
        local_size=world.local_size,
        cross_rank=world.cross_rank,
        cross_size=world.cross_size,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        group=dist.group.WORLD,
        side_group=side,
        store=store,
        launcher=world.launcher,
        owns_group=not adopted,
        rdzv_file=rdzv,
        host_watch=watch,
        excepthooks=None if sys.excepthook is hook else (hook, sys.excepthook),
    )
    return state


def init(
    comm: Any = None,
    process_sets: Any = None,
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> None:
    """Initialise hora.torch (and torch.distributed's default process group).

    Args:
        comm: Horovod's MPI communicator argument; only None is supported.
        process_sets: process sets to add at start-up (every rank passes the same list of
            ``hvd.ProcessSet`` or rank lists); see ``hvd.add_process_set``.
        backend: "nccl" or "gloo"; default NCCL when CUDA is available, else gloo, or the
            ``HORA_BACKEND`` environment variable.
        timeout: seconds (or a timedelta) for the rendezvous and for each collective; default
            the ``HORA_TIMEOUT`` environment variable, else 60. Without it, the rendezvous
            waits ``HORA_START_TIMEOUT`` seconds when that is set (``hora run
            --start-timeout``).

    Raises:
        UnsupportedError: for an MPI communicator.
        LauncherEnvError: when the launcher's environment is inconsistent.
        CollectiveTimeout: when the rendezvous does not complete in time.

    Example:
        >>> import hora.torch as hvd
        >>> hvd.init()
        >>> hvd.size() >= 1
        True
    """
    global _STATE
    if comm is not None:
        raise UnsupportedError("hvd.init(comm=...) needs MPI; hora.torch runs on torch.distributed")
    if _STATE is not None:
        if not _STATE.broken:
            return
        _drop_broken()
    environ = dict(os.environ)
    failure: CollectiveTimeout | RendezvousError | None = None
    while _STATE is None:
        world = _WORLD_SOURCE[0](environ, failure)
        timeout_s = _rendezvous.collective_timeout(timeout, environ)
        start_s = _rendezvous.start_timeout(timeout, environ, timeout_s)
        try:
            _STATE = _start(world, _rendezvous.backend_of(backend, environ), start_s, timeout_s)
        except (CollectiveTimeout, RendezvousError) as e:
            failure = e
    log.debug(
        "hora.torch initialised: rank %d of %d (%s)", _STATE.rank, _STATE.size, _STATE.backend
    )
    atexit.register(_at_exit)  # once per process: register() of a registered function is a no-op
    for hook in _INIT_HOOKS:  # the timeline starts, then init(process_sets=...) adds its sets
        hook(environ, process_sets)


def _stop_heartbeat(state: RankState) -> None:
    if state.heartbeat is not None:
        state.heartbeat.stop()


# How long a release waits for the OS threads of the groups and store it freed to leave
_THREADS_END_WAIT_S = 0.5


def _release(state: RankState, *, graceful: bool, abort_shm: bool | None = None) -> None:
    """Free the groups init() made, the store and its connections, while Python is alive.

    gloo's worker threads drop the last reference to a finished Work (and the tensors it
    holds) after the Python side saw it complete. If that happens while the interpreter is
    finalizing, the thread's GIL request ends it with ``pthread_exit``, whose unwinding
    through C++ calls ``std::terminate``: the process dies with "terminate called without an
    active exception" (SIGABRT, exit 134) instead of its own exit code. Destroying the groups
    first joins those threads (pybind releases the GIL for it).

    Args:
        state: the state being released (already detached from ``_STATE``).
        graceful: destroy the groups (in-flight work completes or times out) rather than
            abort them (their connections close at once; in-flight work fails).
        abort_shm: mark the shared-memory ring aborted (default: when not graceful).
    """
    # a world hora made: its release ends this process's torch threads, waited for below
    threads = torch_thread_ids() if state.owns_group else set()
    if state.owns_group and dist.is_initialized():
        try:
            if graceful:
                dist.destroy_process_group()
            else:
                _dist.abort_default_group()
        except Exception as e:  # a group already aborted by a failure: nothing left to free
            log.debug("releasing the process group: %s", e)
    _restore_excepthook(state)
    held = [weakref.ref(o) for o in (state.group, state.side_group, state.store) if o is not None]
    state.group = state.side_group = state.store = state.heartbeat = None
    for comm in state.comms.values():  # an optimizer or a traceback may still hold one
        held += _drop_comm(comm, abort=not graceful if abort_shm is None else abort_shm)
        comm.pending.clear()
        comm.inflight.clear()
    state.comms = {}
    # A group left in a reference cycle (with its Works, a hook's closure) keeps its gloo
    # threads, sockets and rank 0's port. A full collection costs ~0.1 s with torch loaded, so
    # it runs only when a young one did not free them.
    gc.collect(1)
    if any(ref() is not None for ref in held):
        gc.collect()
    if threads and not any(ref() is not None for ref in held):
        await_os_threads_end(threads, _THREADS_END_WAIT_S)  # an exit handler after ours sees none


def _drop_comm(comm: Any, abort: bool) -> list[weakref.ref[Any]]:
    """Let go of one communicator's groups and shared-memory ring; weak references to them.

    Used by shutdown() and abort(). A function of its own so that no local of the caller
    still holds a group when it checks whether they are gone (a loop variable did, and every
    shutdown paid a full collection that could not free it).
    """
    groups = [g for g in (comm.group, comm.side) if isinstance(g, dist.ProcessGroup)]
    comm.group = comm.side = None
    if comm.shm_lane is not None:  # its thread leaves first (hora.torch._lane.Lane)
        comm.shm_lane.close(abort=abort)
        comm.shm_lane = None
    if comm.shm is not None:  # the shared-memory segment (hora.torch._shm.Ring)
        comm.shm.close(abort=abort)  # aborted: members waiting in it fail at once
        comm.shm = None
    return [weakref.ref(g) for g in groups]


def _restore_excepthook(state: RankState) -> None:
    """Put back the ``sys.excepthook`` that ``init_process_group`` wrapped.

    torch wraps the hook (to prefix tracebacks with the rank) at every
    ``init_process_group`` and never unwraps it: without this, every ``init()`` after a
    ``shutdown()`` would add a closure to the chain (and a ``[rank0]:`` to each traceback line).
    A hook the user installed since is left alone.
    """
    if state.excepthooks is not None:
        before, installed = state.excepthooks
        if sys.excepthook is installed:
            sys.excepthook = before
        state.excepthooks = None


def _at_exit() -> None:
    """Release everything ``shutdown()`` would, when the script exits without it.

    The groups are aborted rather than destroyed: an exiting rank must not wait for a
    collective its peers never join (a failing rank would otherwise hold everyone until the
    timeout). Finished work is unaffected.
    """
    global _STATE
    state = _STATE
    if state is None:
        return
    for stop in _STOP_HOOKS:
        stop(True)
    _stop_heartbeat(state)
    _STATE = None
    # An exiting rank finished every ring operation it entered (one it left early marked
    # the ring itself): a peer still reading the last one's result must not see it aborted;
    # a peer waiting for one this rank never joins finds its process gone (_shm.PID_CHECK_S)
    _release(state, graceful=False, abort_shm=False)
    _await_host_close(state, 0.0)
    if state.rdzv_file is not None:  # every rank found the store long ago
        state.rdzv_file.unlink(missing_ok=True)


def _drop_broken() -> None:
    """Abort and free a world whose collective timed out or lost a rank, so init() starts anew.

    After such a failure the ranks may disagree on which collectives ran; a script (or
    Horovod's test suite, whose ``tearDown`` barrier then fails before its ``shutdown()``)
    calls ``init()`` again, and every rank that saw the failure re-initialises.
    """
    global _STATE
    state = _STATE
    if state is None:
        return
    log.warning("hora.torch: the last collective failed; init() starts a new world")
    _stop_heartbeat(state)
    _STATE = None
    _LEFT_BROKEN[0] = True
    for release in _RELEASE_HOOKS:
        release()
    _release(state, graceful=False)
    _await_host_close(state, 0.0)
    if state.rdzv_file is not None:
        state.rdzv_file.unlink(missing_ok=True)


def shutdown() -> None:
    """Stop hora.torch: flush the timeline, stop the heartbeat, destroy the group init() made.

    A group adopted from the user is left alone. Calling it twice is harmless.

    Example:
        >>> hvd.shutdown()
    """
    global _STATE
    state = _STATE
    if state is None:
        return
    for stop in _STOP_HOOKS:
        stop(False)
    _stop_heartbeat(state)
    _STATE = None
    _LEFT_BROKEN[0] = state.broken
    for release in _RELEASE_HOOKS:
        release()
    _release(state, graceful=not state.broken)  # a failed world may never finish its work
    if state.rdzv_file is not None:
        state.rdzv_file.unlink(missing_ok=True)
    _await_host_close(state, 0.0 if state.broken else _HOST_CLOSE_WAIT_S)


# How long shutdown() on a rank other than 0 waits for rank 0 to close the rendezvous store,
# and then for its listening socket to go
_HOST_CLOSE_WAIT_S = 1.0
_LISTENER_GONE_WAIT_S = 0.02


def _watch_host(world: World) -> socket.socket | None:
    """On a rank other than 0, a plain connection to rank 0's store, to see it close.

    The port is the launcher's, so the next ``init()`` reopens the store there. Under
    Horovod's pattern (``barrier(); shutdown()`` on every rank, then ``init()``) a rank that
    finished its shutdown first would reach rank 0's store while it closes: the connection
    reset costs TCPStore's connect retry 0.3-1 s. ``shutdown()`` waits for this connection
    to end instead (the server drops it on closing), without a word in torch's log.
    """
    if world.rank == 0 or world.master_addr is None or world.master_port is None:
        return None
    try:
        return socket.create_connection((world.master_addr, world.master_port), timeout=5.0)
    except OSError:  # rank 0 already left; nothing to wait for
        return None


def _await_host_close(state: RankState, timeout_s: float) -> None:
    """Wait at most ``timeout_s`` for rank 0 to close its store; a slower rank 0 costs that.

    The server drops its connections a moment before its listening socket: once the watch
    connection ended, wait (briefly) for the port to refuse connections too.
    """
    watch, state.host_watch = state.host_watch, None
    if watch is None:
        return
    try:
        if timeout_s <= 0:
            return
        address = watch.getpeername()[:2]
        watch.settimeout(timeout_s)
        watch.recv(1)  # b"" (or a reset) once the server closed the connection
    except OSError:
        return  # the wait ran out, or rank 0 had gone before
    finally:
        watch.close()
    try:
        probe = socket.create_connection(address, timeout=_LISTENER_GONE_WAIT_S)
    except OSError:
        return  # the old socket is gone and no new one is open yet
    with probe:  # the old socket closing drops this connection; rank 0's next store keeps it
        probe.settimeout(_LISTENER_GONE_WAIT_S)
        try:
            probe.recv(1)
        except OSError:
            pass


# What rebuild() takes from the fresh connection into the RankState objects already hold
_REBUILT_FIELDS = (
    "group",
    "side_group",
    "store",
    "owns_group",
    "host_watch",
    "excepthooks",
)


def rebuild(master_port: int, start_timeout_s: float | None = None) -> None:
    """Replace the process group after a failed or stalled collective, keeping this process.

    The current group (and every group made from it) is aborted, which closes its connections:
    a peer still blocked in a collective of the old group fails at once instead of waiting
    for its timeout. Every rank then meets again at a fresh store on ``master_port`` (rank 0
    hosts it) and creates a new default group. The :class:`RankState` object is updated in place,
    so objects that hold it (``DistributedOptimizer``) keep working; collective counters start
    again at 0 on every rank. A DDP module built before keeps the old group: wrap it again.

    Args:
        master_port: the port of the new store, the same on every rank.
        start_timeout_s: how long to wait for every rank at the store (default: the
            collective timeout).

    Raises:
        NotInitializedError: before ``init()``.
        CollectiveTimeout: when not every rank arrives at the new store in time.

    Example:
        >>> _state.rebuild(29517)  # on every rank, with the same port  # doctest: +SKIP
    """
    state = require_init("rebuild")
    abort()
    _stop_heartbeat(state)
    world = World(
        rank=state.rank,
        size=state.size,
        local_rank=state.local_rank,
        local_size=state.local_size,
        cross_rank=state.cross_rank,
        cross_size=state.cross_size,
        launcher=state.launcher,
        master_addr=detect_world(dict(os.environ)).master_addr or "127.0.0.1",
        master_port=master_port,
    )
    _await_host_close(state, 0.0)
    _restore_excepthook(state)  # before init_process_group wraps the hook again
    fresh = _connect(world, state.backend, start_timeout_s or state.timeout_s, state.timeout_s)
    for name in _REBUILT_FIELDS:
        setattr(state, name, getattr(fresh, name))
    state.seq, state.last_op, state.last_sig = 0, "", 0
    state.comms = {}
    state.heartbeat = StallHeartbeat(state, state.store)
    _rendezvous.all_ready(state.store, state.rank, state.size, start_timeout_s or state.timeout_s)


def abort() -> None:
    """Abort the default process group and its subgroups (their connections close at once).

    Harmless when no group exists. Collectives of the aborted group fail from then on, here
    and on every peer waiting for this rank; :func:`rebuild` makes a new group.
    """
    if dist.is_initialized():
        _dist.abort_default_group()
    if _STATE is not None:
        # gloo closes a group's connections only when the group is freed: drop hora's
        # references (a DDP module built on the group still holds one)
        _STATE.group = _STATE.side_group = None
        for comm in _STATE.comms.values():
            _drop_comm(comm, abort=True)  # members waiting in the shared-memory ring fail now
        _STATE.comms = {}
        gc.collect()


def left_broken() -> bool:
    """Return whether the last world this process left had failed (a peer died, a timeout).

    A world source uses it to tell ``hvd.elastic.run``'s re-forming ``init()`` (after a
    failure) from a script's own ``shutdown()`` and ``init()``.
    """
    return _LEFT_BROKEN[0]
