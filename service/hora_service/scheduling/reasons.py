"""Why each queued job or session waits: a structured reason per entry (control plane, pure).

:func:`explain_queue` walks the queue in the scheduler's order with the same rules as
:func:`hora_service.scheduling.scheduler.schedule` (retry backoff, running-jobs limit, quota,
gang fit, the head's reservation and backfill) and says, for every entry, which rule holds it
back, as a :class:`hora.spec.WaitReason`: ``kind``, the figures behind it, and ``text`` for people.

A runtime can hold an entry back for reasons of its own (an image being pulled, Slurm's own
pending reason): it posts them on the manager's :class:`ReasonBoard`, and a posted reason
replaces the computed one for that job until it is cleared. New runtimes add their kind
(:class:`hora.spec.ReasonKind`) and post :class:`WaitReason` objects; nothing here changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hora.spec import PRIORITY_RANK, HolderInfo, ReasonKind, WaitReason

from hora_service.scheduling.scheduler import INF, Holding, Pending, queue_order, reserve

PRIORITY_NAME = {rank: name.value for name, rank in PRIORITY_RANK.items()}


@dataclass(frozen=True)
class QueueState:
    """What the reasons are computed from: the pool and its holders at one moment.

    Attributes:
        queue: queued jobs and sessions (any order).
        total: slots in the pool.
        holding: jobs and sessions holding slots, with their expected ends.
        holders: the same, as shown to people (kind, since, idle time).
        due: job id -> when a retrying job may start again (UNIX time), for those waiting.
        quota: user -> most slots they may hold (None: no limit).
        running_limit: most running jobs per user (None: no limit).
        now: the current time (UNIX).
    """

    queue: Sequence[Pending]
    total: int
    holding: Sequence[Holding]
    holders: Sequence[HolderInfo] = ()
    due: Mapping[int, float] = field(default_factory=dict)
    quota: Callable[[str], int | None] | None = None
    running_limit: int | None = None
    now: float = 0.0


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def slots_reason(
    job: Pending, q: QueueState, free: int, memo: dict[tuple[int, int], WaitReason] | None = None
) -> WaitReason:
    """Not enough free slots: how many asked, free, total, who holds them, an estimate.

    ``memo`` keeps the reason by size and free slots across one pass (the holders do not
    change): entries that ask alike share one reason.

    Example:
        >>> q = QueueState([], 4, [Holding(1, "bob", (0, 1, 2), ends_at=INF)])
        >>> slots_reason(Pending(7, "ann", 2), q, 1).text
        'waiting for 2 slot(s): 1 of 4 free; held by bob (job 1); no estimate (no time limit)'
    """
    memo = {} if memo is None else memo
    known = memo.get((job.need, free))
    if known is None:
        known = memo[job.need, free] = _slots_reason(job, q, free)
    return known


def _slots_reason(job: Pending, q: QueueState, free: int) -> WaitReason:
    shadow = reserve(job, free, list(q.holding), q.now).shadow
    estimate = _at(shadow) if shadow < INF else None
    text = f"waiting for {job.need} slot(s): {free} of {q.total} free"
    held = _held_by(q)
    text += f"; held by {held}" if held else ""
    if estimate is not None:
        text += f"; expected free by {estimate:%H:%M:%S} UTC"
    elif q.holding:
        text += "; no estimate (no time limit)"
    return WaitReason(
        kind=ReasonKind.slots, text=text, asked=job.need, free=free, total=q.total,
        holders=list(q.holders), estimate_at=estimate,
    )  # fmt: skip


def _held_by(q: QueueState, most: int = 4) -> str:
    """Who holds slots, for the text: the first ``most`` holders, then how many more."""
    names = [h.what or f"{h.user} ({h.kind} {h.id})" for h in q.holders] or [
        f"{h.user} (job {h.id})" for h in q.holding
    ]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def quota_reason(job: Pending, limit: int, used: int) -> WaitReason:
    """The user's own holdings plus this request pass their quota."""
    text = (
        f"your quota: you hold {used} of {limit} slot(s) and this asks for {job.need}; "
        "it starts when your own jobs and sessions end"
    )
    return WaitReason(kind=ReasonKind.quota, text=text, asked=job.need, limit=limit, used=used)


def running_limit_reason(limit: int, running: int) -> WaitReason:
    """The user runs as many jobs as the service allows each user."""
    text = f"you run {running} job(s); at most {limit} run at once per user"
    return WaitReason(kind=ReasonKind.running_limit, text=text, limit=limit, used=running)


def priority_reason(job: Pending, head: Pending, free: int, total: int) -> WaitReason:
    """It would fit now, but the head of the queue holds a reservation it would delay."""
    level = PRIORITY_NAME.get(head.priority, str(head.priority))
    text = (
        f"{job.need} slot(s) are free, but job {head.id} ({level} priority, first in the queue) "
        "has them reserved; this one may not delay it"
    )
    return WaitReason(
        kind=ReasonKind.priority, text=text, asked=job.need, free=free, total=total,
        ahead=head.id, ahead_priority=level,
    )  # fmt: skip


def backoff_reason(due: float) -> WaitReason:
    """A failed attempt waits for its retry."""
    text = f"retrying after a failed attempt at {_at(due):%H:%M:%S} UTC"
    return WaitReason(kind=ReasonKind.backoff, text=text, retry_at=_at(due))


def gang_reason(need: int, largest: int, unit: str = "slots") -> WaitReason:
    """More slots at once than any node has (a submission refused with 422 carries this)."""
    text = f"asks for {need} {unit} at once; the largest node has {largest}"
    return WaitReason(kind=ReasonKind.gang, text=text, asked=need, total=largest)


def image_reason(image: str) -> WaitReason:
    """The job's container image is being pulled before its ranks start."""
    return WaitReason(kind=ReasonKind.image, text=f"pulling image {image}", image=image)


def runtime_reason(source: str, detail: str) -> WaitReason:
    """A runtime's own reason, e.g. Slurm's pending reason (``squeue -o %r``)."""
    text = f"{source}: {detail}"
    return WaitReason(kind=ReasonKind.runtime, text=text, source=source, detail=detail)


def explain_queue(q: QueueState, until: int | None = None) -> dict[int, WaitReason]:
    """A reason for every queued entry, by job id (the scheduler's rules, in its order).

    With ``until``, the pass stops once that job has its reason (entries behind it do not
    change it).

    Example:
        >>> q = QueueState([Pending(3, "ann", 2)], 2, [Holding(1, "bob", (0, 1))])
        >>> explain_queue(q)[3].kind
        'slots'
    """
    held = sum(len(h.slots) for h in q.holding)
    free = q.total - held
    users: dict[str, int] = {}
    running: dict[str, int] = {}
    for h in q.holding:
        users[h.user] = users.get(h.user, 0) + len(h.slots)
        running[h.user] = running.get(h.user, 0) + 1
    head: Pending | None = None
    memo: dict[tuple[int, int], WaitReason] = {}
    out: dict[int, WaitReason] = {}
    for job in sorted(q.queue, key=queue_order):
        if until is not None and until in out:
            break
        due = q.due.get(job.id)
        if due is not None and due > q.now:
            out[job.id] = backoff_reason(due)
            continue
        if q.running_limit is not None and running.get(job.user, 0) >= q.running_limit:
            out[job.id] = running_limit_reason(q.running_limit, running.get(job.user, 0))
            continue
        limit = q.quota(job.user) if q.quota else None
        if limit is not None and users.get(job.user, 0) + job.need > limit:
            out[job.id] = quota_reason(job, limit, users.get(job.user, 0))
            continue
        if job.need > free:
            out[job.id] = slots_reason(job, q, free, memo)
            head = head or job
        elif head is not None:
            out[job.id] = priority_reason(job, head, free, q.total)
        else:  # it fits and nothing is ahead: the next pass starts it
            text = f"starting: {job.need} of {free} free slot(s) are being assigned"
            out[job.id] = WaitReason(
                kind=ReasonKind.slots, text=text, asked=job.need, free=free, total=q.total
            )
            free -= job.need
    return out


class ReasonBoard:
    """Reasons runtimes post for jobs they hold back (image pulls, Slurm's pending reason).

    Thread-safe; a posted reason replaces the computed one until :meth:`clear`.

    Example:
        >>> board = ReasonBoard(); board.post(4, image_reason("hora:cpu"))
        >>> board.get(4).kind
        'image'
    """

    def __init__(self) -> None:
        self._posted: dict[int, WaitReason] = {}
        self._lock = threading.Lock()

    def post(self, job_id: int, reason: WaitReason) -> None:
        """Say why ``job_id`` waits (replacing what was posted before)."""
        with self._lock:
            self._posted[job_id] = reason

    def clear(self, job_id: int) -> None:
        """The runtime no longer holds ``job_id`` back."""
        with self._lock:
            self._posted.pop(job_id, None)

    def get(self, job_id: int) -> WaitReason | None:
        """The reason posted for ``job_id``, if any."""
        with self._lock:
            return self._posted.get(job_id)

    def all(self) -> dict[int, WaitReason]:
        """Every posted reason, by job id."""
        with self._lock:
            return dict(self._posted)
