"""The worker side of the elastic rendezvous: which world ``hvd.init()`` joins (data plane).

Under ``hora run --min-np/--max-np`` every rank gets ``HORA_ELASTIC_DIR`` and a worker id;
``hvd.init()`` then asks :func:`elastic_world` (registered with ``_state``) for its world
instead of reading ``RANK``/``WORLD_SIZE``: it waits for a generation of the driver's that
names this worker and is newer than the one it last joined, meets the other members there
(:mod:`hora.launch.elastic_rdzv`) and returns that generation's world. Without the variable
it is the launcher's world, as before.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hora.env import RankEnv, World, detect_world
from hora.errors import CollectiveTimeout, LauncherEnvError, RendezvousError
from hora.launch import elastic_rdzv as rdzv
from hora.torch import _hier, _state
from hora.torch._process_sets import comm_of
from hora.torch._stall import wait_work

log = logging.getLogger("hora.torch.elastic")

_POLL_S = 0.01
# Seconds every member may take from the driver's go to the new process group: they all
# arrived a moment ago, so a longer wait means one of them died (the next generation follows)
RDZV_START_S = 10.0
_RETRIES = 20
_UPDATES = "hora.elastic.host_updates"
_CHECK = "check_host_updates"
_RACY_NS = 1_000_000_000  # a generation file younger than this is read, whatever its stat


class NoWorldError(CollectiveTimeout):
    """No generation naming this worker came within the elastic timeout (too few workers)."""


class WorkerRemoved(SystemExit):
    """The driver took this worker out of the job (its host or slot went away): exit 0."""

    def __init__(self, wid: str) -> None:
        super().__init__(0)
        self.wid = wid


class _Joined:
    """The generation this process is in (0: none yet) and its worker id."""

    number = 0
    failures = 0  # generations in a row this init() could not form
    wid = ""
    root: Path | None = None


def elastic_root(environ: dict[str, str]) -> Path | None:
    """Return the elastic rendezvous directory, or None outside an elastic ``hora run``."""
    raw = RankEnv.from_environ(environ, only=("elastic_dir",)).elastic_dir
    return Path(raw) if raw else None


def elastic_world(
    environ: dict[str, str], failure: CollectiveTimeout | RendezvousError | None = None
) -> World:
    """Return the world ``init()`` joins: the next elastic generation, or the launcher's.

    Args:
        environ: a copy of this process's environment (``init()``'s own; this may set its
            ``HORA_START_TIMEOUT`` for the rendezvous that follows).
        failure: why the last rendezvous of this ``init()`` failed (a member died on the
            way): the next generation is joined instead, at most ``_RETRIES`` times.

    Raises:
        WorkerRemoved: the driver removed this worker (it should exit 0).
        NoWorldError: no generation with this worker came within the elastic timeout.
    """
    root = elastic_root(environ)
    if root is None or (failure is not None and _Joined.failures >= _RETRIES):
        if failure is not None:
            raise failure
        return detect_world(environ)
    _Joined.failures = 0 if failure is None else _Joined.failures + 1
    if failure is not None:
        log.warning("elastic: generation %d did not form (%s); joining the next", _Joined.number,
                    failure)  # fmt: skip
    wid = RankEnv.from_environ(environ, only=("elastic_worker",)).elastic_worker
    if not wid:
        raise LauncherEnvError(
            f"{RankEnv.var('elastic_dir')} is set but {RankEnv.var('elastic_worker')} is not"
        )
    _Joined.wid, _Joined.root = wid, root
    if _Joined.number == 0:
        rdzv.mark(root, f"hello.{wid}")
    else:  # a failure that killed nobody still needs a new generation
        rdzv.mark(root, f"reset.{wid}", str(_Joined.number))
    gen = _await_generation(root, wid, _elastic_timeout(environ))
    _Joined.number = gen.number
    environ.update(RankEnv(start_timeout=RDZV_START_S).to_environ())
    rank = gen.rank_of(wid)
    assert rank is not None  # _await_generation returns only generations naming wid
    me = gen.members[rank]
    world = World(rank=rank, size=len(gen.members), local_rank=me.local_rank,
                  local_size=me.local_size, cross_rank=me.cross_rank, cross_size=me.cross_size,
                  launcher="hora", master_addr=gen.addr, master_port=gen.port,
                  job_id=f"elastic-{gen.number}")  # fmt: skip
    _export(world, me.host)
    log.info("elastic: worker %s joins generation %d as rank %d of %d (%s)",
             wid, gen.number, rank, world.size, gen.note)  # fmt: skip
    return world


def _elastic_timeout(environ: dict[str, str]) -> float:
    # the contract's name, parsed here: the message says what the number is (seconds)
    var = RankEnv.var("elastic_timeout")
    raw = environ.get(var, "")
    try:
        return float(raw) if raw else rdzv.DEFAULT_TIMEOUT_S
    except ValueError:
        raise LauncherEnvError(f"{var}={raw!r} is not a number of seconds") from None


def _await_generation(root: Path, wid: str, timeout_s: float) -> rdzv.Generation:
    """Wait for a generation newer than the last joined that names ``wid`` and has begun.

    A member marks its arrival; the driver says go (``go.N``) once every member arrived. A
    generation replaced before its go (a member died on the way) is left for the new one; the
    driver writes a go before it publishes the next generation, so a member that sees the
    newer one looks for the older one's go once more before leaving it.
    """
    deadline = time.monotonic() + timeout_s
    pending: rdzv.Generation | None = None  # the generation this worker arrived at
    while True:
        if rdzv.has(root, f"removed.{wid}"):
            raise WorkerRemoved(wid)
        if pending is not None and rdzv.has(root, f"go.{pending.number}"):
            return pending
        gen = rdzv.read_generation(root)
        fresh = gen is not None and gen.ready and gen.number > _Joined.number
        if fresh and gen is not None and gen.rank_of(wid) is not None and gen != pending:
            if pending is not None and rdzv.has(root, f"go.{pending.number}"):
                return pending
            rdzv.mark(root, f"arrived.{gen.number}.{wid}")
            pending = gen
        if time.monotonic() > deadline:
            waiting = gen.note if gen is not None else "no world published"
            raise NoWorldError("init", [], timeout_s,
                                    name=f"elastic rendezvous of worker {wid} ({waiting})")
        time.sleep(_POLL_S)


def _export(world: World, host: str) -> None:
    """Horovod's elastic variables for the script, updated at every reset as Horovod does."""
    os.environ.update(
        HOROVOD_HOSTNAME=host, HOROVOD_RANK=str(world.rank), HOROVOD_SIZE=str(world.size),
        HOROVOD_LOCAL_RANK=str(world.local_rank), HOROVOD_LOCAL_SIZE=str(world.local_size),
        HOROVOD_CROSS_RANK=str(world.cross_rank), HOROVOD_CROSS_SIZE=str(world.cross_size),
    )  # fmt: skip


class _Posted:
    """The views posted at the last commit: an all_gather in flight on the side group."""

    work: Any = None
    rows: list[torch.Tensor] = []
    number = 0  # the generation it was posted in


class _Seen:
    """The driver's generation file as last read: its (inode, mtime, size), its contents."""

    key: tuple[int, int, int] | None = None
    gen: rdzv.Generation | None = None


def _generation(root: Path) -> rdzv.Generation | None:
    """The driver's current generation, read again only when its file may have changed.

    The driver replaces the file whole (a rename), so a new inode, time or size means new
    contents; a commit reads it with one stat() instead of parsing it (60 µs here). A file
    replaced less than ``_RACY_NS`` ago is read anyway: the kernel stamps times from a coarse
    clock, so two replacements within one tick could reuse an inode and a size and look alike
    (git's "racily clean" index entries, the same way).
    """
    try:
        st = os.stat(root / rdzv.WORLD_FILE)
    except FileNotFoundError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    if key != _Seen.key or time.time_ns() - st.st_mtime_ns < _RACY_NS:
        _Seen.key, _Seen.gen = key, rdzv.read_generation(root)
    return _Seen.gen


def check_updates() -> bool:
    """Return, on every rank alike, whether the driver published a newer generation.

    Ranks that share a machine exchange their views through the world's shared memory (one
    barrier, :meth:`hora.torch._shm.Ring.allgather_ints`): they agree at the check where the
    first of them saw it. Otherwise each commit posts this rank's view (an all_gather of one
    int on the gloo side group, in the background) and reads the views posted at the commit
    before, complete by now: the ranks agree one commit after the first of them saw it, and
    a commit waits for nobody. False outside an elastic run.
    """
    st = _state.current()
    root = _Joined.root
    if root is None or _Joined.number == 0 or st is None:
        return False
    gen = _generation(root)
    mine = int(gen is not None and gen.number > _Joined.number)
    if st.size == 1:
        return bool(mine)
    ring = _hier.ring_of(comm_of(None, _CHECK), _CHECK)
    views = (ring.allgather_ints([mine], _CHECK, _UPDATES, "host updates")
             if ring is not None else None)
    if views is not None:
        return any(v[0] for v in views)
    seen = False
    if _Posted.work is not None and _Posted.number == _Joined.number:
        wait_work(_Posted.work, _CHECK, _UPDATES)
        seen = any(int(r[0]) for r in _Posted.rows)
    _Posted.rows = [torch.zeros(1, dtype=torch.int64) for _ in range(st.size)]
    _Posted.work = dist.all_gather(_Posted.rows, torch.tensor([mine]), group=st.side_group,
                                   async_op=True)  # fmt: skip
    _Posted.number = _Joined.number
    return seen


def forget_posted() -> None:
    """Drop the views in flight (the world is being left: they belong to its groups)."""
    _Posted.work, _Posted.rows = None, []
