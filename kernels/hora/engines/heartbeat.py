"""The heartbeat of a session and what a queued start shows (data plane, the kernel's side).

:class:`SessionHeartbeat` renews a session's lease from a background thread, says how long
the engines have been idle, and notes what the service answers: its warning before the idle
timeout, the session's end, its park, and a request to park it (idle, or its slots wanted
by a higher priority). :func:`render_queue` is what ``%dist_start`` shows while it waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from hora.client import Client
from hora.session_wire import Heartbeat, body, wire
from hora.spec import JobState, SessionInfo

log = logging.getLogger("hora.engines")


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_queue(info: SessionInfo, now: datetime, waited_s: float = 0.0) -> str:
    """What a queued ``%dist_start`` shows: place, who holds the slots, an estimate.

    Example:
        >>> print(render_queue(info, now))  # doctest: +SKIP
        session 7 queued: position 1; waiting for 2 slot(s); 0 free (waited 3s; Ctrl-C withdraws)
          job 5 (bob) holds slots 0,1 since 12:00:01 (5 min)
          no estimate: what holds the slots has no time limit
    """
    q = info.queue
    if q is None:
        return f"session {info.id} {info.state}"
    if q.position == 0:  # handed to a runtime whose own queue holds it (Slurm)
        return (
            f"session {info.id} waits in the runtime's queue: {q.reason} "
            f"(waited {_ago(waited_s)}; Ctrl-C withdraws)"
        )
    lines = [
        f"session {info.id} queued: position {q.position}; {q.reason} "
        f"(waited {_ago(waited_s)}; Ctrl-C withdraws)"
    ]
    for h in q.holders:
        since = h.since.astimezone().strftime("%H:%M:%S")
        held = _ago(max(0.0, (now - h.since).total_seconds()))
        idle = f", idle {_ago(h.idle_s)}" if h.idle_s is not None else ""
        ends = f", ends by {h.ends_at.astimezone():%H:%M:%S}" if h.ends_at else ""
        slots = ",".join(map(str, h.slots))
        who = h.what or f"{h.kind} {h.id} ({h.user})"  # what: a holder outside the service
        lines.append(f"  {who} holds slots {slots} since {since} ({held}{idle}{ends})")
    if q.estimate_at is not None:
        left = max(0.0, (q.estimate_at - now).total_seconds())
        lines.append(
            f"  estimate: slots free by {q.estimate_at.astimezone():%H:%M:%S} (~{_ago(left)})"
        )
    elif q.holders:
        lines.append("  no estimate: what holds the slots has no time limit")
    return "\n".join(lines)


class SessionHeartbeat:
    """Renews the session's lease from a background thread; keeps the warnings and the end.

    Args:
        service: a client of its own (the kernel's thread uses another).
        session_id: the session.
        period: seconds between heartbeats.
        idle: returns how long the engines have been idle, in seconds.
        notify: shows a notice in the notebook (a warning, or why the session ended).
        on_park: called (from this thread) with the service's reason when it asks the
            kernel to park the session (idle, or its slots wanted by a higher priority).
    """

    def __init__(
        self,
        service: Client,
        session_id: int,
        period: float,
        idle: Callable[[], float],
        notify: Callable[[str], None] | None = None,
        on_park: Callable[[str], None] | None = None,
    ) -> None:
        self.service, self.session_id, self.period = service, session_id, period
        self.idle, self.notify, self.on_park = idle, notify, on_park
        self.ended: SessionInfo | None = None
        self.parked: SessionInfo | None = None  # the service holds the session parked
        self.notices: list[str] = []
        self._warned: str | None = None
        self._stop = threading.Event()
        self._nudged = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the lease then runs out unless the session is deleted)."""
        self._stop.set()
        self._nudged.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.service.close()

    def nudge(self) -> None:
        """Beat now, not at the next period: a cell started (the service learns it at once)."""
        self._nudged.set()

    def beat(self) -> SessionInfo:
        """Send one heartbeat; note a new warning, a park (asked for, or done) or the end."""
        path = f"/v1/sessions/{self.session_id}/heartbeat"
        said = wire(body(Heartbeat, idle_s=self.idle()))
        info = SessionInfo.model_validate(self.service.request("POST", path, json=said).json())
        if info.state == JobState.parked:
            self.parked = info
        elif info.park_requested and info.state == JobState.running and self.on_park:
            self.on_park(info.park_requested)
        if info.ended:
            self.ended = info
            self._notice(f"hora: session {info.id} ended: {info.reason or info.state}")
        elif info.warning and self._warned is None:
            self._warned = info.warning
            self._notice(f"hora: {info.warning}")
        elif not info.warning:
            self._warned = None
        return info

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        if self.notify is not None:
            self.notify(text)

    def take_notices(self) -> list[str]:
        """The notices not shown yet (for the next cell's output)."""
        out, self.notices = self.notices, []
        return out

    def _run(self) -> None:
        while True:
            self._nudged.wait(self.period)
            self._nudged.clear()
            if self._stop.is_set():
                return
            try:
                info = self.beat()
                if info.ended or info.state == JobState.parked:
                    return
            except Exception as e:  # the service may be restarting: the lease covers a gap
                log.debug("heartbeat of session %d failed: %s", self.session_id, e)
