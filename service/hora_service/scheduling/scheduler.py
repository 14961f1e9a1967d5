"""The scheduling pass: which queued jobs get which slots now (control plane, pure).

Policy:

* **Gang**: a job gets all ``workers x gpus_per_worker`` slots at once, or none.
* **Priority, then FIFO**: high before normal before low; older first within a priority.
* **Backfill without delaying the head** (EASY backfilling): the first job in that order that
  does not fit becomes the *head* and holds a reservation. From the running jobs' expected
  ends (start + ``timeout_s``; unknown without a timeout) the pass computes the head's
  *shadow time* (when enough slots will be free for it) and the *extra* slots (those free
  then beyond what the head needs). A later job may start now only if it fits in the free
  slots and either it will surely end before the shadow time (its ``timeout_s`` says so, and
  the shadow time is known) or it uses only extra slots. So the head never starts later than
  it would have without backfill.
* **Quota**: a user's running jobs hold at most ``quota`` slots; a job over it waits without
  reserving anything (it blocks no one else).
* A slot is never in two jobs: placements take slots from the free set and remove them.

:func:`schedule` is a pure function of plain values so that tests can drive it through
thousands of random events and benchmarks can time one pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued job as the scheduler sees it."""

    id: int
    user: str
    need: int
    priority: int = 1
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Holding:
    """A job that holds slots: ``ends_at`` is its latest expected end (INF if unknown)."""

    id: int
    user: str
    slots: tuple[int, ...]
    ends_at: float = INF


@dataclass(frozen=True, slots=True)
class Placement:
    """Start job ``job_id`` now on ``slots``; ``backfill`` when it jumped the queue's head."""

    job_id: int
    slots: tuple[int, ...]
    backfill: bool = False


@dataclass(frozen=True, slots=True)
class Reservation:
    """The head job's reservation: when it can start and the slots it leaves spare then."""

    job_id: int
    shadow: float
    extra: int


def queue_order(job: Pending) -> tuple[int, int]:
    """Sort key: higher priority first, then lower id (older) first."""
    return (-job.priority, job.id)


def reserve(head: Pending, free: int, holding: Sequence[Holding], now: float) -> Reservation:
    """The head's shadow time and spare slots, from the jobs holding slots now.

    Example:
        >>> reserve(Pending(9, "a", 3), 1, [Holding(1, "b", (0, 1), ends_at=50.0)], 0.0)
        Reservation(job_id=9, shadow=50.0, extra=0)
    """
    avail = free
    if avail >= head.need:
        return Reservation(head.id, now, avail - head.need)
    ends = sorted(holding, key=lambda h: h.ends_at)
    shadow = INF
    for i, job in enumerate(ends):
        avail += len(job.slots)
        if avail >= head.need:
            shadow = job.ends_at
            # everything that ends at the same moment frees its slots too
            avail += sum(len(h.slots) for h in ends[i + 1 :] if h.ends_at <= shadow)
            break
    return Reservation(head.id, shadow, max(0, avail - head.need))


def schedule(
    queue: Sequence[Pending],
    free: Sequence[int],
    holding: Sequence[Holding] = (),
    now: float = 0.0,
    quota: Callable[[str], int | None] | None = None,
    used: Mapping[str, int] | None = None,
    ordered: bool = False,
) -> list[Placement]:
    """One scheduling pass: the jobs to start now and their slots (see the module docstring).

    Args:
        queue: queued jobs, in any order (or already in :func:`queue_order` with ``ordered``).
        free: indices of the free slots.
        holding: jobs holding slots now, with their expected ends.
        now: the current time on the same clock as ``ends_at``.
        quota: user -> most slots their jobs may hold (None: no limit).
        used: user -> slots their jobs hold now.
        ordered: ``queue`` is already sorted by :func:`queue_order`.

    Returns:
        Placements, in the order they were decided; their slot sets are disjoint and were
        all free.

    Example:
        >>> [p.slots for p in schedule([Pending(1, "a", 2), Pending(2, "a", 1)], free=[0, 1, 2])]
        [(0, 1), (2,)]
    """
    pool = sorted(free)
    taken = 0  # pool[:taken] are placed
    users = dict(used or {})
    holds = list(holding)
    out: list[Placement] = []
    res: Reservation | None = None
    for job in queue if ordered else sorted(queue, key=queue_order):
        left = len(pool) - taken
        if left == 0:
            break
        limit = quota(job.user) if quota else None
        if limit is not None and users.get(job.user, 0) + job.need > limit:
            continue
        if job.need > left:
            if res is None:
                res = reserve(job, left, holds, now)
            continue
        backfill = res is not None
        if res is not None:
            ends = now + job.timeout_s if job.timeout_s else INF
            if ends <= res.shadow < INF:
                pass  # gone before the head can start
            elif job.need <= res.extra:
                res = Reservation(res.job_id, res.shadow, res.extra - job.need)
            else:
                continue
        slots = tuple(pool[taken : taken + job.need])
        taken += job.need
        users[job.user] = users.get(job.user, 0) + job.need
        ends_at = now + job.timeout_s if job.timeout_s else INF
        holds.append(Holding(job.id, job.user, slots, ends_at))
        out.append(Placement(job.id, slots, backfill))
    return out

