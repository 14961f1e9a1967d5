"""Launcher environment contract (data plane).

Pure functions define how a process learns its place in a data-parallel world:

* :func:`rank_env` builds the variables that place rank ``r`` in its world, and
  :func:`layered_env` the whole environment of a rank from its layers (what it starts from,
  its account, its job's own variables, then what hora sets): every launcher uses both
  (``hora run`` and its elastic driver, the notebook engines, the service's runtimes), so
  they agree by construction.
* :func:`detect_world` reads whichever launcher started this process: hora / torchrun,
  Open MPI, MPICH / Intel MPI, Slurm's srun, or none (a world of one).

The contract itself, :class:`~hora.contract.RankEnv` (every variable a hora launcher writes
into a rank's environment and the data plane reads back) and
:data:`~hora.contract.LAUNCHER_VARS`, is in :mod:`hora.contract`; it is re-exported here.

Neither touches ``os.environ``: callers pass the mapping in and hand the result to children.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from hora.contract import LAUNCHER_VARS, RDZV_SECRET_VAR, RankEnv, new_rdzv_secret
from hora.errors import LauncherEnvError

__all__ = [
    "DEFAULT_MASTER_PORT", "LAUNCHER_VARS", "RDZV_SECRET_VAR", "TORCHRUN_DEFAULTS", "Account",
    "RankEnv", "World", "detect_world", "layered_env", "new_rdzv_secret", "rank_env",
]  # fmt: skip

DEFAULT_MASTER_PORT = 29500
# What ``hora run`` gives its ranks unless their environment says otherwise, as torchrun does:
# unbuffered output (lines stream live through the rank prefixer) and one OpenMP thread.
TORCHRUN_DEFAULTS = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


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


@dataclass(frozen=True)
class Account:
    """The OS account a rank runs as, as its environment names it.

    Example:
        >>> Account(user="ann", home="/home/ann").to_environ()
        {'HOME': '/home/ann', 'USER': 'ann', 'LOGNAME': 'ann'}
    """

    user: str
    home: str

    def to_environ(self) -> dict[str, str]:
        """``HOME``, ``USER`` and ``LOGNAME``."""
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user}


def layered_env(
    base: Mapping[str, str],
    *,
    strip: Collection[str] = (),
    account: Account | None = None,
    job: Mapping[str, str] | None = None,
    rank: Mapping[str, str] | None = None,
    defaults: Collection[str] = (),
) -> dict[str, str]:
    """Build one rank's environment from its layers, each over the ones before it.

    1. ``base``, less the names in ``strip`` (what the rank starts from: the service's
       allow-list, the notebook kernel's or ``hora run``'s own environment);
    2. ``account``'s ``HOME``, ``USER`` and ``LOGNAME`` (a rank run as another account);
    3. ``job``, the job's own variables;
    4. ``rank``, what hora sets, in order: the rank contract (:func:`rank_env` and
       :meth:`RankEnv.to_environ`) and hora's own values. They win over every layer above,
       except the names in ``defaults``: such a value only fills a gap, an earlier layer's
       value stays.

    A name keeps the place of the first layer that set it (the launch file keeps the order).

    Args:
        base: the environment the rank starts from (not modified).
        strip: names of ``base`` the rank must not inherit (e.g. :data:`LAUNCHER_VARS`).
        account: the account the rank runs as, or None (the caller's own, as in ``base``).
        job: the job's own variables, or None.
        rank: what hora sets for this rank, or None.
        defaults: the names of ``rank`` whose values are defaults only.

    Returns:
        A new dict.

    Example:
        >>> layered_env({"PATH": "/bin", "RANK": "9", "OMP_NUM_THREADS": "4"}, strip={"RANK"},
        ...             job={"SEED": "1"}, rank={"RANK": "0", **TORCHRUN_DEFAULTS},
        ...             defaults=TORCHRUN_DEFAULTS)
        {'PATH': '/bin', 'OMP_NUM_THREADS': '4', 'SEED': '1', 'RANK': '0', 'PYTHONUNBUFFERED': '1'}
    """
    env = {k: v for k, v in base.items() if k not in strip}
    if account is not None:
        env.update(account.to_environ())
    env.update(job or {})
    for key, value in (rank or {}).items():
        env[key] = env.get(key, value) if key in defaults else value
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
