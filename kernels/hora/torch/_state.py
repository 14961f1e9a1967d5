"""Process-wide state of hora.torch: init, shutdown and the world queries (data plane).

``init()`` reads the world from whichever launcher started the process
(:func:`hora.env.detect_world`), finds the rendezvous (the launcher's ``MASTER_ADDR`` /
``MASTER_PORT``, a file keyed by the MPI job id under mpirun, or a private store for a world
of one), and initialises torch.distributed's
*default* process group, so plain ``torch.distributed`` calls and DDP work in the same script.
If the user already called ``init_process_group`` that group is adopted instead.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hora.env import RDZV_SECRET_VAR, World, detect_world
from hora.errors import (
    CollectiveTimeout,
    LauncherEnvError,
    NotInitializedError,
    RendezvousError,
    UnsupportedError,
)

log = logging.getLogger("hora.torch")

DEFAULT_TIMEOUT_S = 60.0
HEARTBEAT_S = 0.25
_HB_KEY = "hora/hb/"
# How often a waiting rank looks again for the store (TCPStore's own connect retries back off
# to about a second: a rank that asked before rank 0 reopened the store waited 0.2-0.7 s).
_POLL_S = 0.005


@dataclass
class State:
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
    hb_store: Any = None
    comms: dict[int, Any] = field(default_factory=dict)
    host_watch: socket.socket | None = None
    excepthooks: tuple[Any, Any] | None = None
    timeout_td: datetime.timedelta = field(init=False)

    def __post_init__(self) -> None:
        self.timeout_td = datetime.timedelta(seconds=self.timeout_s)

    _hb_stop: threading.Event = field(default_factory=threading.Event)
    _hb_thread: threading.Thread | None = None


_STATE: State | None = None

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


def require_init(op: str) -> State:
    """Return the state, or raise NotInitializedError naming ``op``.

    Args:
        op: the public name of the operation being called (e.g. "allreduce").

    Returns:
        The process-wide :class:`State`.

    Raises:
        NotInitializedError: when ``init()`` has not run (or ``shutdown()`` ran).
    """
    if _STATE is None:
        raise NotInitializedError(op)
    return _STATE


def _seconds(environ: dict[str, str], key: str) -> float | None:
    raw = environ.get(key)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise LauncherEnvError(f"{key}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise LauncherEnvError(f"{key}={raw!r} must be > 0")
    return value


def _timeout(timeout: float | datetime.timedelta | None, environ: dict[str, str]) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if timeout is not None:
        return float(timeout)
    value = _seconds(environ, "HORA_TIMEOUT")
    return DEFAULT_TIMEOUT_S if value is None else value


def _start_timeout(
    timeout: float | datetime.timedelta | None, environ: dict[str, str], collective_s: float
) -> float:
    """Return the seconds to wait for every rank at the rendezvous.

    Ranks start (import torch, load data) at different speeds, so ``HORA_START_TIMEOUT`` may
    allow more than a collective may take; ``init(timeout=)`` sets both.
    """
    if timeout is not None:
        return collective_s
    value = _seconds(environ, "HORA_START_TIMEOUT")
    return collective_s if value is None else value


def _backend(backend: str | None, environ: dict[str, str]) -> str:
    source = "init(backend=...)" if backend else "HORA_BACKEND"
    name = (backend or environ.get("HORA_BACKEND") or "").lower()
    if not name:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if name not in ("nccl", "gloo", "mpi"):
        raise LauncherEnvError(f"{source}={name!r} is not one of nccl, gloo, mpi")
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise LauncherEnvError(
            f"{source}='nccl' needs CUDA GPUs and a torch built with NCCL; "
            "this process has none: use 'gloo'"
        )
    if name == "mpi" and not dist.is_mpi_available():
        raise LauncherEnvError(f"{source}='mpi': this torch was built without MPI; use 'gloo'")
    return name


def _rdzv_path(world: World) -> Path:
    job = world.job_id or f"ppid{os.getppid()}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    return Path(tempfile.gettempdir(), f"hora-rdzv-{safe}")


def _file_rendezvous(world: World, timeout_s: float, generation: int) -> tuple[Any, Path | None]:
    """Rank 0 opens a store on a free port and names it in a file; the others wait for it.

    The file says ``host port pid generation``: the previous ``init()``'s file may still be
    there, naming a store that is closing, so a rank waits for this generation's.
    """
    path = _rdzv_path(world)
    td = datetime.timedelta(seconds=timeout_s)
    if world.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, world.size, True, timeout=td, wait_for_workers=False)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(f"{socket.gethostname()} {store.port} {os.getpid()} {generation}\n")
        os.replace(tmp, path)
        return store, path
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            host, port, _, written = path.read_text().split()
            if int(written) == generation:
                break
        except (FileNotFoundError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise CollectiveTimeout("init", [0], timeout_s, name=f"rendezvous file {path}")
        time.sleep(_POLL_S)
    addr = "127.0.0.1" if host == socket.gethostname() else host
    return dist.TCPStore(addr, int(port), world.size, False, timeout=td), None


def _make_store(world: World, timeout_s: float, generation: int) -> tuple[Any, Path | None]:
    td = datetime.timedelta(seconds=timeout_s)
    if world.size == 1 and world.master_port is None:
        return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=td, wait_for_workers=False), None
    if world.master_addr is None or world.master_port is None:
        return _file_rendezvous(world, timeout_s, generation)
    if world.rank == 0:
        hosted_before = generation > 1
        return _host_store(
            world.master_addr, world.master_port, world.size, td, hosted_before
        ), None
    _await_listener(world.master_addr, world.master_port, timeout_s)
    try:
        store = dist.TCPStore(world.master_addr, world.master_port, world.size, False, timeout=td)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveTimeout(
            "init",
            [0],
            timeout_s,
            name=f"rendezvous {world.master_addr}:{world.master_port}: "
            f"rank 0 (the rendezvous host): {e}",
        ) from None
    return store, None


# A store this process hosted before shutdown() may hold the port a moment longer: the
# gloo Works that kept it alive are freed by gloo's threads once they finish.
_PORT_FREE_WAIT_S = 5.0


def _await_listener(addr: str, port: int, timeout_s: float) -> None:
    """Wait until rank 0's store accepts connections on ``addr:port``.

    Raises:
        CollectiveTimeout: when nothing listens there within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    delay = _POLL_S
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, timeout_s))).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    "init",
                    [0],
                    timeout_s,
                    name=f"rendezvous {addr}:{port}: rank 0 "
                    f"(the rendezvous host) never opened it: {e}",
                ) from None
            time.sleep(delay)  # a re-init finds the port in ms; a slow rank 0 start, later
            delay = min(2 * delay, 0.1)


def _host_store(
    addr: str, port: int, size: int, td: datetime.timedelta, hosted_before: bool
) -> Any:
    """Open the rendezvous store on rank 0; an address in use is said as such, not a timeout.

    Args:
        addr: the rendezvous address.
        port: the launcher's rendezvous port.
        size: the number of ranks.
        td: the store's timeout.
        hosted_before: whether this process hosted the store of an earlier ``init()`` at this
            address (only then is it worth waiting for the port to be freed).

    Raises:
        RendezvousError: when the port stays in use (another process, or a Work of the
            previous ``init()`` that the script still holds).
    """
    deadline = time.monotonic() + (_PORT_FREE_WAIT_S if hosted_before else 0.0)
    while True:
        try:
            return dist.TCPStore(addr, port, size, True, timeout=td, wait_for_workers=False)
        except (RuntimeError, dist.DistError) as e:
            if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                raise RendezvousError(f"{addr}:{port}", f"rank 0 could not open it: {e}") from None
            if time.monotonic() > deadline:
                why = "address in use: another process listens on this port"
                if hosted_before:
                    why += (
                        ", or this process still holds a handle or optimizer of a previous "
                        "init() with work in flight (synchronize or drop it before shutdown())"
                    )
                raise RendezvousError(f"{addr}:{port}", why) from None
            gc.collect()
            time.sleep(0.05)


def _world_from_group(world: World) -> World:
    """Trust the existing default group for rank and size; keep the launcher's local numbers."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if world.size != size or world.rank != rank:
        world = World(
            rank=rank,
            size=size,
            local_rank=0,
            local_size=1,
            cross_rank=rank,
            cross_size=size,
            launcher="torch.distributed",
        )
    return world


def _own_client(store: Any) -> Any:
    """A second connection to the store, so a blocking wait elsewhere never delays heartbeats.

    A PrefixStore's clone keeps its prefix over a new connection to the same server.
    """
    try:
        return store.clone()
    except Exception:  # FileStore/HashStore: no connection to block on
        return store


def _init_group(world: World, backend: str, store: Any, start_s: float, timeout_s: float) -> None:
    """Wait for every rank (start_s), then init_process_group; on failure, name the absent.

    The process group's own rendezvous would give up after its (collective) timeout, so the
    ranks first meet in the store, under the start timeout.
    """
    try:
        store.set(f"hora/arrived/{world.rank}", "1")
        store.wait(
            [f"hora/arrived/{r}" for r in range(world.size)], datetime.timedelta(seconds=start_s)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=world.rank,
            world_size=world.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as e:
        try:
            missing = [r for r in range(world.size) if not store.check([f"hora/arrived/{r}"])]
        except Exception:  # the store host (rank 0) is gone
            missing = [0]
        raise CollectiveTimeout("init", missing, start_s, name=f"process group: {e}") from None


def device_index(local_rank: int, local_size: int, count: int) -> int:
    """The CUDA device a rank pins: ``cuda:LOCAL_RANK`` over the GPUs the host's ranks share.

    hora's launchers show every rank of a job all of the job's GPUs on its host (NCCL's CUDA
    IPC and NVLink paths need that); with ``g`` GPUs per rank, rank ``r`` takes the first of
    its own, ``r * g``. A rank that sees fewer GPUs than there are local ranks (a launcher
    that binds one GPU per process) takes ``local_rank % count``.

    Example:
        >>> device_index(1, 2, 2), device_index(1, 2, 4), device_index(3, 4, 1)
        (1, 2, 0)
    """
    if count <= 0:
        return 0
    if count < local_size:
        return local_rank % count
    return local_rank * (count // local_size)


def _device_index(world: World) -> int:
    return device_index(world.local_rank, world.local_size, torch.cuda.device_count())


def _heartbeat(state: State) -> None:
    """Publish this rank's collective counter so a stalled rank can be named (Horovod's stall)."""
    key = f"{_HB_KEY}{state.rank}"
    while not state._hb_stop.wait(HEARTBEAT_S):
        try:
            state.hb_store.set(
                key, f"{state.seq} {time.time():.3f} {state.last_sig} {state.last_op}"
            )
        except Exception:  # the store host went away; the op that fails will report it
            return


# init() calls that created a group, per rendezvous address; prefixes every rendezvous key
_GENERATIONS: dict[tuple[str | None, int | None], int] = {}


def _group(
    world: World, backend: str, start_s: float, timeout_s: float
) -> tuple[World, str, Any, Path | None]:
    """Adopt the user's default group, or rendezvous and create it.

    Every key of a rendezvous is prefixed by the number of this init() at this rendezvous
    address (the same on every rank, as every rank calls init() and shutdown() alike), so a
    key left by an earlier init() never answers a later one. Counting per address keeps the
    ranks agreed when some of them are new processes meeting the others at a fresh address
    (a notebook engine replaced while the survivors rebuild their group). A rank other than
    0 that reached rank 0's store of the previous init() just before it closed connects again.
    """
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        return _world_from_group(world), str(dist.get_backend()), store, None
    # Importing this torch package while a group exists keeps that group alive for good (its
    # threads and rank 0's store, hence the port, survive destroy_process_group). torch
    # imports it lazily, e.g. with torch._dynamo at the first optimizer built after init():
    # import it first, while no group exists (about 0.05 s).
    importlib.import_module("torch.distributed._shard.sharded_tensor")
    address = (world.master_addr, world.master_port)
    _GENERATIONS[address] = generation = _GENERATIONS.get(address, 0) + 1
    # torchrun's agent keeps its store (which ranks share) across --max-restarts: keys of the
    # attempt before must not answer this one
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    prefix = f"hora/r{restart}g{generation}" if restart else f"hora/g{generation}"
    deadline = time.monotonic() + start_s
    while True:
        try:
            raw, rdzv = _make_store(world, start_s, generation)
            store = _sealed_store(dist.PrefixStore(prefix, raw), os.environ)
            if backend == "nccl":
                torch.cuda.set_device(_device_index(world))
            _init_group(world, backend, store, start_s, timeout_s)
            return world, backend, store, rdzv
        except CollectiveTimeout as e:  # rank 0's previous store closed as we reached it
            if world.rank == 0 or time.monotonic() > deadline or not _reset(e):
                raise
            log.debug("rendezvous store went away during init (%s); connecting again", e)
            time.sleep(_POLL_S)


def _sealed_store(store: Any, environ: Mapping[str, str]) -> Any:
    """The rendezvous store sealed with the launch's secret, when the launcher gave one.

    hora's launchers (the service, ``hora run``, notebook engines) give every rank of a world
    the same ``HORA_RDZV_SECRET``; a process without it cannot read, write or join the
    store (:mod:`hora.torch._sealed`). Without one (a plain torchrun), the store is as torch
    makes it.
    """
    secret = environ.get(RDZV_SECRET_VAR, "")
    if not secret:
        return store
    from hora.torch._sealed import SealedStore, store_key

    return SealedStore(store, store_key(secret))


def _reset(e: BaseException) -> bool:
    """Whether an init failure means the store's host closed the connection (retry)."""
    text = str(e).lower()
    return any(w in text for w in ("reset by peer", "broken pipe", "closed", "got 0 bytes"))


def _start_heartbeat(state: State) -> None:
    state.hb_store = _own_client(state.store)
    state.hb_store.set(f"{_HB_KEY}{state.rank}", f"0 {time.time():.3f} 0 init")
    state._hb_thread = threading.Thread(
        target=_heartbeat, args=(state,), name="hora-heartbeat", daemon=True
    )
    state._hb_thread.start()


def _start(world: World, backend: str, start_s: float, timeout_s: float) -> State:
    state = _connect(world, backend, start_s, timeout_s)
    _start_heartbeat(state)
    return state


def _connect(world: World, backend: str, start_s: float, timeout_s: float) -> State:
    """Rendezvous, create (or adopt) the default group and the side group; no heartbeat yet."""
    adopted = dist.is_initialized()
    hook = sys.excepthook
    world, backend, store, rdzv = _group(world, backend, start_s, timeout_s)
    watch = None if adopted else _watch_host(world)
    device = torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", _device_index(world))
        torch.cuda.set_device(device)
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    state = State(
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
        timeout_s = _timeout(timeout, environ)
        start_s = _start_timeout(timeout, environ, timeout_s)
        try:
            _STATE = _start(world, _backend(backend, environ), start_s, timeout_s)
        except (CollectiveTimeout, RendezvousError) as e:
            failure = e
    log.debug(
        "hora.torch initialised: rank %d of %d (%s)", _STATE.rank, _STATE.size, _STATE.backend
    )
    atexit.register(_at_exit)  # once per process: register() of a registered function is a no-op
    for hook in _INIT_HOOKS:  # the timeline starts, then init(process_sets=...) adds its sets
        hook(environ, process_sets)


def _stop_heartbeat(state: State) -> None:
    state._hb_stop.set()
    if state._hb_thread is not None:
        state._hb_thread.join(timeout=2 * HEARTBEAT_S + 1)
        _await_os_thread_end(state._hb_thread, 0.5)


def _await_os_thread_end(thread: threading.Thread, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until a joined thread's OS thread has ended too.

    ``Thread.join()`` returns once the thread cleared its Python state; the OS thread exits a
    moment later (on a busy machine, after the main thread moved on: an exit handler could
    still count it). Linux only; elsewhere, and for a thread still running, it returns at once.
    """
    if thread.is_alive() or thread.native_id is None or not os.path.isdir("/proc/self/task"):
        return
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + timeout_s
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0005)


def _release(state: State, *, graceful: bool, abort_shm: bool | None = None) -> None:
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
    if state.owns_group and dist.is_initialized():
        try:
            if graceful:
                dist.destroy_process_group()
            else:
                dist.distributed_c10d._abort_process_group()
        except Exception as e:  # a group already aborted by a failure: nothing left to free
            log.debug("releasing the process group: %s", e)
    _restore_excepthook(state)
    held = [weakref.ref(o) for o in (state.group, state.side_group, state.store) if o is not None]
    state.group = state.side_group = state.store = state.hb_store = None
    for comm in state.comms.values():  # an optimizer or a traceback may still hold one
        groups = (comm.group, comm.side)
        held += [weakref.ref(g) for g in groups if isinstance(g, dist.ProcessGroup)]
        comm.group = comm.side = None
        if comm.shm is not None:  # the shared-memory segment (hora.torch._shm.Ring)
            # aborted: members waiting in it fail at once
            comm.shm.close(abort=not graceful if abort_shm is None else abort_shm)
            comm.shm = None
        comm.pending.clear()
        comm.inflight.clear()
    state.comms = {}
    # A group left in a reference cycle (with its Works, a hook's closure) keeps its gloo
    # threads, sockets and rank 0's port. A full collection costs ~0.1 s with torch loaded, so
    # it runs only when a young one did not free them.
    gc.collect(1)
    if any(ref() is not None for ref in held):
        gc.collect()


def _restore_excepthook(state: State) -> None:
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


def _await_host_close(state: State, timeout_s: float) -> None:
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


# What rebuild() takes from the fresh connection into the State objects already hold
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
    hosts it) and creates a new default group. The :class:`State` object is updated in place,
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
    state._hb_stop = threading.Event()
    _start_heartbeat(state)


def abort() -> None:
    """Abort the default process group and its subgroups (their connections close at once).

    Harmless when no group exists. Collectives of the aborted group fail from then on, here
    and on every peer waiting for this rank; :func:`rebuild` makes a new group.
    """
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    if _STATE is not None:
        # gloo closes a group's connections only when the group is freed: drop hora's
        # references (a DDP module built on the group still holds one)
        _STATE.group = _STATE.side_group = None
        for comm in _STATE.comms.values():
            comm.group = comm.side = None
            if comm.shm is not None:  # members waiting in the shared-memory ring fail now
                comm.shm.close(abort=True)
                comm.shm = None
        _STATE.comms = {}
        gc.collect()


def is_initialized() -> bool:
    """Return whether ``init()`` has run (and ``shutdown()`` has not)."""
    return _STATE is not None


def size() -> int:
    """Return the number of ranks in the job.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("size").size


def rank() -> int:
    """Return this process's global rank.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("rank").rank


def local_size() -> int:
    """Return the number of ranks on this host.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("local_size").local_size


def local_rank() -> int:
    """Return this process's rank on its host (use it to pick the GPU).

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("local_rank").local_rank


def cross_size() -> int:
    """Return the number of hosts.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("cross_size").cross_size


def cross_rank() -> int:
    """Return this host's index among hosts.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("cross_rank").cross_rank


def is_homogeneous() -> bool:
    """Return whether every host runs the same number of ranks."""
    st = require_init("is_homogeneous")
    return st.size == st.local_size * st.cross_size


def nccl_built() -> bool:
    """Return whether torch.distributed has NCCL (Horovod returns a version int; truthy here)."""
    return bool(dist.is_nccl_available())


def gloo_built() -> bool:
    """Return whether torch.distributed has gloo."""
    return bool(dist.is_gloo_available())


def mpi_built() -> bool:
    """Return whether torch.distributed was built with MPI."""
    return bool(dist.is_mpi_available())


def mpi_enabled() -> bool:
    """Return whether the MPI backend is in use (hora uses NCCL/gloo, so normally False)."""
    return _STATE is not None and _STATE.backend == "mpi"


def gloo_enabled() -> bool:
    """Return whether gloo carries the collectives."""
    return _STATE is not None and "gloo" in _STATE.backend


def mpi_threads_supported() -> bool:
    """Return False: hora does not use MPI threads (kept for Horovod compatibility)."""
    return False


def cuda_built() -> bool:
    """Return whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Return whether torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """Return False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Return False: oneCCL is not supported."""
    return False
