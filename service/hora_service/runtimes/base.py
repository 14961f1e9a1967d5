"""What every runtime provides, and the plan of one attempt (control plane).

A runtime turns an :class:`AttemptPlan` (pure data: the spec, the slots, the run directory)
into running ranks. :meth:`Runtime.start` and :meth:`Runtime.adopt` do the logging and
timing and call the ``_start`` / ``_adopt`` hooks that local, docker and slurm implement.
Each rank is a :class:`RankProcess` the manager polls and signals; :meth:`Runtime.clear`
kills whatever is left of an attempt (descendants, ``setsid()`` daemons) and says when
nothing is: only then are its slots free.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hora.errors import SpecError
from hora.spec import JobSpec, SlotKind

from hora_service.identity import RunAs
from hora_service.runtimes.containment import Container
from hora_service.runtimes.limits import Hits, JobLimits, hits
from hora_service.runtimes.paths import JobPaths
from hora_service.runtimes.runfiles import UntrustedRunFile
from hora_service.scheduling.reasons import ReasonBoard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptPlan:
    """Everything needed to start one attempt of a job (built by the manager).

    Attributes:
        job_id: the job.
        attempt: 1 for the first run, 2 for the first retry, ...
        spec: what the user asked for.
        slots: the slot indices the scheduler gave the job, ``gpus_per_worker`` per rank.
        slot_kind: ``gpu`` or ``cpu``.
        run_dir: ``DATA_DIR/logs/<job>/<attempt>``: logs and the ranks' pid/exit files, named
            by :attr:`paths`.
        workdir: the ranks' working directory (already confined to the work root).
        master_port: rendezvous port for rank 0.
        run_as: the OS account the ranks run as; None: the service's own (single-user and
            shared modes).
        container: the attempt's process container (cgroup); None: no containment beyond
            the ranks' process groups (only tests that drive a runtime directly).
        log_bytes: most log bytes the attempt keeps, split evenly over its ranks.
        limits: memory, pids and CPU limits of the attempt (None: none).
        umask: the ranks' file mode creation mask.
        preflight_env: the ``HORA_PREFLIGHT*`` variables the service sets in every rank
            (``HORA_PREFLIGHT`` itself only where the job's ``env`` does not set it).
        rdzv_secret: the ranks' rendezvous secret (``HORA_RDZV_SECRET``), fresh for each
            attempt; empty: none. Never in the plan's repr.
        private_network: the attempt's sockets are its own (setting
            ``job_private_network``; never for sessions): a network (and mount) namespace
            in the local runtime, ``--network none`` in docker.
        work_root: the service's work root, which stays visible in the attempt's mount
            namespace with ``workdir`` even when it lies under ``/tmp`` (None: ``workdir``
            alone).
        tmp_paths: more host directories under ``/tmp`` that stay visible there: of the
            setting ``job_tmp_paths`` and those the job was given (see
            :func:`hora_service.runtimes.namespaces.given_paths`), the ones its account
            reaches (the start check finds them).
        tmp_bytes: most bytes each of the attempt's private ``/tmp``, ``/var/tmp`` and
            ``/dev/shm`` holds (setting ``job_disk_limit``; None: the kernel's tmpfs default,
            half the machine's memory), where the runtime gives it its own.
        driver: an elastic job's one process (``hora run``'s elastic driver, which starts
            the workers itself, :mod:`hora_service.runtimes.elastic_run`), run as rank 0 instead of
            ``spec.workers`` copies of ``spec.command``; empty for every other job.
        leases: the service's open lease file of each slot (:mod:`hora.leases`), in the
            order of ``slots``, for the rank shims of the local runtime to inherit (never
            the ranks' commands): a lease then lasts while its rank runs, across a restart
            of the service. Empty: the service alone holds them.
    """

    job_id: int
    attempt: int
    spec: JobSpec
    slots: tuple[int, ...]
    slot_kind: SlotKind
    run_dir: Path
    workdir: Path
    master_port: int
    run_as: RunAs | None = None
    container: Container | None = None
    log_bytes: int = 256 << 20
    limits: JobLimits | None = None
    umask: int = 0o077
    preflight_env: tuple[tuple[str, str], ...] = ()
    rdzv_secret: str = field(default="", repr=False)
    private_network: bool = False
    work_root: Path | None = None
    tmp_paths: tuple[Path, ...] = ()
    tmp_bytes: int | None = None
    driver: tuple[str, ...] = ()
    leases: tuple[int, ...] = ()

    @property
    def ranks(self) -> int:
        """How many processes the runtime starts: one for an elastic job's driver."""
        return 1 if self.driver else self.spec.workers

    @property
    def command(self) -> list[str]:
        """What each rank runs: the driver of an elastic job, else the spec's command."""
        return list(self.driver or self.spec.command)

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The slots of one rank: ``gpus_per_worker`` consecutive ones of the job's."""
        g = self.spec.gpus_per_worker
        return self.slots[rank * g : (rank + 1) * g]

    def rank_leases(self, rank: int) -> tuple[int, ...]:
        """The lease files of one rank's slots (empty when the service alone holds them)."""
        if len(self.leases) != len(self.slots):
            return ()
        g = self.spec.gpus_per_worker
        return self.leases[rank * g : (rank + 1) * g]

    @property
    def paths(self) -> JobPaths:
        """The attempt's files: each rank's log, pid, exit and launch file, and the rest."""
        return JobPaths(self.run_dir)

    @property
    def rank_log_bytes(self) -> int:
        """Most bytes one rank's log keeps."""
        return max(1 << 12, self.log_bytes // self.ranks)


class Exit(enum.Enum):
    """How a rank's state reads when it is not a plain exit code."""

    running = "running"
    lost = "lost"  # gone, and nobody recorded how it ended


RankStatus = int | Exit


class RankProcess(ABC):
    """One rank as the manager sees it.

    Attributes:
        rank: the rank.
        note: what the runtime knows of how the rank ended beyond its status (the Docker
            engine stopped answering, the container ran out of memory), for the job's reason.
        container_id: the container the rank runs in (docker), else None.
    """

    rank: int
    note: str | None = None
    container_id: str | None = None

    @property
    def pending_reason(self) -> str | None:
        """Why the runtime still holds the rank back (a cluster's queue), else None: started."""
        return None

    @abstractmethod
    def poll(self) -> RankStatus:
        """The exit code (negative: killed by that signal), ``Exit.running`` or ``Exit.lost``."""

    @abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group; no error if it is gone."""


def rank_status(rank: RankProcess) -> RankStatus:
    """``rank.poll()``; a run file the job planted ends the rank as lost, saying why.

    The runtimes read the shim's files with :mod:`~hora_service.runtimes.runfiles`, which
    refuses a symlink, a FIFO or a file of another owner instead of reading it; the rank is
    then over for the manager (its attempt is stopped and cleared) and the reason names
    the file.
    """
    try:
        return rank.poll()
    except UntrustedRunFile as e:
        rank.note = str(e)
        return Exit.lost


class Runtime(ABC):
    """Starts and re-adopts the ranks of an attempt (see the module docstring).

    Attributes:
        name: the runtime's name (the spec's ``runtime``).
        queues: whether the runtime queues what it is given (Slurm): the job stays
            ``starting`` while any rank's :attr:`RankProcess.pending_reason` says why it waits,
            and a restart re-adopts a starting job instead of failing it.
        uses_cgroup: whether the ranks run in the attempt's own cgroup (``plan.container``),
            which :meth:`start` then creates; docker's ranks run in the container's.
        replaces_ranks: whether :meth:`replace_rank` can start one rank of a running
            attempt again (a notebook session's dead engine).
    """

    name = "runtime"
    uses_cgroup = True
    queues = False  # the runtime has a queue of its own (Slurm): a started job may wait there
    replaces_ranks = False  # it can start one rank of a running attempt again (replace_rank)
    # where the runtime posts why a job it holds back waits (set by the job manager)
    waits: ReasonBoard | None = None

    def replace_rank(
        self, plan: AttemptPlan, rank: int, base_env: dict[str, str], master_port: int
    ) -> RankProcess:
        """Start rank ``rank`` of a running attempt again, its peers untouched.

        For a notebook session whose engine died (``POST /v1/sessions/{id}/replace``,
        :func:`hora_service.api.sessions.replace_engine`): the new engine meets the surviving
        ones at the store on ``master_port``, which they host.

        Raises:
            SpecError: this runtime cannot start one rank alone (field ``runtime``).
        """
        raise SpecError(
            "runtime",
            f"the {self.name} runtime cannot start one engine of a session alone; "
            "a session there ends when one of its engines dies",
        )

    def check(self, spec: JobSpec) -> None:
        """Refuse at submission a spec this runtime can never run.

        Raises:
            SpecError: naming the field to change (``image`` for the docker runtime).
        """
        self._check(spec)

    def _check(self, spec: JobSpec) -> None:
        return None

    def start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        """Start every rank of ``plan``; on a failure, stop the ranks already started.

        Args:
            plan: the attempt.
            base_env: environment the ranks start from (the job's env and the rank
                variables are added on top).

        Returns:
            One process per rank, by rank.
        """
        t0 = time.perf_counter()
        prepare_run_dir(plan)
        if plan.container is not None and self.uses_cgroup:
            plan.container.create()
        ranks = self._start(plan, base_env)
        log.info(
            "job %d attempt %d: %d rank(s) started by %s in %.1f ms",
            plan.job_id,
            plan.attempt,
            len(ranks),
            self.name,
            (time.perf_counter() - t0) * 1000,
        )
        return ranks

    def adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        """Find the ranks of an attempt started by an earlier run of the service."""
        ranks = self._adopt(plan)
        log.info("job %d attempt %d: re-adopted %d rank(s)", plan.job_id, plan.attempt, len(ranks))
        return ranks

    def clear(self, plan: AttemptPlan) -> bool:
        """Kill every process left of an ended attempt; True once none is left.

        The manager calls it until it answers True and frees the attempt's slots only then.
        """
        try:
            empty = self._clear(plan)
        except OSError as e:
            log.warning("job %d attempt %d: cannot clear: %s", plan.job_id, plan.attempt, e)
            return False
        if not empty:
            log.info("job %d attempt %d: processes left; killing", plan.job_id, plan.attempt)
        return empty

    def _clear(self, plan: AttemptPlan) -> bool:
        return plan.container.clear() if plan.container is not None else True

    def cpu_seconds(self, plan: AttemptPlan) -> float | None:
        """CPU seconds the attempt's processes have used; None where it cannot be told.

        The service's own measure of whether an attempt computes (a session's idle time
        does not rest on what its kernel says).
        """
        try:
            return self._cpu_seconds(plan)
        except OSError as e:
            log.debug("job %d: no CPU time: %s", plan.job_id, e)
            return None

    def _cpu_seconds(self, plan: AttemptPlan) -> float | None:
        if plan.container is None or not self.uses_cgroup:
            return None
        return plan.container.cpu_seconds()

    def nodes(self, plan: AttemptPlan) -> frozenset[str]:
        """The nodes the attempt's ranks run on, as the service knows them: this machine.

        Runtimes that place ranks elsewhere (Slurm) say where.
        """
        return frozenset({socket.gethostname()})

    def limit_hits(self, plan: AttemptPlan) -> Hits:
        """How often the attempt ran into its memory and pids limits (read from its cgroup)."""
        box = plan.container
        if box is None or box.kind == "tag":
            return Hits()
        return hits(box.kind, box.dirs)

    @abstractmethod
    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]: ...

    @abstractmethod
    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]: ...


def prepare_run_dir(plan: AttemptPlan) -> None:
    """Create the attempt's run directory: the service's, readable by the job's group only.

    ``logs/<job>`` and ``logs/<job>/<attempt>`` are mode 0750 with the job account's primary
    group (the service's own without one), so the service reads and writes everything and
    the job's owner can only read; no other account gets in.
    """
    gid = plan.run_as.gid if plan.run_as is not None else os.getegid()
    for d in (plan.paths.job_dir, plan.run_dir):
        d.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 or gid == os.getegid():
            os.chown(d, -1, gid)
        d.chmod(0o750)


def first_failure(codes: Sequence[RankStatus]) -> tuple[int, RankStatus] | None:
    """The first rank that failed (non-zero or lost), with its status; None if none did.

    Example:
        >>> first_failure([0, 3, Exit.lost])
        (1, 3)
    """
    for rank, code in enumerate(codes):
        if code is Exit.lost or (isinstance(code, int) and code != 0):
            return rank, code
    return None
