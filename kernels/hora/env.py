"""Launcher environment contract (data plane).

Two pure functions define how a process learns its place in a data-parallel world:

* :func:`rank_env` builds the environment a launcher gives rank ``r`` (``hora run``, the
  notebook engines and the service's local runtime all use it, so they agree by construction).
* :func:`detect_world` reads whichever launcher started this process: hora / torchrun,
  Open MPI, MPICH / Intel MPI, Slurm's srun, or none (a world of one).

:class:`RankEnv` is the contract itself: every variable a hora launcher (``hora run``, the
notebook engines, the service's runtimes) writes into a rank's environment and the data plane
reads back, one typed field each, with :meth:`RankEnv.to_environ` and
:meth:`RankEnv.from_environ` as the only spelling of their names. :data:`LAUNCHER_VARS` lists
what a launcher strips from the environment it starts from.

Neither touches ``os.environ``: callers pass the mapping in and hand the result to children.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from hora.errors import LauncherEnvError

DEFAULT_MASTER_PORT = 29500
# The rendezvous secret a launcher gives all the ranks of one world (and no one else):
# hora.torch.init() seals every key and value of its rendezvous store with it, so a process
# that reaches the store without it can neither read, write nor join (hora.torch._sealed).
RDZV_SECRET_VAR = "HORA_RDZV_SECRET"
# The variables by which a launcher (hora, torchrun, Open MPI, MPICH / Intel MPI, srun) places
# a process in its world: a launcher strips them from the environment it starts from, so that
# its children see only the world it gives them, never the one their parent was started in.
LAUNCHER_VARS: tuple[str, ...] = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK",
    "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "HORA_LAUNCHER",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", RDZV_SECRET_VAR,
)  # fmt: skip


def new_rdzv_secret() -> str:
    """A fresh rendezvous secret (256 random bits, hex) for the ranks of one launch.

    Example:
        >>> len(new_rdzv_secret())
        64
    """
    return secrets.token_hex(32)


@dataclass(frozen=True)
class World:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..size-1.
        size: number of processes in the job.
        local_rank: rank among the processes on this host.
        local_size: number of processes on this host.
        cross_rank: index of this host among hosts (rank among processes with the same
            local_rank).
        cross_size: number of hosts.
        launcher: which launcher set the environment: hora, torchrun, openmpi, mpich, slurm, none.
        master_addr: rendezvous host, or None when the launcher gives none (mpirun).
        master_port: rendezvous port, or None when the launcher gives none.
        job_id: an id unique to this launch when the launcher gives one (used for file rendezvous).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    launcher: str = "none"
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None


@dataclass(frozen=True)
class RankEnv:
    """The rank contract: what a hora launcher tells a rank through its environment.

    Every field is optional (None: the variable is not set). The world's names are torchrun's,
    so a script hora starts also runs under torchrun or ``init_process_group("env://")``; the
    ``HORA_*`` ones are hora's own.

    Attributes:
        rank: ``RANK``, the global rank.
        world_size: ``WORLD_SIZE``.
        local_rank: ``LOCAL_RANK``, the rank on this host.
        local_world_size: ``LOCAL_WORLD_SIZE`` (also written as Horovod's ``LOCAL_SIZE``).
        cross_rank: ``CROSS_RANK``, the host's index (also written as torchrun's
            ``GROUP_RANK``, read when ``CROSS_RANK`` is not set).
        cross_size: ``CROSS_SIZE``, the number of hosts.
        master_addr: ``MASTER_ADDR``, the rendezvous host.
        master_port: ``MASTER_PORT``, the rendezvous port.
        launcher: ``HORA_LAUNCHER`` ("hora" when hora placed the rank).
        backend: ``HORA_BACKEND``, "nccl" or "gloo".
        timeout: ``HORA_TIMEOUT``, seconds for each collective.
        start_timeout: ``HORA_START_TIMEOUT``, seconds for the rendezvous.
        gpu: ``HORA_GPU``, this rank's own GPU id(s).
        slots: ``HORA_SLOTS``, this rank's own slots (GPU ids, or CPU slot numbers).
        gpus_per_rank: ``HORA_GPUS_PER_RANK`` (the slurm runtime's launch files).
        job_id: ``HORA_JOB_ID``, the service's job id.
        restart_count: ``HORA_RESTART_COUNT``, 0 on a job's first attempt.
        attempt: ``HORA_ATTEMPT``, the attempt's containment tag ``<instance>/<job>/<attempt>``.
        rdzv_secret: ``HORA_RDZV_SECRET``, the secret sealing the ranks' rendezvous store.
        engine_world: ``HORA_ENGINE_WORLD``, the file naming a notebook engine's world.
        engine_connection: ``HORA_ENGINE_CONNECTION``, where a session's engine (started by
            the service) finds the kernel's controller (JSON; it holds the session's key).
        master_host: ``HORA_MASTER_HOST``, the first node of a Slurm job (its batch script's).
        slurm_job_id: ``HORA_SLURM_JOB_ID``, the Slurm job of a rank.
        node: ``HORA_NODE``, the node a Slurm rank runs on.

    Example:
        >>> RankEnv(rank=1, world_size=2, gpu="3").to_environ()
        {'RANK': '1', 'WORLD_SIZE': '2', 'HORA_GPU': '3'}
        >>> RankEnv.from_environ({"RANK": "1", "LOCAL_SIZE": "2"}).local_world_size
        2
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    cross_rank: int | None = None
    cross_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = None
    backend: str | None = None
    timeout: float | None = None
    start_timeout: float | None = None
    gpu: str | None = None
    slots: str | None = None
    gpus_per_rank: int | None = None
    job_id: int | None = None
    restart_count: int | None = None
    attempt: str | None = None
    rdzv_secret: str | None = field(default=None, repr=False)  # never in a log line
    engine_world: str | None = None
    engine_connection: str | None = field(default=None, repr=False)  # holds a key
    master_host: str | None = None
    slurm_job_id: str | None = None
    node: str | None = None

    def to_environ(self) -> dict[str, str]:
        """The variables of the fields that are set, as strings (seconds as ``%g``).

        Returns:
            A new dict, to merge over a child's base environment.

        Example:
            >>> RankEnv(local_world_size=2, timeout=60.0).to_environ()
            {'LOCAL_WORLD_SIZE': '2', 'LOCAL_SIZE': '2', 'HORA_TIMEOUT': '60'}
        """
        env: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                text = f"{value:g}" if str(f.type).startswith("float") else str(value)
                env.update(dict.fromkeys(_RANK_VARS[f.name], text))
        return env

    @staticmethod
    def var(name: str) -> str:
        """The environment variable of field ``name`` (the one :meth:`from_environ` reads first).

        Example:
            >>> RankEnv.var("attempt")
            'HORA_ATTEMPT'
        """
        return _RANK_VARS[name][0]

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] = os.environ, *, only: Collection[str] | None = None
    ) -> RankEnv:
        """Read the contract's variables; an unset or blank one leaves its field None.

        Args:
            environ: the environment to read (default: this process's).
            only: the names of the fields to read (default: all); the others stay None, so a
                reader is not stopped by a value it does not use.

        Returns:
            The :class:`RankEnv` those variables describe.

        Raises:
            LauncherEnvError: when a number does not parse (the message names the variable).
            ValueError: when ``only`` names a field that :class:`RankEnv` does not have.

        Example:
            >>> RankEnv.from_environ({"GROUP_RANK": "1", "CROSS_RANK": "2"}).cross_rank
            2
            >>> RankEnv.from_environ({"RANK": "1", "HORA_JOB_ID": "x"}, only=["rank"]).rank
            1
        """
        unknown = set(only or ()) - set(_RANK_VARS)
        if unknown:
            raise ValueError(f"RankEnv has no field {', '.join(sorted(unknown))}")
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            names = _RANK_VARS[f.name]
            name = next((n for n in names if environ.get(n, "").strip()), None)
            if name is not None:
                values[f.name] = _parse(name, environ[name], str(f.type))
        return cls(**values)  # type: ignore[arg-type]


# Each field's variables: all are written (to_environ), the first one set is read (from_environ)
_RANK_VARS: dict[str, tuple[str, ...]] = {
    "rank": ("RANK",),
    "world_size": ("WORLD_SIZE",),
    "local_rank": ("LOCAL_RANK",),
    "local_world_size": ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"),
    "cross_rank": ("CROSS_RANK", "GROUP_RANK"),
    "cross_size": ("CROSS_SIZE",),
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
    "launcher": ("HORA_LAUNCHER",),
    "backend": ("HORA_BACKEND",),
    "timeout": ("HORA_TIMEOUT",),
    "start_timeout": ("HORA_START_TIMEOUT",),
    "gpu": ("HORA_GPU",),
    "slots": ("HORA_SLOTS",),
    "gpus_per_rank": ("HORA_GPUS_PER_RANK",),
    "job_id": ("HORA_JOB_ID",),
    "restart_count": ("HORA_RESTART_COUNT",),
    "attempt": ("HORA_ATTEMPT",),
    "rdzv_secret": (RDZV_SECRET_VAR,),
    "engine_world": ("HORA_ENGINE_WORLD",),
    "engine_connection": ("HORA_ENGINE_CONNECTION",),
    "master_host": ("HORA_MASTER_HOST",),
    "slurm_job_id": ("HORA_SLURM_JOB_ID",),
    "node": ("HORA_NODE",),
}


def _parse(name: str, value: str, kind: str) -> object:
    """``value`` of variable ``name`` as the field's type (``int | None``, ``float | None``...)."""
    try:
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        what = "an integer" if kind.startswith("int") else "a number"
        raise LauncherEnvError(f"{name}={value!r} is not {what}") from None
    return value


def rank_env(
    rank: int,
    size: int,
    *,
    local_rank: int | None = None,
    local_size: int | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_MASTER_PORT,
    cross_rank: int = 0,
    cross_size: int = 1,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the environment variables that place one rank in a world.

    The names are torchrun's, so a script started by hora also works under torchrun and
    plain ``torch.distributed.init_process_group("env://")``; ``HORA_LAUNCHER`` marks that hora
    set them.

    Args:
        rank: global rank.
        size: world size.
        local_rank: rank on this host (default: ``rank``).
        local_size: processes on this host (default: ``size``).
        master_addr: rendezvous address.
        master_port: rendezvous port.
        cross_rank: host index.
        cross_size: number of hosts.
        extra: more variables to add (they win over the computed ones).

    Returns:
        A new dict of strings, to merge over a child's base environment.

    Raises:
        LauncherEnvError: when the numbers do not describe a valid world.

    Example:
        >>> rank_env(1, 2, master_port=1234)["RANK"]
        '1'
    """
    lr = rank if local_rank is None else local_rank
    ls = size if local_size is None else local_size
    if size < 1:
        raise LauncherEnvError(f"world size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise LauncherEnvError(f"rank {rank} is outside the world of size {size}")
    if not 0 <= lr < ls:
        raise LauncherEnvError(f"local rank {lr} is outside local size {ls}")
    env = RankEnv(
        rank=rank,
        world_size=size,
        local_rank=lr,
        local_world_size=ls,
        cross_rank=cross_rank,
        cross_size=cross_size,
        master_addr=master_addr,
        master_port=master_port,
        launcher="hora",
    ).to_environ()
    if extra:
        env.update(extra)
    return env


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Read an integer variable; a missing one gives ``default`` (or an error when None)."""
    value = environ.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise LauncherEnvError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise LauncherEnvError(f"{name}={value!r} is not an integer") from None


def _opt(environ: Mapping[str, str], name: str) -> int | None:
    return _int(environ, name) if environ.get(name, "").strip() else None


def _first_slurm_host(nodelist: str) -> str:
    """Return the first host of a Slurm node list (``gpu[03-05,07],cpu1``, ``n[1-2]-ib``)."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?([^,\[]*)", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise LauncherEnvError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first:
        raise LauncherEnvError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    return prefix + first + suffix


def _slurm_tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM_TASKS_PER_NODE (``2(x3),1``), or None if unparsable."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _finish(
    launcher: str,
    environ: Mapping[str, str],
    *,
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    cross_rank: int | None = None,
    cross_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    job_id: str | None = None,
) -> World:
    """Validate the numbers; ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment win."""
    if size < 1:
        raise LauncherEnvError(f"{launcher}: world size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise LauncherEnvError(f"{launcher}: rank {rank} is outside the world of size {size}")
    if not 0 <= local_rank < local_size:
        raise LauncherEnvError(
            f"{launcher}: local rank {local_rank} is outside local size {local_size}"
        )
    port = _int(environ, "MASTER_PORT", 0) or master_port
    if port is not None and not 0 < port < 65536:
        raise LauncherEnvError(f"MASTER_PORT={port} is not a TCP port")
    return World(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=rank // local_size if cross_rank is None else cross_rank,
        cross_size=max(1, size // local_size) if cross_size is None else cross_size,
        launcher=launcher,
        master_addr=environ.get("MASTER_ADDR") or master_addr,
        master_port=port,
        job_id=job_id,
    )


def detect_world(environ: Mapping[str, str]) -> World:
    """Read the world from the variables a launcher set.

    Order: hora/torchrun (``RANK`` + ``WORLD_SIZE``), Open MPI (``OMPI_COMM_WORLD_*``),
    MPICH / Intel MPI (``PMI_RANK``), Slurm srun (``SLURM_PROCID`` with ``SLURM_NTASKS``),
    else a world of one. ``MASTER_ADDR`` / ``MASTER_PORT``, when set, win over what a
    launcher implies.

    Args:
        environ: the process environment (pass ``os.environ``).

    Returns:
        The detected :class:`World`. ``master_addr`` is None under mpirun; the caller then
        uses a rendezvous keyed by ``job_id``.

    Raises:
        LauncherEnvError: when the variables are inconsistent or not integers (the message
            names the variable), or when only ``horovodrun``'s variables are set.

    Example:
        >>> detect_world({"RANK": "1", "WORLD_SIZE": "2"}).rank
        1
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _torchrun(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _openmpi(environ)
    if "PMI_RANK" in environ:
        return _mpich(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _slurm(environ)
    if environ.get("HOROVOD_SIZE", "1").strip() not in ("", "0", "1"):
        # horovodrun --gloo: its rendezvous is Horovod's own HTTP key-value service, which
        # hora cannot join; running every process as a world of one would be silently wrong
        raise LauncherEnvError(
            f"HOROVOD_SIZE={environ['HOROVOD_SIZE']} is set but no launcher hora understands "
            "is: start the script with `hora run -np N`, torchrun or mpirun instead of "
            "horovodrun (Horovod's Gloo rendezvous is not supported)"
        )
    return World()


def _torchrun(environ: Mapping[str, str]) -> World:
    got = RankEnv.from_environ(environ, only=_WORLD_FIELDS)
    if got.world_size is None or got.rank is None:  # present, but blank
        raise LauncherEnvError(f"{'WORLD_SIZE' if got.world_size is None else 'RANK'} is not set")
    size = got.world_size
    return _finish(
        environ.get("HORA_LAUNCHER", "torchrun"),
        environ,
        rank=got.rank,
        size=size,
        local_rank=0 if got.local_rank is None else got.local_rank,
        local_size=size if got.local_world_size is None else got.local_world_size,
        cross_rank=got.cross_rank,
        cross_size=got.cross_size,
        master_addr="127.0.0.1",
        master_port=DEFAULT_MASTER_PORT,
        job_id=environ.get("TORCHELASTIC_RUN_ID"),
    )


# What detect_world reads of the contract (MASTER_* it reads itself: the environment's win
# over what any launcher implies)
_WORLD_FIELDS = ("rank", "world_size", "local_rank", "local_world_size", "cross_rank", "cross_size")


def _openmpi(environ: Mapping[str, str]) -> World:
    job = environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid")
    return _finish(
        "openmpi",
        environ,
        rank=_int(environ, "OMPI_COMM_WORLD_RANK"),
        size=_int(environ, "OMPI_COMM_WORLD_SIZE"),
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_size=_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
        cross_rank=_opt(environ, "OMPI_COMM_WORLD_NODE_RANK"),
        job_id=job,
    )


def _mpich(environ: Mapping[str, str]) -> World:
    size = _int(environ, "PMI_SIZE")
    return _finish(
        "mpich",
        environ,
        rank=_int(environ, "PMI_RANK"),
        size=size,
        local_rank=_int(environ, "MPI_LOCALRANKID", _int(environ, "PMI_LOCAL_RANK", 0)),
        local_size=_int(environ, "MPI_LOCALNRANKS", _int(environ, "PMI_LOCAL_SIZE", size)),
        job_id=environ.get("PMI_KVSNAME") or environ.get("PMI_ID") or environ.get("PMI_JOBID"),
    )


def _slurm(environ: Mapping[str, str]) -> World:
    nodelist = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_NODELIST")
        or environ.get("SLURM_JOB_NODELIST", "")
    )
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "0"
    size = _int(environ, "SLURM_NTASKS")
    nnodes = max(1, _int(environ, "SLURM_NNODES", _int(environ, "SLURM_JOB_NUM_NODES", 1)))
    node = _int(environ, "SLURM_NODEID", 0)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    local_size = _slurm_tasks_on_node(per_node, node) if per_node else None
    return _finish(
        "slurm",
        environ,
        rank=_int(environ, "SLURM_PROCID"),
        size=size,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_size=local_size or max(1, size // nnodes),
        cross_rank=node,
        cross_size=nnodes,
        master_addr=_first_slurm_host(nodelist) if nodelist else "127.0.0.1",
        master_port=DEFAULT_MASTER_PORT + (int(job) % 10000 if job.isdigit() else 0),
        job_id=job,
    )
