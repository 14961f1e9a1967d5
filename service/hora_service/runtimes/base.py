"""What every runtime provides, and the plan of one attempt (control plane).

A runtime turns an :class:`AttemptPlan` (pure data: the spec, the slots, the run directory)
into running ranks. :meth:`Runtime.start` and :meth:`Runtime.adopt` do the logging and
timing and call the ``_start`` / ``_adopt`` hooks that local, docker and slurm implement.
Each rank is a :class:`RankProcess` the manager polls and signals.
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hora.spec import JobSpec

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
        run_dir: ``DATA_DIR/logs/<job>/<attempt>``: logs and the ranks' pid/exit files.
        workdir: the ranks' working directory (already confined to the work root).
        master_port: rendezvous port for rank 0.
    """

    job_id: int
    attempt: int
    spec: JobSpec
    slots: tuple[int, ...]
    slot_kind: str
    run_dir: Path
    workdir: Path
    master_port: int

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The slots of one rank: ``gpus_per_worker`` consecutive ones of the job's."""
        g = self.spec.gpus_per_worker
        return self.slots[rank * g : (rank + 1) * g]

    def log_path(self, rank: int) -> Path:
        """Where rank ``rank`` writes its output."""
        return self.run_dir / f"rank{rank}.log"


class Exit(enum.Enum):
    """How a rank's state reads when it is not a plain exit code."""

    running = "running"
    lost = "lost"  # gone, and nobody recorded how it ended


RankStatus = int | Exit


class RankProcess(ABC):
    """One rank as the manager sees it."""

    rank: int

    @abstractmethod
    def poll(self) -> RankStatus:
        """The exit code (negative: killed by that signal), ``Exit.running`` or ``Exit.lost``."""

    @abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group; no error if it is gone."""


class Runtime(ABC):
    """Starts and re-adopts the ranks of an attempt (see the module docstring)."""

    name = "runtime"

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
        plan.run_dir.mkdir(parents=True, exist_ok=True)
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

    @abstractmethod
    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]: ...

    @abstractmethod
    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]: ...


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
