"""Rendezvous and the default process group: stores, timeouts, the backend (data plane).

How ``hora.torch.init()`` meets the other ranks: rank 0 hosts a store at the launcher's
``MASTER_ADDR:MASTER_PORT`` (or names it in a file keyed by the job, under mpirun); every rank
waits there within the start timeout, then ``init_process_group`` creates the default group.
With the launch's secret (``HORA_RDZV_SECRET``, which hora's launchers give) the store is
hora's own, answering only connections that prove they hold the secret
(:mod:`hora.torch._authstore`), and its keys and values are sealed with it
(:mod:`hora.torch._sealed`); without one (a plain torchrun), it is torch's ``TCPStore``. Each
``init()`` at an address is numbered, and its keys are prefixed by that number, so keys of an
earlier world never answer a later one. The timeouts and the backend come from ``init()``'s
arguments or ``HORA_TIMEOUT`` / ``HORA_START_TIMEOUT`` / ``HORA_BACKEND``.

The lifecycle around it (init, shutdown, rebuild) is :mod:`hora.torch._state`.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hora.env import RDZV_SECRET_VAR, RankEnv, World
from hora.errors import CollectiveTimeout, LauncherEnvError, RendezvousError
from hora.torch import _dist

log = logging.getLogger("hora.torch")

DEFAULT_TIMEOUT_S = 60.0
# How often a waiting rank looks again for the store (TCPStore's own connect retries back off
# to about a second: a rank that asked before rank 0 reopened the store waited 0.2-0.7 s).
POLL_S = 0.005


def env_seconds(environ: dict[str, str], key: str) -> float | None:
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


def collective_timeout(
    timeout: float | datetime.timedelta | None, environ: dict[str, str]
) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if timeout is not None:
        return float(timeout)
    # the contract's names, parsed by env_seconds: its messages say seconds, and > 0
    value = env_seconds(environ, RankEnv.var("timeout"))
    return DEFAULT_TIMEOUT_S if value is None else value


def start_timeout(
    timeout: float | datetime.timedelta | None, environ: dict[str, str], collective_s: float
) -> float:
    """Return the seconds to wait for every rank at the rendezvous.

    Ranks start (import torch, load data) at different speeds, so ``HORA_START_TIMEOUT`` may
    allow more than a collective may take; ``init(timeout=)`` sets both.
    """
    if timeout is not None:
        return collective_s
    value = env_seconds(environ, RankEnv.var("start_timeout"))
    return collective_s if value is None else value


def backend_of(backend: str | None, environ: dict[str, str]) -> str:
    var = RankEnv.var("backend")  # the contract's name; the messages below say the choices
    source = "init(backend=...)" if backend else var
    name = (backend or environ.get(var) or "").lower()
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


def rendezvous_path(world: World) -> Path:
    job = world.job_id or f"ppid{os.getppid()}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    return Path(tempfile.gettempdir(), f"hora-rdzv-{safe}")


def file_rendezvous(
    world: World, timeout_s: float, generation: int, key: bytes | None
) -> tuple[Any, Path | None]:
    """Rank 0 opens a store on a free port and names it in a file; the others wait for it.

    The file says ``host port pid generation``: the previous ``init()``'s file may still be
    there, naming a store that is closing, so a rank waits for this generation's.
    """
    path = rendezvous_path(world)
    td = datetime.timedelta(seconds=timeout_s)
    if world.rank == 0:
        store = open_store("0.0.0.0", 0, world.size, td, key, host=True)
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
        time.sleep(POLL_S)
    addr = "127.0.0.1" if host == socket.gethostname() else host
    return open_store(addr, int(port), world.size, td, key), None


def open_store(
    addr: str, port: int, size: int, td: datetime.timedelta, key: bytes | None, host: bool = False
) -> Any:
    """Host (``host``) or reach the rendezvous store at ``addr:port``.

    With a key (the launch's secret), hora's authenticated store; without, a ``TCPStore``.

    Raises:
        OSError: rank 0 cannot listen on the port (hora's store).
        RuntimeError: the same, or the store cannot be reached (a ``TCPStore``).
    """
    if key is None:
        return dist.TCPStore(addr, port, size, host, timeout=td, wait_for_workers=False)
    from hora.torch._authstore import AuthStore, StoreServer

    server = StoreServer(port, key) if host else None
    at, port = ("127.0.0.1", server.port) if server is not None else (addr, port)
    return AuthStore(at, port, key, td, server=server)


def make_store(
    world: World, timeout_s: float, generation: int, key: bytes | None = None
) -> tuple[Any, Path | None]:
    """The raw store of this rendezvous (rank 0 hosts it), and the file that names it, if any.

    ``key``: the store key of the launch's secret (hora's authenticated store), or None.
    Under torchrun's agent the store is the agent's ``TCPStore`` whatever the key: the ranks
    join it as clients (and :func:`scoped_store` still seals what they write there).
    """
    td = datetime.timedelta(seconds=timeout_s)
    if world.size == 1 and world.master_port is None:
        return open_store("127.0.0.1", 0, 1, td, key, host=True), None
    if world.master_addr is None or world.master_port is None:
        return file_rendezvous(world, timeout_s, generation, key)
    if agent_store(os.environ):
        key = None  # the agent hosts a TCPStore: hora's handshake would find no one there
    elif world.rank == 0:
        hosted_before = generation > 1
        return host_store(
            world.master_addr, world.master_port, world.size, td, hosted_before, key
        ), None
    await_listener(world.master_addr, world.master_port, timeout_s)
    try:
        store = open_store(world.master_addr, world.master_port, world.size, td, key)
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveTimeout(
            "init",
            [0],
            timeout_s,
            name=f"rendezvous {world.master_addr}:{world.master_port}: "
            f"rank 0 (the rendezvous host): {e}",
        ) from None
    return store, None


def agent_store(environ: Mapping[str, str]) -> bool:
    """Whether torchrun's agent already hosts the store at ``MASTER_ADDR:MASTER_PORT``.

    torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` for its workers: rank 0 then joins
    the agent's store as a client, as ``init_process_group`` does, instead of trying to host
    one on the agent's port (torch logs a bind error for that try). That store is the
    agent's ``TCPStore``, so a torchrun started inside a hora job (whose ranks inherit the
    job's ``HORA_RDZV_SECRET``) meets there too, its keys and values sealed.

    Example:
        >>> agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}), agent_store({})
        (True, False)
    """
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


# A store this process hosted before shutdown() may hold the port a moment longer: the
# gloo Works that kept it alive are freed by gloo's threads once they finish.
_PORT_FREE_WAIT_S = 5.0


def await_listener(addr: str, port: int, timeout_s: float) -> None:
    """Wait until rank 0's store accepts connections on ``addr:port``.

    Raises:
        CollectiveTimeout: when nothing listens there within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    delay = POLL_S
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


def host_store(
    addr: str,
    port: int,
    size: int,
    td: datetime.timedelta,
    hosted_before: bool,
    key: bytes | None = None,
) -> Any:
    """Open the rendezvous store on rank 0; an address in use is said as such, not a timeout.

    Args:
        addr: the rendezvous address.
        port: the launcher's rendezvous port.
        size: the number of ranks.
        td: the store's timeout.
        hosted_before: whether this process hosted the store of an earlier ``init()`` at this
            address (only then is it worth waiting for the port to be freed).
        key: the store key of the launch's secret (hora's authenticated store), or None.

    Raises:
        RendezvousError: when the port stays in use (another process, or a Work of the
            previous ``init()`` that the script still holds).
    """
    deadline = time.monotonic() + (_PORT_FREE_WAIT_S if hosted_before else 0.0)
    while True:
        try:
            return open_store(addr, port, size, td, key, host=True)
        except (RuntimeError, dist.DistError, OSError) as e:
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


def world_from_group(world: World) -> World:
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


def own_client(store: Any) -> Any:
    """A second connection to the store, so a blocking wait elsewhere never delays heartbeats.

    A PrefixStore's clone keeps its prefix over a new connection to the same server.
    """
    try:
        return store.clone()
    except Exception:  # FileStore/HashStore: no connection to block on
        return store


def init_group(world: World, backend: str, store: Any, start_s: float, timeout_s: float) -> None:
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


def all_ready(store: Any, rank: int, size: int, start_s: float) -> None:
    """Say this rank is done with the store's part of ``init()``; rank 0 waits for everyone.

    Rank 0 hosts the store: if it left ``init()`` (and perhaps the process: a failing reset
    callback of an elastic job) while another rank still had a store request of its own
    ``init()`` to make (the side group's addresses, its heartbeat's first beat), that rank's
    ``init()`` would fail with a reset connection.

    Raises:
        CollectiveTimeout: (rank 0) a rank did not say so within ``start_s``.
    """
    keys = [f"hora/ready/{r}" for r in range(size)]
    try:
        store.set(keys[rank], "1")
        if rank == 0:
            store.wait(keys, datetime.timedelta(seconds=start_s))
    except (RuntimeError, dist.DistError) as e:
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except (RuntimeError, dist.DistError):  # the store's host (rank 0) is gone
            missing = [0]
        raise CollectiveTimeout("init", missing, start_s, name=f"rendezvous: {e}") from None


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


def world_device_index(world: World) -> int:
    return device_index(world.local_rank, world.local_size, torch.cuda.device_count())


# init() calls that created a group, per rendezvous address; prefixes every rendezvous key
_GENERATIONS: dict[tuple[str | None, int | None], int] = {}


def create_group(
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
        store = _dist.default_store()
        return world_from_group(world), str(dist.get_backend()), store, None
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
    key = rendezvous_key(os.environ)
    deadline = time.monotonic() + start_s
    while True:
        try:
            raw, rdzv = make_store(world, start_s, generation, key)
            store = scoped_store(raw, prefix, key)
            if backend == "nccl":
                torch.cuda.set_device(world_device_index(world))
            init_group(world, backend, store, start_s, timeout_s)
            return world, backend, store, rdzv
        except CollectiveTimeout as e:  # rank 0's previous store closed as we reached it
            if world.rank == 0 or time.monotonic() > deadline or not store_closed(e):
                raise
            log.debug("rendezvous store went away during init (%s); connecting again", e)
            time.sleep(POLL_S)


def rendezvous_key(environ: Mapping[str, str]) -> bytes | None:
    """The store key of the launch's secret, when the launcher gave one.

    hora's launchers (the service, ``hora run``, notebook engines) give every rank of a world
    the same ``HORA_RDZV_SECRET``; a process without it cannot read, write, list or join the
    store (:mod:`hora.torch._authstore`, :mod:`hora.torch._sealed`). Without one (a plain
    torchrun), the store is as torch makes it.
    """
    secret = environ.get(RDZV_SECRET_VAR, "")
    if not secret:
        return None
    from hora.torch._sealed import store_key

    return store_key(secret)


def scoped_store(raw: Any, prefix: str, key: bytes | None) -> Any:
    """``raw`` with every key under ``prefix``, and sealed with ``key`` when there is one."""
    if key is None:
        return dist.PrefixStore(prefix, raw)
    from hora.torch._sealed import SealedStore

    return SealedStore(raw, key, prefix)


def store_closed(e: BaseException) -> bool:
    """Whether an init failure means the store's host closed the connection (retry)."""
    text = str(e).lower()
    return any(w in text for w in ("reset by peer", "broken pipe", "closed", "got 0 bytes"))
