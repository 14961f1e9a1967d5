"""A process set's second shared-memory ring, whose operations run in launch order (data plane).

Plain ``hvd.allreduce`` calls must progress in the background while the script computes
(Horovod's ``allreduce_async`` + ``poll``), as gloo's work does on gloo's threads. Their data
goes through a *lane*: a ring of its own in the set's segment (:mod:`hora.torch._shm`), whose
operations run one at a time in the order they were launched. Launches happen in the
negotiation rounds, in the same order on every member, so the members meet the same
operations in the same order; the rounds themselves and the optimizer's buckets keep the
first ring, in the calling thread, so neither waits behind the other.

Who runs an operation does not matter to that order, only that one runs at a time, from the
head of the queue: whoever holds the lane's *turn* runs it. A worker thread runs what is
queued, so the data moves while the script computes; a caller that waits for an operation
(``synchronize``, a plain ``hvd.allreduce``) takes the turn itself when it is free and runs
the queue up to its operation, in its own thread, instead of handing it to the worker and
sleeping until the worker wakes it: on a blocking call, two thread hand-offs saved (a 1 MB
``hvd.allreduce_`` on 2 ranks, ``bench/RESULTS.md`` section 17).

A lane's work reports its end through :meth:`LaneWork.is_completed` (``poll``) and
:meth:`LaneWork.wait`; its error, if any, is raised by the collective's finishing step. Closing
the lane (``shutdown()``, an aborted group) stops its ring's waits and the thread.
"""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable
from typing import Any

from hora.errors import HoraError

JOIN_S = 5.0  # how long close() waits for whoever runs an operation to leave it

_LOCAL = threading.local()  # .deferred: the lanes a Blocking block queued on without waking


class Blocking:
    """A blocking collective's block: this thread's launches on lanes do not wake their threads.

    Its caller waits for what it launches right away and runs it then (:meth:`Lane.run_up_to`),
    so waking a lane's thread would only make it compete for the turn and the CPU. Whatever
    such a launch queued is handed to the lanes' threads when the block ends, however it ends
    (another collective launched in the same round, an exception before the wait).
    """

    __slots__ = ("outer",)

    def __enter__(self) -> Blocking:
        self.outer = getattr(_LOCAL, "deferred", None) is not None
        if not self.outer:
            _LOCAL.deferred = []
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.outer:
            return
        lanes, _LOCAL.deferred = _LOCAL.deferred, None
        for lane in lanes:
            lane.flush()


class LaneWork:
    """One operation queued on a lane: done once it has run (in whichever thread)."""

    def __init__(self, run: Callable[[], None], lane: Lane | None = None) -> None:
        self.run = run
        self.lane = lane
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        """Run the lane up to this operation here if nobody is running it, else wait for it.

        ``timeout`` is a timedelta or seconds; the ring's own timeout comes first, and ends
        the operation (with its error) wherever it runs.
        """
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if self.lane is not None and not self.done.is_set():
            self.lane.run_up_to(self)
        return self.done.wait(None if timeout is None else timeout + JOIN_S)

    def is_completed(self) -> bool:
        return self.done.is_set()

    def raise_error(self) -> None:
        """Raise what ended the operation early (nothing when it succeeded)."""
        if self.error is not None:
            raise self.error

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the operation ended (with ``error`` when it ended early)."""
        self.error = error
        self.done.set()


class Lane:
    """The operations queued on one ring, in launch order, and the thread that runs them.

    Args:
        ring: the lane's ring (``allreduce_``, ``hold_sigint``/``put_back_sigint``, ``stop()``
            and ``close(abort)`` are used).
    """

    def __init__(self, ring: Any) -> None:
        self.ring = ring
        self.queue: collections.deque[LaneWork] = collections.deque()
        self.turn = threading.Lock()  # held by whoever runs the ring's operations
        # released per queued operation (or once at a Blocking block's end for what it
        # queued), when a waiter leaves work behind or cannot take the turn, and at close
        self.kick = threading.Semaphore(0)
        self.thread: threading.Thread | None = None
        self.closed = False

    def allreduce(self, t: Any, op: str, name: str, reduce: str, tag: str,
                  source: Any = None) -> LaneWork:
        """Queue ``ring.allreduce_`` of ``t`` (see :meth:`hora.torch._shm.Ring.allreduce_`)."""
        work = LaneWork(lambda: self.ring.allreduce_(t, op, name, reduce, tag=tag,
                                                     source=source), self)
        if self.closed:
            work.finish(HoraError(f"{op} {name!r}: hora.torch was shut down"))
            return work
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="hora-shm-lane",
                                           daemon=True)
            self.thread.start()
        self.queue.append(work)
        deferred = getattr(_LOCAL, "deferred", None)
        if deferred is None:
            self.kick.release()
        elif self not in deferred:
            deferred.append(self)
        return work

    def flush(self) -> None:
        """Wake the thread when operations are queued (the end of a :class:`Blocking` block)."""
        if self.queue and not self.closed:
            self.kick.release()

    def run_up_to(self, work: LaneWork) -> None:
        """Run the queue in this thread until ``work`` has run, unless someone holds the turn.

        When the thread holds it, it runs the queue to its end, ``work`` included; when
        another waiter does, it wakes the thread for what it leaves: the caller then waits
        for ``work``'s end as before. In the main thread a SIGINT is held until the
        operations run here have ended (each of them ends in step with the members), then
        raised as KeyboardInterrupt; what is still queued behind ``work`` is left to the
        thread.
        """
        if work.done.is_set() or self.closed:
            return
        if not self.turn.acquire(blocking=False):
            self.kick.release()  # its holder may be leaving: the thread looks again after it
            return
        held = self.ring.hold_sigint()  # an interrupt comes after the operations, not between
        try:
            self._run_queued(until=work)
        finally:
            self.turn.release()
            self.flush()  # what is queued behind ``work`` is the thread's
            self.ring.put_back_sigint(held)

    def _run_queued(self, until: LaneWork | None = None) -> None:
        """Run queued operations from the head, the turn held, until ``until`` ran (or all)."""
        while not self.closed and (until is None or not until.done.is_set()):
            try:
                work = self.queue.popleft()
            except IndexError:
                return
            try:
                work.run()
            except BaseException as e:  # noqa: BLE001  (the collective's caller raises it)
                work.finish(e)
            else:
                work.finish()

    def _serve(self) -> None:
        while True:
            self.kick.acquire()
            if self.closed:
                return
            if not self.turn.acquire(blocking=False):
                continue  # a waiter runs the queue, and wakes this thread for what it leaves
            try:
                self._run_queued()
            finally:
                self.turn.release()

    def close(self, abort: bool = False) -> None:
        """Stop the thread and any wait in the ring at once, then close the ring."""
        if self.closed:
            return
        self.closed = True
        self.ring.stop()
        self.kick.release()
        if self.thread is not None:
            self.thread.join(JOIN_S)
        got = self.turn.acquire(timeout=JOIN_S)  # a waiter running an operation leaves it
        try:
            self.ring.close(abort)
        finally:
            if got:
                self.turn.release()
        while self.queue:  # what was still queued never ran: its waiters learn it
            work = self.queue.popleft()
            if not work.done.is_set():
                work.finish(HoraError("hora.torch was shut down before this collective ran"))
