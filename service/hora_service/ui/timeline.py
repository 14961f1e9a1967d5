"""A job's merged per-rank timeline for the dashboard (control plane, read-only).

A job that sets ``HOROVOD_TIMELINE`` in its env writes a Chrome trace there; this module
answers the complete (``ph: X``) events the page draws from what
:func:`hora_service.observability.jobtrace.trace_events` reads: one lane per rank, one row per
tensor.
Larger traces are cut to ``MAX_EVENTS``.
"""

from __future__ import annotations

from typing import Any

from hora_service.manager import JobManager
from hora_service.models import JobRecord
from hora_service.observability.jobfiles import UntrustedJobFile
from hora_service.observability.jobtrace import trace_events

MAX_EVENTS = 20_000


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The complete events (rank, row, name, start and length in µs) and row names.

    Example:
        >>> ev = [{"ph": "X", "pid": 1, "tid": 2, "name": "ALLREDUCE", "ts": 5, "dur": 3}]
        >>> summarize(ev)["events"][0]
        {'rank': 1, 'row': 2, 'name': 'ALLREDUCE', 'ts': 5.0, 'dur': 3.0}
    """
    rows: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            rows[f"{e.get('pid')}:{e.get('tid')}"] = str((e.get("args") or {}).get("name", ""))
        elif e.get("ph") == "X" and len(out) < MAX_EVENTS:
            try:
                out.append({
                    "rank": int(e.get("pid", 0)), "row": int(e.get("tid", 0)),
                    "name": str(e.get("name", ""))[:64], "ts": float(e["ts"]),
                    "dur": float(e.get("dur", 0.0)),
                })  # fmt: skip
            except (KeyError, TypeError, ValueError):
                continue
    return {"events": out, "rows": rows, "truncated": len(out) >= MAX_EVENTS}


def job_timeline(manager: JobManager, job: JobRecord) -> dict[str, Any]:
    """The job's timeline as the page draws it (``events`` empty when there is none)."""
    try:
        path, events = trace_events(manager, job)
    except UntrustedJobFile as e:  # the job named a file it may not show: say so, to it alone
        return {"path": e.path, "events": [], "rows": {}, "truncated": False, "error": str(e)}
    if path is None:
        return {"path": None, "events": [], "rows": {}, "truncated": False}
    return {"path": str(path), **summarize(events)}
