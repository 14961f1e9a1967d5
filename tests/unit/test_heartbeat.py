"""The kernel's session heartbeat: a started cell is told at once, not a period later."""

from __future__ import annotations

import threading
from typing import Any

from hora.engines.heartbeat import SessionHeartbeat
from hora.spec import JobState


class _Closed:
    """The heartbeat's client: beat() is overridden below, so only close() is called."""

    def close(self) -> None:
        pass


class _Recording(SessionHeartbeat):
    def __init__(self) -> None:
        super().__init__(_Closed(), 1, period=3600.0, idle=lambda: 0.0)  # type: ignore[arg-type]
        self.beats = threading.Semaphore(0)

    def beat(self) -> Any:
        self.beats.release()
        return type("Info", (), {"ended": None, "state": JobState.running})()


def test_a_nudge_beats_now_and_the_period_still_holds_otherwise() -> None:
    hb = _Recording()
    hb.start()
    try:
        assert not hb.beats.acquire(timeout=0.3), "no beat before the hour-long period"
        hb.nudge()
        assert hb.beats.acquire(timeout=5), "a nudge beats at once"
        assert not hb.beats.acquire(timeout=0.3), "one nudge, one beat"
        hb.nudge()
        assert hb.beats.acquire(timeout=5)
    finally:
        hb.stop()
    assert not hb._thread.is_alive()
