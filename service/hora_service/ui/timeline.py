"""A job's merged per-rank timeline for the dashboard (control plane, read-only).

A job that sets ``HOROVOD_TIMELINE`` in its env writes a Chrome trace there (rank 0 merges
the per-rank parts; see :mod:`hora.timeline_merge`). This module reads it, and any parts not
merged yet, without writing anything, and answers the complete (``ph: X``) events the page
draws: one lane per rank, one row per tensor. The path must lie under the job's working
directory (itself under the work root); larger traces are cut to ``MAX_EVENTS``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hora.errors import SpecError
from hora.timeline_merge import part_path

from hora_service.manager import JobManager
from hora_service.models import JobRecord

MAX_BYTES = 32 << 20
MAX_EVENTS = 20_000
VAR = "HOROVOD_TIMELINE"


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        if path.stat().st_size > MAX_BYTES:
            return []
        text = path.read_text(errors="replace")
    except OSError:
        return []
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
            return list(data.get("traceEvents", [])) if isinstance(data, dict) else []
        except json.JSONDecodeError:
            pass
    events = []
    for line in text.splitlines():
        line = line.strip().rstrip(",").lstrip("[")
        try:
            item = json.loads(line) if line else None
        except json.JSONDecodeError:  # a torn last line of a killed rank
            continue
        if isinstance(item, dict):
            events.append(item)
    return events


def trace_file(manager: JobManager, job: JobRecord) -> Path | None:
    """Where the job's timeline is, or None when it set none or it lies outside its root."""
    given = job.spec.env.get(VAR)
    if not given:
        return None
    try:
        workdir = manager.workdir(job.spec)
        path = (workdir / given).resolve()
    except (SpecError, OSError, RuntimeError, ValueError):
        return None
    return path if path.is_relative_to(manager.settings.work_root.resolve()) else None


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
    path = trace_file(manager, job)
    if path is None:
        return {"path": None, "events": [], "rows": {}, "truncated": False}
    events = _lines(path)
    for rank in range(job.spec.workers):
        events += _lines(part_path(path, rank))
    return {"path": str(path), **summarize(events)}
