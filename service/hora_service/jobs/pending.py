"""The job queue: queued jobs by id, kept in queue order and counted by user (control plane).

A scheduling pass walks the queue in :func:`~hora_service.scheduling.scheduler.queue_order`
(higher priority first, then older first), and every submission asks how many jobs its user
has waiting. Both would cost a pass over the whole queue, and a sort, each time; with
thousands of jobs queued that made every submission pay for the queue's length. The order
and the counts are kept here instead, updated on every change, so a pass reads the queue in
order without sorting it and a submission counts its user's jobs in constant time. The
entries that wait for a time (a retry's backoff) are kept apart too, so that the monitor
finds the next such time without walking the queue on every tick.
"""

from __future__ import annotations

import bisect
import collections
from typing import NoReturn, TypeVar, overload

from hora_service.scheduling.scheduler import Pending, queue_order

Entry = tuple[Pending, float | None]  # the job, and when it may start (None: now)
_T = TypeVar("_T")


class PendingQueue(dict[int, Entry]):
    """Queued jobs by id (a dict), kept in order, counted by user, with their next due time.

    Only item assignment, ``del``, ``pop`` and ``clear`` change it; the other ways a dict
    can change raise, so that the order and the counts cannot drift from the entries.

    Example:
        >>> q = PendingQueue()
        >>> q[7] = (Pending(7, "ann", 1, priority=1), None)
        >>> q[9] = (Pending(9, "bob", 1, priority=2), None)
        >>> q[8] = (Pending(8, "ann", 1, priority=1), 30.0)
        >>> [p.id for p, _ in q.ordered()], q.waiting("ann"), q.position(8), q.next_due()
        ([9, 7, 8], 2, 2, 30.0)
        >>> _ = q.pop(7)
        >>> [p.id for p, _ in q.ordered()], q.waiting("ann"), q.waiting("cid"), q.position(7)
        ([9, 8], 1, 0, None)
    """

    def __init__(self) -> None:
        super().__init__()
        self._keys: list[tuple[int, int]] = []  # queue_order of every entry, sorted
        self._users: collections.Counter[str] = collections.Counter()
        self._due: dict[int, float] = {}  # the entries that wait for a time: that time

    def ordered(self) -> list[Entry]:
        """Every entry, in queue order."""
        return [self[job_id] for _, job_id in self._keys]

    def waiting(self, user: str) -> int:
        """How many of ``user``'s jobs are queued."""
        return self._users.get(user, 0)

    def position(self, job_id: int) -> int | None:
        """Where ``job_id`` stands in queue order (0: first), or None when it is not queued."""
        entry = self.get(job_id)
        return None if entry is None else bisect.bisect_left(self._keys, queue_order(entry[0]))

    def next_due(self) -> float | None:
        """The earliest time an entry waits for (None: every entry may start now)."""
        return min(self._due.values()) if self._due else None

    def __setitem__(self, job_id: int, entry: Entry) -> None:
        if job_id in self:
            self._forget(job_id)
        super().__setitem__(job_id, entry)
        bisect.insort(self._keys, queue_order(entry[0]))
        self._users[entry[0].user] += 1
        if entry[1] is not None:
            self._due[job_id] = entry[1]

    def __delitem__(self, job_id: int) -> None:
        self._forget(job_id)
        super().__delitem__(job_id)

    @overload
    def pop(self, job_id: int, /) -> Entry: ...

    @overload
    def pop(self, job_id: int, default: Entry, /) -> Entry: ...

    @overload
    def pop(self, job_id: int, default: _T, /) -> Entry | _T: ...

    def pop(self, job_id: int, /, *default: object) -> object:
        """Remove ``job_id`` and return its entry (``default`` if given and it is not queued)."""
        if job_id not in self:
            if default:
                return default[0]
            raise KeyError(job_id)
        entry = self[job_id]
        del self[job_id]
        return entry

    def clear(self) -> None:
        """Empty the queue."""
        super().clear()
        self._keys.clear()
        self._users.clear()
        self._due.clear()

    def _forget(self, job_id: int) -> None:
        pending = self[job_id][0]
        del self._keys[bisect.bisect_left(self._keys, queue_order(pending))]
        self._users[pending.user] -= 1
        if self._users[pending.user] <= 0:
            del self._users[pending.user]
        self._due.pop(job_id, None)

    def _refuse(self, *_args: object, **_kwargs: object) -> NoReturn:
        raise TypeError("a PendingQueue changes by item assignment, del, pop or clear only")

    update = setdefault = popitem = __ior__ = _refuse  # type: ignore[assignment]
