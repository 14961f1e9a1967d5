"""The rank contract (data plane): every variable a hora launcher gives a rank, named once.

:class:`RankEnv` holds what a hora launcher (``hora run``, the notebook engines, the
service's runtimes) writes into a rank's environment and the data plane reads back, one typed
field each, with :meth:`RankEnv.to_environ` and :meth:`RankEnv.from_environ` as the only
spelling of their names (:meth:`RankEnv.var` gives one name, for a reader that parses its
variable itself). :data:`LAUNCHER_VARS` lists what a launcher strips from the environment it
starts from. :mod:`hora.env` re-exports both, beside the world's builder and reader.

It imports only the standard library and :mod:`hora.errors` (``hora.torch`` reads it too).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from hora.errors import LauncherEnvError

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


def preflight_pipe(environ: Mapping[str, str] = os.environ) -> int | None:
    """The preflight's pipe that ``HORA_PREFLIGHT_FD`` names, if this process holds it.

    The rank shim gives rank 0 a pipe for the preflight's figures and names it
    ``FD:DEV:INO``; a process that did not inherit it (a launcher closed it) may hold another
    file under that number, which the device and inode tell apart. A launcher passes it on
    to the processes it starts (``pass_fds``).

    Example:
        >>> preflight_pipe({"HORA_PREFLIGHT_FD": "0:1:2"}) is None
        True
    """
    raw = environ.get(_RANK_VARS["preflight_fd"][0], "")
    try:
        fd, dev, ino = (int(x) for x in raw.split(":"))
        st = os.fstat(fd)
    except (ValueError, OSError):
        return None
    ok = stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino)
    return fd if ok else None


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
        preflight: ``HORA_PREFLIGHT``, "1" (or on, true, yes) to measure the world's paths
            at ``hvd.init()`` (the service sets it for a job's ranks; a job may set "0").
        preflight_warn_below: ``HORA_PREFLIGHT_WARN_BELOW``, the fraction of its reference
            under which the preflight names a path.
        preflight_fail_below: ``HORA_PREFLIGHT_FAIL_BELOW``, the fraction under which the
            preflight fails ``hvd.init()``.
        preflight_baseline: ``HORA_PREFLIGHT_BASELINE``, the folder of the nodes' baselines.
        preflight_fd: ``HORA_PREFLIGHT_FD``, ``FD:DEV:INO``: the descriptor (and its file's
            device and inode) where rank 0 writes the preflight's figures for the hora
            service; the rank shim opens it in the attempt's run directory.
        elastic_dir: ``HORA_ELASTIC_DIR``, an elastic ``hora run``'s rendezvous folder
            (:mod:`hora.launch.elastic_rdzv`).
        elastic_worker: ``HORA_ELASTIC_WORKER``, the worker id (``w3``) in an elastic run.
        elastic_timeout: ``HORA_ELASTIC_TIMEOUT``, seconds the workers may wait below
            ``--min-np``.
        restore_dir: ``HORA_RESTORE_DIR``, the snapshot a resumed session's engine restores
            (:mod:`hora.engines.park`); it starts reading its part at once.
        restore_size: ``HORA_RESTORE_SIZE``, the number of engines the snapshot was taken
            with (at another size every engine restores rank 0's part).

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
    preflight: str | None = None
    preflight_warn_below: float | None = None
    preflight_fail_below: float | None = None
    preflight_baseline: str | None = None
    preflight_fd: str | None = None
    elastic_dir: str | None = None
    elastic_worker: str | None = None
    elastic_timeout: float | None = None
    restore_dir: str | None = None
    restore_size: int | None = None

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
    "preflight": ("HORA_PREFLIGHT",),
    "preflight_warn_below": ("HORA_PREFLIGHT_WARN_BELOW",),
    "preflight_fail_below": ("HORA_PREFLIGHT_FAIL_BELOW",),
    "preflight_baseline": ("HORA_PREFLIGHT_BASELINE",),
    "preflight_fd": ("HORA_PREFLIGHT_FD",),
    "elastic_dir": ("HORA_ELASTIC_DIR",),
    "elastic_worker": ("HORA_ELASTIC_WORKER",),
    "elastic_timeout": ("HORA_ELASTIC_TIMEOUT",),
    "restore_dir": ("HORA_RESTORE_DIR",),
    "restore_size": ("HORA_RESTORE_SIZE",),
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
