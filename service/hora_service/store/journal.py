"""Job state changes the store has not taken yet (control plane).

The monitor loop decides a job's state from what its processes do; the store only records
it. When a write fails (another process holds SQLite's write lock past the busy timeout, the
disk is full, an I/O error), the change waits here, in order, and the monitor retries it on
every pass until it lands. Meanwhile the manager answers with the job as the monitor knows it
(:meth:`Journal.overlay`), so that a job's record, ``/v1/gpus`` and the scheduler agree; a
finished job never stays ``running`` because one write failed.

Pure apart from the ``apply`` callable that :meth:`Journal.flush` is given.

Example:
    >>> j = Journal()
    >>> j.add(Write(7, JobState.cancelled, 1.0, "cancelled by the user", {"finished_at": 1.0}))
    >>> j.pending(7), len(j)
    (True, 1)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hora.spec import JobState

from hora_service.models import JobRecord, Transition

# JobRecord fields a write may set directly (others, such as retry_at, live only in the store)
RECORD_FIELDS = ("attempt", "slots", "exit_codes", "elastic", "park", "spec")
TIME_FIELDS = ("started_at", "finished_at")


@dataclass(frozen=True)
class Write:
    """One change to one job: a new state (with its transition) and columns to set.

    Attributes:
        job_id: the job.
        state: the new state, recorded with a transition; None sets ``fields`` only.
        at: when (UNIX seconds).
        reason: the transition's reason (also the job's ``reason`` column).
        fields: other columns of the jobs table.
        event: an event, not a change: the transition is recorded (with the job's current
            ``state``, say ``running``, and the event as its reason) and nothing else.
    """

    job_id: int
    state: JobState | None
    at: float
    reason: str | None
    fields: Mapping[str, object] = field(default_factory=dict)
    event: bool = False


class Journal:
    """The writes the store has not taken yet, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._writes: list[Write] = []
        self._lock = threading.Lock()
        self.error: str | None = None
        self.failing_since: float | None = None

    def __len__(self) -> int:
        return len(self._writes)

    def add(self, write: Write) -> None:
        """Queue a write behind every earlier one."""
        with self._lock:
            self._writes.append(write)

    def discard(self, write: Write) -> None:
        """Take back a write that was never taken (the manager gives up what it needed)."""
        with self._lock:
            if write in self._writes:
                self._writes.remove(write)
            if not self._writes:
                self.error, self.failing_since = None, None

    def pending(self, job_id: int) -> bool:
        """True while some change to ``job_id`` has not reached the store."""
        with self._lock:
            return any(w.job_id == job_id for w in self._writes)

    def flush(self, apply: Callable[[list[Write]], None], now: float) -> list[int]:
        """Hand every queued write to ``apply`` (one transaction); drop them once it returns.

        Args:
            apply: writes the list to the store, all or nothing; raises when it cannot.
            now: the time, for :attr:`failing_since`.

        Returns:
            The ids of the jobs written (empty when nothing was queued).

        Raises:
            Exception: whatever ``apply`` raised; the writes stay queued and :attr:`error`
                says why.
        """
        with self._lock:
            batch = list(self._writes)
        if not batch:
            return []
        try:
            apply(batch)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.failing_since = self.failing_since or now
            raise
        with self._lock:
            del self._writes[: len(batch)]  # only add() appends meanwhile
        self.error, self.failing_since = None, None
        return sorted({w.job_id for w in batch})

    def overlay(self, record: JobRecord) -> JobRecord:
        """``record`` as it is once every queued write to it has landed."""
        with self._lock:
            writes = [w for w in self._writes if w.job_id == record.id]
        return apply_writes(record, writes)


def apply_writes(record: JobRecord, writes: list[Write]) -> JobRecord:
    """The record after ``writes`` (in order), as the store will have it."""
    if not writes:
        return record
    update: dict[str, object] = {}
    moves = list(record.transitions)
    for w in writes:
        update.update({k: w.fields[k] for k in RECORD_FIELDS if k in w.fields})
        for k in TIME_FIELDS:
            if k in w.fields:
                at = w.fields[k]
                update[k] = datetime.fromtimestamp(at, UTC) if isinstance(at, float) else at
        if w.state is not None:
            if not w.event:
                update["state"], update["reason"] = w.state, w.reason
            moves.append(Transition(state=w.state, at=datetime.fromtimestamp(w.at, UTC),
                                    reason=w.reason))  # fmt: skip
    update["transitions"] = moves
    return record.model_copy(update=update)
