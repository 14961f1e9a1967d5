"""The queue as people see it: each entry's place and reason (control plane).

Built from one snapshot of the job manager (:meth:`JobManager.queue_snapshot`) and the pure
rules of :mod:`hora_service.scheduling.reasons`. Used by ``GET /v1/queue``, the ``queue`` of a
queued job or session record, ``hora jobs`` and the dashboard.

Visibility: a non-admin sees their own entries whole; another user's entry shows only its
place, size and priority (who holds which slot is shown to everyone, as ``hora gpus`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from hora.spec import HolderInfo, JobKind, JobState, QueueEntry, QueueInfo, WaitReason
from pydantic import TypeAdapter

from hora_service.manager import Holder, JobManager
from hora_service.models import JobRecord, User
from hora_service.scheduling.reasons import PRIORITY_NAME, QueueState, explain_queue
from hora_service.scheduling.scheduler import INF, Holding, Pending
from hora_service.store.db import is_unavailable

IdleOf = Callable[[int], float | None]
_ENTRIES = TypeAdapter(list[QueueEntry])


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def holder_info(h: Holder, idle_of: IdleOf | None = None) -> HolderInfo:
    """A holder as the API shows it (``idle_of``: a session's idle seconds, if known)."""
    return HolderInfo(
        kind=h.kind, id=h.id, user=h.user, slots=list(h.slots), since=_at(h.since),
        idle_s=idle_of(h.id) if idle_of is not None and h.kind == JobKind.session else None,
        ends_at=_at(h.ends_at) if h.ends_at is not None else None, what=h.what,
    )  # fmt: skip


def snapshot(
    manager: JobManager, now: float, idle_of: IdleOf | None = None, until: int | None = None
) -> tuple[list[Pending], dict[int, WaitReason], list[HolderInfo]]:
    """The queue in order, a reason for each entry (up to ``until``), and the holders."""
    pending, holders = manager.queue_snapshot()
    order = [p for p, _ in pending]  # in queue order already
    shown = [holder_info(h, idle_of) for h in holders]
    state = QueueState(
        queue=order,
        total=len(manager.inventory),
        holding=[Holding(h.id, h.user, h.slots, h.ends_at or INF) for h in holders],
        holders=shown,
        due={p.id: due for p, due in pending if due is not None},
        quota=manager.quota_table(),  # the users read once, not once per entry
        running_limit=manager.settings.max_running_jobs_per_user,
        now=now,
    )
    reasons = explain_queue(state, until)
    reasons.update(manager.waits.all())  # a runtime's own word comes first
    return order, reasons, shown


def queue_info(
    manager: JobManager, job_id: int, now: float | None = None, idle_of: IdleOf | None = None
) -> QueueInfo | None:
    """Where queued ``job_id`` stands and why it waits; None when it is not queued.

    A job a runtime holds back while starting (an image being pulled) has position 0.
    """
    now = time.time() if now is None else now
    order, reasons, holders = snapshot(manager, now, idle_of, until=job_id)
    why = reasons.get(job_id)
    if why is None:
        return None
    place = next((i + 1 for i, p in enumerate(order) if p.id == job_id), 0)
    need = order[place - 1].need if place else (why.asked or 0)
    free = len(manager.inventory) - sum(len(h.slots) for h in holders)
    return QueueInfo(
        position=place, need=need, free=free, holders=holders,
        estimate_at=why.estimate_at, reason=why.text, why=why,
    )  # fmt: skip


def queue_entries(
    manager: JobManager, viewer: User, now: float | None = None, idle_of: IdleOf | None = None
) -> list[QueueEntry]:
    """Every queued job and session in queue order, as ``viewer`` may see them.

    Then, at position 0, the jobs a runtime's own queue holds back (Slurm's pending jobs):
    hora has handed them over and they wait there, with the runtime's reason.
    """
    now = time.time() if now is None else now
    order, reasons, _ = snapshot(manager, now, idle_of)
    queued = {p.id for p in order}
    held = sorted(set(reasons) - queued)
    records = _records(manager, [p.id for p in order if _sees(viewer, p.user)] + held)
    out = []
    for i, p in enumerate(order):
        priority = PRIORITY_NAME.get(p.priority, str(p.priority))
        if not _sees(viewer, p.user):
            out.append(QueueEntry(position=i + 1, need=p.need, priority=priority))
            continue
        job = records.get(p.id)
        out.append(
            QueueEntry(
                position=i + 1, id=p.id, kind=job.kind if job else JobKind.job, user=p.user,
                name=job.spec.name if job else None, need=p.need, priority=priority,
                queued_at=job.created_at if job else None, reason=reasons.get(p.id),
            )  # fmt: skip
        )
    for job_id in held:
        job = records.get(job_id)
        if job is None or not _sees(viewer, job.user) or job.state.terminal:
            continue
        out.append(
            QueueEntry(
                position=0, id=job.id, kind=job.kind, user=job.user, name=job.spec.name,
                need=job.spec.total_gpus, priority=job.spec.priority.value,
                queued_at=job.created_at, reason=reasons[job_id],
            )  # fmt: skip
        )
    return out


def entries_json(entries: list[QueueEntry]) -> bytes:
    """The JSON of a queue page, serialised in one pass (not one model at a time)."""
    return _ENTRIES.dump_json(entries)


def _sees(viewer: User, user: str) -> bool:
    return viewer.is_admin or user == viewer.name


def _records(manager: JobManager, ids: list[int]) -> dict[int, JobRecord]:
    """The records of ``ids`` (names, kinds and submission times), cached or in one query."""
    try:
        return manager.records(ids)
    except Exception as e:  # the store is busy: the entries are shown without them
        if not is_unavailable(e):
            raise
        return {}


def job_queue(
    manager: JobManager, job: JobRecord, idle_of: IdleOf | None = None
) -> QueueInfo | None:
    """The ``queue`` of a job record: its place and reason while it waits, else None.

    A starting job is looked up only on the runtime's board (the monitor may be busy
    starting it, an image pull for instance, and holds its lock meanwhile).
    """
    if job.state in (JobState.starting, JobState.running):  # running: Slurm may hold it back
        why = manager.waits.get(job.id)
        if why is None:
            return None
        need = job.spec.total_gpus
        return QueueInfo(position=0, need=need, free=0, holders=[], reason=why.text, why=why)
    if job.state in (JobState.queued, JobState.retrying):
        return queue_info(manager, job.id, None, idle_of)
    return None


def waiting_metrics(
    manager: JobManager, now: float | None = None
) -> tuple[list[tuple[str, str, str, int]], list[tuple[str, str, float]]]:
    """For ``/metrics``: waiting entries by (state, kind, reason), and the longest waits.

    Returns:
        ``(state, kind, reason kind, count)`` rows, and ``(user, priority, seconds)`` of the
        longest current wait of each user and priority.
    """
    now = time.time() if now is None else now
    order, reasons, _ = snapshot(manager, now)
    pending, _ = manager.queue_snapshot()
    retrying = {p.id for p, due in pending if due is not None}
    records = _records(manager, [p.id for p in order])
    counts: dict[tuple[str, str, str], int] = {}
    longest: dict[tuple[str, str], float] = {}
    for p in order:
        job = records.get(p.id)
        state = (JobState.retrying if p.id in retrying else JobState.queued).value
        why = reasons.get(p.id)
        key = (state, job.kind if job is not None else JobKind.job, why.kind if why else "unknown")
        counts[key] = counts.get(key, 0) + 1
        if job is not None:
            pair = (p.user, PRIORITY_NAME.get(p.priority, str(p.priority)))
            longest[pair] = max(longest.get(pair, 0.0), now - job.created_at.timestamp())
    rows = [(*k, n) for k, n in sorted(counts.items())]
    return rows, [(*k, s) for k, s in sorted(longest.items())]
