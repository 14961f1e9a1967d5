"""This rank's heartbeat: a thread that publishes its collective counter (data plane).

Every :data:`PERIOD_S` seconds the thread writes ``seq time signature op`` under
``KEY + rank`` in the rendezvous store, over its own connection (a blocking wait elsewhere
never delays it), so a rank waiting in a collective can name the one that stalled, and
where (Horovod's stall check, :mod:`hora.torch._stall`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from hora.torch._rendezvous import own_client

KEY = "hora/hb/"
PERIOD_S = 0.25


class StallHeartbeat:
    """The heartbeat thread of one rank; :meth:`stop` ends it.

    Args:
        state: the rank's ``hora.torch._state.RankState`` (its ``rank``, ``seq``, ``last_sig``,
            ``last_op`` are published).
        store: the rendezvous store (a second connection to it is opened).
    """

    def __init__(self, state: Any, store: Any) -> None:
        self.state = state
        self.store = own_client(store)
        self.key = f"{KEY}{state.rank}"
        self.store.set(self.key, f"0 {time.time():.3f} 0 init")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        st = self.state
        while not self._stop.wait(PERIOD_S):
            try:
                self.store.set(self.key, f"{st.seq} {time.time():.3f} {st.last_sig} {st.last_op}")
            except Exception:  # the store host went away; the op that fails will report it
                return

    def stop(self) -> None:
        """End the thread (and wait for its OS thread), then drop the store connection."""
        self._stop.set()
        self._thread.join(timeout=2 * PERIOD_S + 1)
        await_os_thread_end(self._thread, 0.5)
        self.store = None


def await_os_thread_end(thread: threading.Thread, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until a joined thread's OS thread has ended too.

    ``Thread.join()`` returns once the thread cleared its Python state; the OS thread exits a
    moment later (on a busy machine, after the main thread moved on: an exit handler could
    still count it). Linux only; elsewhere, and for a thread still running, it returns at once.
    """
    if thread.is_alive() or thread.native_id is None or not os.path.isdir("/proc/self/task"):
        return
    await_os_threads_end({thread.native_id}, timeout_s)


# The threads torch.distributed starts for a group and its store (gloo's loops, the TCPStore's
# libuv server): destroying the group or the store joins them
_TORCH_THREADS = ("gloo_", "pt_gloo", "pt_tcpstore")


def torch_thread_ids() -> set[int]:
    """The ids of this process's torch.distributed threads (empty where /proc is missing)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    return {int(t) for t in tids if _thread_name(int(t)).startswith(_TORCH_THREADS)}


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return ""


def await_os_threads_end(tids: set[int], timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the OS threads ``tids`` are gone from this process.

    A joined C++ thread, like a Python one (:func:`await_os_thread_end`), leaves the kernel's
    task list a moment after ``join()`` returned. A thread still running (a group the user
    holds) costs the whole timeout, so the caller names only the threads it released.
    """
    deadline = time.monotonic() + timeout_s
    left = {t for t in tids if os.path.exists(f"/proc/self/task/{t}")}
    while left and time.monotonic() < deadline:
        time.sleep(0.0005)
        left = {t for t in left if os.path.exists(f"/proc/self/task/{t}")}
