"""hora.torch's exit path waits for a joined thread's OS thread, not only its Python state.

``Thread.join()`` returns once the thread cleared its Python state; the OS thread is still
listed in ``/proc/self/task`` for a moment (here, after several percent of joins). An exit
handler that counted threads right after hora's could then see the heartbeat thread: the
200-exit test in tests/dist/test_exit.py failed that way once in CI, 1 rank in 200.
"""

from __future__ import annotations

import os
import threading

import pytest
from hora.torch import _heartbeat

TASKS = "/proc/self/task"
pytestmark = pytest.mark.skipif(not os.path.isdir(TASKS), reason="needs Linux's /proc")

ROUNDS = 1000


def test_no_os_thread_is_left_after_join_and_await() -> None:
    left = 0
    for _ in range(ROUNDS):
        go = threading.Event()
        t = threading.Thread(target=go.wait, args=(5,), daemon=True)
        t.start()
        go.set()
        t.join(timeout=5)
        _heartbeat.await_os_thread_end(t, 5.0)
        left += os.path.exists(f"{TASKS}/{t.native_id}")
    assert left == 0, f"{left} of {ROUNDS} joined threads were still listed in {TASKS}"


def test_a_running_thread_is_not_waited_for() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, args=(5,), daemon=True)
    t.start()
    try:
        _heartbeat.await_os_thread_end(t, 5.0)  # returns at once: the thread has not been joined
        assert t.is_alive()
    finally:
        stop.set()
        t.join(timeout=5)
