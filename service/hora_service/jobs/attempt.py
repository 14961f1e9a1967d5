"""A running attempt and the views of who holds slots, shared by the manager's roles.

:class:`Attempt` is the monitor's record of one attempt's ranks and how they are being
stopped; :class:`Holder` and :class:`QueueView` are what a queued request is shown;
:func:`describe` words a rank's failure.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from hora.procs import ended
from hora.spec import JobKind, JobSpec, JobState, RuntimeName

from hora_service.runtimes import AttemptPlan, Exit, RankProcess
from hora_service.runtimes.base import RankStatus
from hora_service.runtimes.elastic_run import ElasticRun
from hora_service.scheduling.scheduler import INF
from hora_service.users.usage import Usage


@dataclass
class Attempt:
    """One running attempt: its ranks, and how it is being stopped, if it is."""

    job_id: int
    user: str
    plan: AttemptPlan
    ranks: list[RankProcess]
    started: float
    deadline: float | None
    stop_state: JobState | None = None
    stop_reason: str | None = None
    kill_at: float = INF
    retriable: bool = True
    codes: list[RankStatus] = field(default_factory=list)
    clearing_since: float | None = None
    stuck_reported: bool = False
    kind: JobKind = JobKind.job
    held: bool = False  # its runtime's own queue still holds it (Slurm): recorded ``queued``
    held_why: str | None = None  # the runtime's reason recorded last (Slurm's pending reason)
    created: float = 0.0  # when the job was submitted (its queue wait ends when it runs)
    elastic: ElasticRun | None = None  # an elastic job's membership, read from its driver
    counted: float | None = None  # its slot-seconds are in the usage up to then (None: none)
    # a session's dead engines, kept (their slots too) until the kernel asks for new ones
    lost: dict[int, str] = field(default_factory=dict)

    def count(self, usage: Usage, now: float) -> None:
        """Add the slot-seconds held since the last count (slots change in an elastic job)."""
        usage.held(self.user, len(self.plan.slots), now - (self.counted or self.started))
        self.counted = now

    def stop(self, state: JobState, reason: str, now: float, grace: float, retry: bool) -> None:
        """Begin stopping every rank: SIGTERM now, SIGKILL at ``now + grace``."""
        # a cancel may replace a failure or a park already being stopped (the user's word is
        # final and a cancelled job is not retried); nothing replaces a cancel
        replaceable = (JobState.failed, JobState.parked) if state == JobState.cancelled else (
            JobState.failed,)  # fmt: skip
        if self.stop_state is not None and self.stop_state not in replaceable:
            return
        self.stop_state, self.stop_reason, self.retriable = state, reason, retry
        self.kill_at = min(self.kill_at, now + grace)
        for rank in self.ranks:
            rank.signal(signal.SIGTERM)


def held_reason(ranks: list[RankProcess], runtime: str) -> str | None:
    """Why a queueing runtime (Slurm) holds the attempt back, in words; None: it does not.

    Example:
        >>> from types import SimpleNamespace as R
        >>> held_reason([R(pending_reason="Resources")], "slurm")
        'slurm: Resources'
        >>> held_reason([R(pending_reason="None")], "slurm")  # not yet given a reason
        'slurm: pending'
        >>> held_reason([R(pending_reason=None)], "slurm") is None
        True
    """
    why = next((r.pending_reason for r in ranks if r.pending_reason is not None), None)
    if why is None:
        return None
    return f"{runtime}: {why if why not in ('', 'None') else 'pending'}"


def container_of(ranks: list[RankProcess]) -> dict[str, object]:
    """The ``container_id`` field of a job record: its ranks' container (or Slurm job)."""
    boxes = {r.container_id for r in ranks if r.container_id is not None}
    return {"container_id": next(iter(sorted(boxes)), None)}


@dataclass(frozen=True)
class Holder:
    """Who holds slots now, as a queued request is shown it.

    A holder outside this service (another hora service, a notebook's kernel-local engines,
    known by its lease) has ``kind`` ``service`` or ``kernel``, its pid as ``id``, and
    ``what`` says who it is.
    """

    id: int
    kind: str
    user: str
    slots: tuple[int, ...]
    since: float
    ends_at: float | None
    stopping: bool = False  # its processes are being stopped: the slots are draining
    what: str | None = None  # a holder outside this service, in words (its lease's)
    name: str | None = None  # a job's or session's name (shown only to its owner and admins)


@dataclass(frozen=True)
class QueueView:
    """Where a queued job or session stands: its place, the slots, who holds them, when.

    Attributes:
        position: 1 for the next to be considered (priority, then age); 0 once it left.
        need: slots it asks for; free: slots free now.
        holders: the jobs and sessions holding slots, oldest first.
        estimate: when enough slots should be free (UNIX time); None when nothing holding
            them has a time limit.
        over_quota: it waits for its user's own jobs and sessions to end.
    """

    position: int
    need: int
    free: int
    holders: tuple[Holder, ...]
    estimate: float | None
    over_quota: bool


def runs_outside(spec: JobSpec) -> bool:
    """The job runs on resources its runtime owns (Slurm's nodes), not the service's slots."""
    return spec.runtime == RuntimeName.slurm


def describe(rank: int, status: RankStatus, note: str | None = None) -> str:
    """A human reason for one rank's failure, with what the runtime noted about it.

    Example:
        >>> describe(1, 3), describe(0, -9)
        ('rank 1 exited with code 3', 'rank 0 was killed by SIGKILL')
        >>> describe(0, Exit.lost, "its container is gone")
        'rank 0 ended without recording its exit status: its container is gone'
    """
    if note:
        if status is Exit.lost:
            return f"rank {rank} ended without recording its exit status: {note}"
        return f"{describe(rank, status)} ({note})"
    if status is Exit.lost:
        return f"rank {rank} ended while the service was down; its exit status is unknown"
    assert isinstance(status, int)
    return f"rank {rank} {ended(status)}"
