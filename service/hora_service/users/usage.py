"""Per-user accounting behind ``/metrics`` (control plane): queue waits and slot-hours.

:class:`Usage` is fed by the job manager (a first attempt started after waiting so long; an
attempt ended after holding so many slots for so long) and read into the metrics snapshot.
Counts start at zero with each service start, as Prometheus counters may.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class WaitStats:
    """Queue waits of first attempts: total seconds and how many."""

    sum_s: float = 0.0
    count: int = 0


@dataclass
class Usage:
    """Queue waits by (user, priority) and slot-seconds by user (thread-safe).

    Example:
        >>> u = Usage(); u.started("ann", "normal", 3.0); u.held("ann", 2, 1800.0)
        >>> u.waits[("ann", "normal")].count, u.slot_hours({})["ann"]
        (1, 1.0)
    """

    waits: dict[tuple[str, str], WaitStats] = field(default_factory=dict)
    slot_seconds: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self, user: str, priority: str, waited_s: float) -> None:
        """A job's first attempt started after waiting ``waited_s`` in the queue."""
        with self._lock:
            stats = self.waits.setdefault((user, priority), WaitStats())
            stats.sum_s += max(0.0, waited_s)
            stats.count += 1

    def held(self, user: str, slots: int, seconds: float) -> None:
        """An attempt of ``user`` held ``slots`` for ``seconds`` and ended."""
        with self._lock:
            self.slot_seconds[user] = self.slot_seconds.get(user, 0.0) + slots * max(0.0, seconds)

    def slot_hours(self, running: dict[str, float]) -> dict[str, float]:
        """Slot-hours by user: ended attempts plus ``running`` (user -> slot-seconds so far)."""
        with self._lock:
            total = dict(self.slot_seconds)
        for user, secs in running.items():
            total[user] = total.get(user, 0.0) + secs
        return {user: secs / 3600.0 for user, secs in total.items()}

    def wait_rows(self) -> list[tuple[str, str, float, int]]:
        """(user, priority, seconds, count) for every pair seen."""
        with self._lock:
            return [(u, p, s.sum_s, s.count) for (u, p), s in sorted(self.waits.items())]


def count_by(items: Iterable[tuple[str, ...]]) -> dict[tuple[str, ...], int]:
    """How many times each tuple occurs.

    Example:
        >>> count_by([("queued", "slots"), ("queued", "slots")])
        {('queued', 'slots'): 2}
    """
    out: dict[tuple[str, ...], int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out
