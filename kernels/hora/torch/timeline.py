"""Chrome-trace timeline of hora.torch collectives (data plane).

Started by ``hvd.start_timeline(F)``, by the ``HOROVOD_TIMELINE`` / ``HORA_TIMELINE``
environment variable at ``init()``, or by ``hora run --timeline-filename F``. Every rank streams
its events to ``F.rank{r}.part``; rank 0 merges the parts into ``F`` at ``stop_timeline()`` /
``shutdown()`` (and the launcher merges leftovers with :func:`hora.timeline_merge.merge_parts`).
One row (tid) per tensor name, one process (pid) per rank; each event carries the tensor name
and its bytes, and its name is the phase: ``QUEUED``, ``MEMCPY_IN_FUSION_BUFFER``, or the
operation itself (``ALLREDUCE``, ``BROADCAST``, ...: the communicating phase); ``hvd.init()``'s
preflight is one ``PREFLIGHT`` event. Instant events ``TIMELINE_START`` and ``TIMELINE_STOP``
mark when each rank started and stopped recording (a job's scaling report,
:mod:`hora.scaling`, measures each rank's wall time between them).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from hora.scaling import START, STOP
from hora.timeline_merge import merge_parts, part_path
from hora.torch import _state

__all__ = ["enabled", "merge_parts", "now_ns", "record", "start_timeline", "stop_timeline"]

# perf_counter_ns values are far below this; wall-clock time_ns values (since 1970) are above.
_WALL_NS_MIN = 10**17
_STOP_WAIT_S = 10.0
# A script that exits without shutdown() (or by an exception) waits this long at most for the
# other ranks' timeline parts before rank 0 merges; the hora run launcher merges the rest.
_EXIT_WAIT_S = 2.0


class _Writer:
    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.rank = rank
        # line-buffered: a rank killed by the launcher (SIGTERM) keeps every finished event
        self.file: IO[str] = part_path(path, rank).open("w", encoding="utf-8", buffering=1)
        self.tids: dict[str, int] = {}
        self.lock = threading.Lock()
        self.offset_ns = time.time_ns() - time.perf_counter_ns()
        self._meta("process_name", 0, f"rank {rank}")
        self._meta("process_sort_index", 0, rank)
        self.mark(START)

    def _meta(self, what: str, tid: int, value: object) -> None:
        key = "sort_index" if what.endswith("sort_index") else "name"
        event = {"ph": "M", "name": what, "pid": self.rank, "tid": tid, "args": {key: value}}
        self.file.write(json.dumps(event) + "\n")

    def mark(self, what: str) -> None:
        """An instant event on this rank's lane: when recording started or stopped."""
        event = {"ph": "i", "s": "p", "name": what, "pid": self.rank, "tid": 0,
                 "ts": time.time_ns() / 1000.0}  # fmt: skip
        with self.lock:
            self.file.write(json.dumps(event) + "\n")

    def tid(self, name: str) -> int:
        tid = self.tids.get(name)
        if tid is None:
            tid = self.tids[name] = len(self.tids) + 1
            self._meta("thread_name", tid, name)
        return tid

    def write(
        self,
        name: str,
        phase: str,
        start_ns: int,
        end_ns: int,
        nbytes: int,
        args: dict[str, Any] | None,
    ) -> None:
        if start_ns < _WALL_NS_MIN:
            start_ns += self.offset_ns
            end_ns += self.offset_ns
        fields = {"tensor": name, "bytes": nbytes, **(args or {})}
        with self.lock:
            event = {
                "name": phase,
                "cat": "collective",
                "ph": "X",
                "pid": self.rank,
                "tid": self.tid(name),
                "ts": start_ns / 1000.0,
                "dur": max(0, end_ns - start_ns) / 1000.0,
                "args": fields,
            }
            self.file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        self.mark(STOP)
        with self.lock:
            self.file.close()


_writer: _Writer | None = None
# In-process listeners (``%%distributed --profile``): each gets every event ``record`` gets,
# as ``(name, phase, start_ns, end_ns, nbytes, args)``, with or without a timeline file.
LISTENERS: list[Any] = []


def enabled() -> bool:
    """Return whether a timeline is being recorded (check it before building event args)."""
    return _writer is not None or bool(LISTENERS)


def now_ns() -> int:
    """Return the clock timeline events use (wall-clock ns, comparable across ranks)."""
    return time.time_ns()


def record(
    name: str,
    phase: str,
    start_ns: int,
    end_ns: int,
    nbytes: int,
    args: dict[str, Any] | None = None,
) -> None:
    """Record one phase of one tensor's collective; a no-op when no timeline is running.

    Args:
        name: tensor name (one row per name).
        phase: "QUEUED", "MEMCPY_IN_FUSION_BUFFER", or the op ("ALLREDUCE", ...).
        start_ns: start, from :func:`now_ns` (``time.perf_counter_ns()`` values are converted).
        end_ns: end, same clock.
        nbytes: bytes of the tensor.
        args: extra fields shown in the trace viewer.

    Example:
        >>> t0 = now_ns(); record("grad.0", "ALLREDUCE", t0, now_ns(), 4096)
    """
    w = _writer
    if w is not None:
        w.write(name, phase, start_ns, end_ns, nbytes, args)
    for listener in LISTENERS:
        listener(name, phase, start_ns, end_ns, nbytes, args)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording collectives to ``file_path`` (call on every rank, like Horovod).

    Args:
        file_path: the merged Chrome-trace JSON file rank 0 writes at stop.
        mark_cycles: accepted for Horovod compatibility; hora has no cycles to mark.

    Raises:
        NotInitializedError: before ``init()``.

    Example:
        >>> hvd.start_timeline("/tmp/timeline.json")
    """
    global _writer
    state = _state.require_init("start_timeline")
    if _writer is not None:
        stop_timeline()
    path = Path(file_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _writer = _Writer(path, state.rank)


def _wait_all_stopped(state: Any, gen: str, wait_s: float) -> None:
    """Rank 0 waits (bounded) until every rank closed its part; other ranks only announce."""
    try:
        n = state.store.add(f"hora/timeline/stopped/{gen}", 1)
        deadline = time.monotonic() + min(wait_s, state.timeout_s)
        while state.rank == 0 and n < state.size and time.monotonic() < deadline:
            time.sleep(0.02)
            n = state.store.add(f"hora/timeline/stopped/{gen}", 0)
    except Exception:  # a dead store host: merge what exists; the launcher merges the rest
        return


def stop_timeline(*, _wait_s: float = _STOP_WAIT_S) -> None:
    """Stop recording; rank 0 merges every rank's events into the timeline file.

    Rank 0 first waits (at most 10 s, or the collective timeout) for the other ranks to stop.

    Example:
        >>> hvd.stop_timeline()
    """
    global _writer
    w, _writer = _writer, None
    if w is None:
        return
    w.close()
    state = _state.current()
    if state is not None and state.size > 1:
        _wait_all_stopped(state, str(w.path), _wait_s)
    if w.rank == 0:
        merge_parts(w.path)


def _start_at_init(environ: Mapping[str, str], _process_sets: Sequence[Any] | None) -> None:
    """``init()``'s hook: start the timeline that ``HORA_TIMELINE`` names."""
    path = environ.get("HORA_TIMELINE") or environ.get("HOROVOD_TIMELINE")
    if path and path != "DYNAMIC":  # Horovod's DYNAMIC: started later by start_timeline()
        start_timeline(path)


def _stop_at_shutdown(exiting: bool) -> None:
    """``shutdown()``'s hook (and the exit's, which waits less for the other ranks' parts)."""
    if enabled():
        stop_timeline(_wait_s=_EXIT_WAIT_S if exiting else _STOP_WAIT_S)


_state.register_init_hook(_start_at_init)
_state.register_stop_hook(_stop_at_shutdown)
