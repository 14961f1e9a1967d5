"""How a job becomes one ``sbatch`` submission: pure functions, no I/O (control plane).

:func:`render_sbatch` turns an attempt into the ``sbatch`` argument list, the environment
``sbatch`` runs with, and the batch script. The batch script is a constant: no user value is
ever written into it, nor into ``sbatch``'s arguments: the user's command and environment
are in the ranks' launch files (on the shared filesystem, readable by the service alone), so
neither ``squeue`` nor ``/proc`` on a node shows them. Every choice hora makes (nodes, tasks
per node, GPUs, partition, account, QoS, time limit, signal) is an ``sbatch`` option. The
script runs one ``srun`` that starts every rank under the rank launcher
(:mod:`hora_service.runtimes.slurm_rank`), which fills in the rank's place from Slurm's
variables and hands over to the rank shim.

Example:
    >>> layout_for(workers=4, gpus_per_worker=1, per_node=2, nodes=None)
    Layout(nodes=2, per_node=2)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hora.env import RankEnv
from hora.errors import SpecError
from hora.spec import JobSpec, Priority

from hora_service.runtimes.paths import JobPaths

# The batch script: constant text. It records the first node's host name (the ranks'
# MASTER_ADDR), passes USR2 (preemption / time-limit warning, ``--signal=B:USR2@N``) and
# TERM on to the step, and exits with srun's status. The first node's variable is named by the
# rank contract (RankEnv.master_host), filled in once, here.
_BATCH = """#!/bin/sh
# hora's batch script. It is the same for every job: no user value is written into it. Its
# arguments start the rank launcher; everything else is an sbatch option.
@MASTER_HOST@=$(hostname)
export @MASTER_HOST@
step=
trap '[ -n "$step" ] && kill -USR2 "$step" 2>/dev/null' USR2
trap '[ -n "$step" ] && kill -TERM "$step" 2>/dev/null' TERM
"$HORA_SRUN" --distribution=block --kill-on-bad-exit=0 "$@" &
step=$!
while :; do
  wait "$step"
  rc=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$rc"
"""
BATCH_SCRIPT = _BATCH.replace("@MASTER_HOST@", RankEnv.var("master_host"))


@dataclass(frozen=True)
class SlurmOptions:
    """What the admin's settings say about Slurm submissions (see :class:`Settings`).

    Attributes:
        slots_per_node: ranks' GPUs (or CPU ranks) one node holds; jobs span
            ``ceil(workers * gpus_per_worker / slots_per_node)`` nodes unless they say.
            None: what the partition's nodes report (their GPUs, or CPUs), asked of Slurm.
        gpus: ask Slurm for GPUs (``--gres=gpu:G``); False on a CPU-only partition.
        partition, account, qos: passed as ``--partition``, ``--account``, ``--qos``.
        high_qos: QoS for ``priority: high`` jobs (None: ``qos``).
        low_nice: ``--nice`` of ``priority: low`` jobs.
        signal_s: USR2 goes to the batch script this many seconds before the time limit
            (and at preemption): ``--signal=B:USR2@N``.
        default_time_min: ``--time`` of a job without ``timeout_s`` (None: the partition's).
        grace_s: added to ``timeout_s`` in ``--time``: hora stops the job itself first.
    """

    slots_per_node: int | None = None
    gpus: bool = True
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    high_qos: str | None = None
    low_nice: int = 100
    signal_s: int = 60
    default_time_min: int | None = None
    grace_s: float = 10.0


@dataclass(frozen=True)
class Layout:
    """Nodes of a Slurm job and ranks on each."""

    nodes: int
    per_node: int


@dataclass(frozen=True)
class Submission:
    """What :func:`render_sbatch` produces: run ``argv`` with ``env``; the script's text."""

    argv: list[str]
    env: dict[str, str]
    script: str


def layout_for(workers: int, gpus_per_worker: int, per_node: int, nodes: int | None) -> Layout:
    """Spread ``workers`` ranks over nodes of ``per_node`` slots (whole nodes, block order).

    Raises:
        SpecError: the ranks do not fill the nodes evenly (field ``workers``), or one rank
            needs more GPUs than a node has (``gpus_per_worker``).
    """
    if gpus_per_worker > per_node:
        raise SpecError(
            "gpus_per_worker", f"asks for {gpus_per_worker} GPUs per rank; a node has {per_node}"
        )
    if nodes is None:
        nodes = math.ceil(workers * gpus_per_worker / per_node)
    if workers % nodes:
        raise SpecError(
            "workers",
            f"{workers} workers do not spread evenly over {nodes} nodes "
            f"({per_node // gpus_per_worker} ranks fit on a node): ask for a multiple of {nodes}",
        )
    if (workers // nodes) * gpus_per_worker > per_node:
        raise SpecError(
            "workers", f"{workers // nodes} ranks per node need more than its {per_node} slots"
        )
    return Layout(nodes, workers // nodes)


def job_name(instance: str, job_id: int, attempt: int) -> str:
    """The Slurm job name of an attempt: unique per service, found again after a restart.

    Example:
        >>> job_name("3f2a", 12, 2)
        'hora-3f2a-12.2'
    """
    return f"hora-{instance}-{job_id}.{attempt}"


def instance_of(data_dir: Path) -> str:
    """A short stable tag of one service (its data directory)."""
    return hashlib.sha256(str(data_dir).encode()).hexdigest()[:8]


def _escape(path: Path) -> str:
    """A path for ``--output``: Slurm expands ``%`` there, ``%%`` is a plain ``%``."""
    return str(path).replace("%", "%%")


def time_limit(timeout_s: float | None, opts: SlurmOptions) -> int | None:
    """``--time`` in whole minutes: the job's timeout plus hora's grace, rounded up."""
    if timeout_s is None:
        return opts.default_time_min
    return max(1, math.ceil((timeout_s + opts.grace_s) / 60))


def signal_offset(timeout_s: float | None, opts: SlurmOptions) -> int:
    """Seconds before ``--time`` that USR2 warns: never before hora's own timeout and grace.

    ``--time`` is whole minutes, so a short ``timeout_s`` with the default offset would have
    Slurm warn (USR2, whose default action ends a rank) before hora times the job out.

    Example:
        >>> signal_offset(2, SlurmOptions(grace_s=30, signal_s=60))
        28
    """
    minutes = time_limit(timeout_s, opts)
    if timeout_s is None or minutes is None:
        return opts.signal_s
    return max(0, min(opts.signal_s, int(minutes * 60 - timeout_s - opts.grace_s)))


def _policy(spec: JobSpec, opts: SlurmOptions) -> list[str]:
    out = []
    for flag, value in (("--partition", opts.partition), ("--account", opts.account)):
        if value:
            out.append(f"{flag}={value}")
    qos = opts.high_qos if spec.priority == Priority.high and opts.high_qos else opts.qos
    if qos:
        out.append(f"--qos={qos}")
    if spec.priority == Priority.low and opts.low_nice:
        out.append(f"--nice={opts.low_nice}")
    return out


def render_sbatch(
    spec: JobSpec,
    *,
    name: str,
    run_dir: Path,
    workdir: Path,
    layout: Layout,
    opts: SlurmOptions,
    tools: dict[str, str],
    launcher: Sequence[str],
    batch_script: Path,
) -> Submission:
    """The ``sbatch`` submission of one attempt (pure: same inputs, same output).

    Args:
        spec: the job.
        name: the Slurm job name (:func:`job_name`).
        run_dir: the attempt's directory, on a filesystem the nodes share.
        workdir: the ranks' working directory (``--chdir``).
        layout: nodes and ranks per node.
        opts: the admin's settings.
        tools: absolute paths of ``sbatch`` and ``srun``; ``SLURM_CONF`` when set.
        launcher: the argument list that starts the rank launcher (``RUN_DIR`` follows).
        batch_script: where :data:`BATCH_SCRIPT` is written.

    Returns:
        The argument list, its environment (nothing of the service's own beyond ``PATH``),
        and the batch script's text.
    """
    argv = [
        tools["sbatch"],
        "--parsable",
        f"--job-name={name}",
        f"--nodes={layout.nodes}",
        f"--ntasks-per-node={layout.per_node}",
        "--distribution=block",
        f"--chdir={workdir}",
        f"--output={_escape(JobPaths(run_dir).slurm_out)}",
        "--open-mode=append",
        "--no-requeue",
        f"--signal=B:USR2@{signal_offset(spec.timeout_s, opts)}",
        "--export=ALL",  # of the env below, which holds nothing of the service's
    ]
    if opts.gpus:
        argv.append(f"--gres=gpu:{layout.per_node * spec.gpus_per_worker}")
    minutes = time_limit(spec.timeout_s, opts)
    if minutes is not None:
        argv.append(f"--time={minutes}")
    argv += _policy(spec, opts)
    argv += [str(batch_script), *launcher, str(run_dir)]
    env = {"PATH": tools.get("path", "/usr/bin:/bin"), "HORA_SRUN": tools["srun"]}
    if tools.get("conf"):
        env["SLURM_CONF"] = tools["conf"]
    return Submission(argv, env, BATCH_SCRIPT)
