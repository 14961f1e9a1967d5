"""What the runtimes share (control plane): a rank's environment and its pid and exit files.

Every runtime (:mod:`~hora_service.runtimes.local`, :mod:`~hora_service.runtimes.docker`,
:mod:`~hora_service.runtimes.slurm`) gives its ranks the environment of
:func:`rank_environment` (layered by :func:`hora.env.layered_env` over the service's
:func:`allowed_env`) and reads what the rank shim records (:func:`read_pid`,
:func:`read_exit`, never following a link). The launch file, one typed value, is
:mod:`~hora_service.runtimes.launchfile`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hora.env import Account, RankEnv, layered_env, rank_env
from hora.spec import SlotKind

from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.paths import JobPaths
from hora_service.runtimes.runfiles import read_int

__all__ = [
    "ALLOWED", "ALLOWED_PREFIXES", "allowed_env", "rank_environment", "read_exit", "read_pid",
    "write_pid",
]  # fmt: skip

# what a job inherits from the service's environment (besides what the admin adds)
ALLOWED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ")
ALLOWED_PREFIXES = ("LC_",)


def allowed_env(service_env: Mapping[str, str], passthrough: Sequence[str] = ()) -> dict[str, str]:
    """What a job inherits from the service's environment: an allow-list, never the rest.

    ``PATH``, ``HOME``, ``USER``, ``LOGNAME``, ``LANG``, ``LANGUAGE``, ``LC_*`` and ``TZ``,
    plus the names the admin lists in ``job_env_passthrough``.

    Example:
        >>> allowed_env({"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "s", "LC_ALL": "C"})
        {'PATH': '/bin', 'LC_ALL': 'C'}
    """
    return {
        k: v
        for k, v in service_env.items()
        if k in ALLOWED or k.startswith(ALLOWED_PREFIXES) or k in passthrough
    }


def rank_environment(plan: AttemptPlan, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of rank ``rank``.

    Layered by :func:`hora.env.layered_env`: ``base`` (the service's :func:`allowed_env`),
    then the job account's ``HOME``, ``USER`` and ``LOGNAME`` in multi-user mode, then the
    job's ``env``, then what hora sets (which wins): the rank contract
    (:class:`hora.env.RankEnv`), ``CUDA_VISIBLE_DEVICES`` of **all** the job's GPUs on this
    host (empty on CPU slots; every rank sees every GPU of the job, so NCCL can use CUDA IPC
    / NVLink between them, and ``hora.torch.init()`` pins each rank to ``cuda:LOCAL_RANK``),
    ``HORA_SLOTS`` (this rank's own; ``HORA_GPU`` too on GPU slots), ``HORA_JOB_ID``,
    ``HORA_RESTART_COUNT`` (0 on the first attempt), ``HORA_ATTEMPT`` (the attempt's
    containment tag), ``HORA_RDZV_SECRET`` (the attempt's rendezvous secret, which seals
    its store), ``PYTHONUNBUFFERED=1`` so that logs stream as they are written, and the
    service's ``HORA_PREFLIGHT*`` settings (``plan.preflight_env``; the job's own
    ``HORA_PREFLIGHT`` wins, so it may turn its preflight off).
    """
    n = plan.ranks
    world = rank_env(
        rank, n, local_rank=rank, local_size=n, master_addr="127.0.0.1",
        master_port=plan.master_port,
    )  # fmt: skip
    gpus = ",".join(map(str, plan.slots)) if plan.slot_kind == SlotKind.gpu else ""
    slots = ",".join(map(str, plan.rank_slots(rank)))
    own = RankEnv(
        slots=slots,
        gpu=slots if plan.slot_kind == SlotKind.gpu else None,  # this rank's own, as for engines
        job_id=plan.job_id,
        restart_count=plan.attempt - 1,
        attempt=plan.container.tag if plan.container is not None else None,
        rdzv_secret=plan.rdzv_secret or None,
    )
    hora = {
        **world, "CUDA_VISIBLE_DEVICES": gpus, **own.to_environ(), "PYTHONUNBUFFERED": "1",
        **dict(plan.preflight_env),
    }  # fmt: skip
    who = plan.run_as
    return layered_env(
        base,
        account=Account(user=who.user, home=str(who.home)) if who is not None else None,
        job=plan.spec.env,
        rank=hora,
        defaults=(RankEnv.var("preflight"),),  # the job may turn its own preflight off
    )


def read_exit(paths: JobPaths, rank: int) -> int | None:
    """The exit code the shim recorded for ``rank``, or None if it recorded none.

    Raises:
        UntrustedRunFile: the file is not one the shim wrote (a symlink, a FIFO, ...).
    """
    return read_int(paths.exit(rank))


def read_pid(paths: JobPaths, rank: int) -> int | None:
    """The shim's pid for ``rank``, or None if it never started.

    Raises:
        UntrustedRunFile: the file is not one the shim wrote (a symlink, a FIFO, ...).
    """
    return read_int(paths.pid(rank))


def write_pid(paths: JobPaths, rank: int, pid: int) -> None:
    """Record the shim's pid (atomically, as the shim itself does)."""
    path = paths.pid(rank)
    tmp = path.with_suffix(".pid.tmp-service")
    tmp.write_text(str(pid))
    os.replace(tmp, path)
