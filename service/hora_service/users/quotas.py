"""Per-user limits of the job service beyond GPU quotas (control plane, pure).

What one user may hold at once, each a setting (see :class:`hora_service.settings.Settings`):
running jobs (:func:`within_running_limit`, applied before each scheduling pass), concurrent
log streams (:class:`StreamCounter`, a 429 past it), and the size of one stored spec
(:func:`spec_bytes`, a 413 past it). Log bytes per attempt are enforced by the rank shim, and
page bytes by the manager's list pages.

Example:
    >>> from hora_service.scheduling.scheduler import Pending
    >>> [p.id for p in within_running_limit([Pending(1, "a", 1), Pending(2, "a", 1)], {"a": 1}, 2)]
    [1]
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from hora.errors import HoraError
from hora.spec import JobSpec

from hora_service.scheduling.scheduler import Pending, queue_order


class OverLimit(HoraError):
    """A request passes one of the user's limits.

    Attributes:
        field: the limit's field (``spec``, ``queued_jobs``, ``log_streams``).
        status_code: the HTTP answer: 413 for a spec too large, 429 for too many at once.
    """

    def __init__(self, field: str, message: str, status_code: int) -> None:
        super().__init__(message)
        self.field = field
        self.status_code = status_code


def within_running_limit(
    ready: Sequence[Pending],
    running: Mapping[str, int],
    limit: int | None,
    ordered: bool = False,
) -> list[Pending]:
    """The ready jobs that may start without any user passing ``limit`` running jobs.

    Each user keeps their first ``limit - running`` jobs in queue order; the rest wait.
    ``ordered``: ``ready`` is already in :func:`queue_order` (the answer keeps the order).
    """
    if limit is None:
        return list(ready)
    room = {user: limit - n for user, n in running.items()}
    out = []
    for job in ready if ordered else sorted(ready, key=queue_order):
        left = room.get(job.user, limit)
        if left > 0:
            room[job.user] = left - 1
            out.append(job)
    return out


def spec_bytes(spec: JobSpec) -> int:
    """Bytes the spec takes in the store (its JSON)."""
    return len(spec.model_dump_json().encode())


class StreamCounter:
    """Open log streams per user, bounded by ``limit``.

    Example:
        >>> streams = StreamCounter(1)
        >>> streams.open(7), streams.open(7)
        (True, False)
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[int, int] = {}
        self._lock = threading.Lock()

    def open(self, user_id: int) -> bool:
        """Count one more stream of this user; False (and nothing counted) past the limit."""
        with self._lock:
            n = self._open.get(user_id, 0)
            if n >= self.limit:
                return False
            self._open[user_id] = n + 1
            return True

    def close(self, user_id: int) -> None:
        """One stream of this user ended."""
        with self._lock:
            n = self._open.get(user_id, 0) - 1
            if n > 0:
                self._open[user_id] = n
            else:
                self._open.pop(user_id, None)
