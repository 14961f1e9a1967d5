"""A process set's second shared-memory ring, run by a thread of its own (data plane, launch).

Plain ``hvd.allreduce`` calls must progress in the background while the script computes
(Horovod's ``allreduce_async`` + ``poll``), as gloo's work does on gloo's threads. Their data
goes through a *lane*: a ring of its own in the set's segment (:mod:`hora.torch._shm`), whose
operations one worker thread runs in the order they were launched. Launches happen in the
negotiation rounds, in the same order on every member, so the members' workers meet the
same operations in the same order; the rounds themselves and the optimizer's buckets keep
the first ring, in the calling thread, so neither waits behind the other.

A lane's work reports its end through :meth:`LaneWork.is_completed` (``poll``) and
:meth:`LaneWork.wait`; its error, if any, is raised by the collective's finishing step. Closing
the lane (``shutdown()``, an aborted group) stops its ring's waits and the thread.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

from hora.errors import HoraError

JOIN_S = 5.0  # how long close() waits for the thread to leave an operation


class LaneWork:
    """One operation queued on a lane: done when the lane's thread has run it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the end (a timedelta or seconds; the ring's own timeout comes first)."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        return self.done.wait(None if timeout is None else timeout + JOIN_S)

    def is_completed(self) -> bool:
        return self.done.is_set()

    def raise_error(self) -> None:
        """Raise what ended the operation early (nothing when it succeeded)."""
        if self.error is not None:
            raise self.error


class Lane:
    """The worker thread of one ring and the operations queued for it, in launch order.

    Args:
        ring: the lane's ring (``allreduce_``, ``stop()`` and ``close(abort)`` are used).
    """

    def __init__(self, ring: Any) -> None:
        self.ring = ring
        self.q: queue.SimpleQueue[LaneWork | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.closed = False

    def allreduce(self, t: Any, op: str, name: str, reduce: str, tag: str,
                  source: Any = None) -> LaneWork:
        """Queue ``ring.allreduce_`` of ``t`` (see :meth:`hora.torch._shm.Ring.allreduce_`)."""
        work = LaneWork(lambda: self.ring.allreduce_(t, op, name, reduce, tag=tag,
                                                     source=source))
        if self.closed:
            work.error = HoraError(f"{op} {name!r}: hora.torch was shut down")
            work.done.set()
            return work
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="hora-shm-lane",
                                           daemon=True)
            self.thread.start()
        self.q.put(work)
        return work

    def _serve(self) -> None:
        while True:
            work = self.q.get()
            if work is None:
                return
            try:
                work.run()
            except BaseException as e:  # noqa: BLE001  (the collective's caller raises it)
                work.error = e
            work.done.set()

    def close(self, abort: bool = False) -> None:
        """Stop the thread (leaving any wait at once), then close the ring."""
        if self.closed:
            return
        self.closed = True
        self.ring.stop()
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(JOIN_S)
        self.ring.close(abort)
        while True:  # what was still queued never ran: its waiters learn it
            try:
                work = self.q.get_nowait()
            except queue.Empty:
                return
            if work is not None and not work.done.is_set():
                work.error = HoraError("hora.torch was shut down before this collective ran")
                work.done.set()
