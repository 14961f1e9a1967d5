"""A job's merged per-rank timeline: where it is, its events, its scaling report (control plane).

A job that sets ``HOROVOD_TIMELINE`` in its env writes a Chrome trace there (rank 0 merges
the per-rank parts; see :mod:`hora.timeline_merge`). This module finds it (the path must lie
under the job's working directory, itself under the work root), reads it and any parts not
merged yet without writing anything (each file at most :data:`MAX_BYTES`), and computes the
job's scaling report from it with :func:`hora.scaling.from_trace`, the same computation as
``%%distributed --profile``'s, against the job's preflight bandwidth. The dashboard draws the
events (:mod:`hora_service.ui.timeline`); ``GET /v1/jobs/{id}/scaling`` answers the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hora.errors import SpecError
from hora.scaling import RankProfile, from_trace, preflight_busbw
from hora.timeline_merge import part_path
from pydantic import BaseModel, Field

from hora_service.jobpreflight import job_preflight
from hora_service.manager import JobManager
from hora_service.models import JobRecord

MAX_BYTES = 32 << 20
VAR = "HOROVOD_TIMELINE"


class JobScaling(BaseModel):
    """A job's scaling report from its timeline (:mod:`hora.scaling` defines each figure)."""

    timeline: str = Field(description="the merged trace file it was computed from")
    ranks: list[RankProfile]
    slowest: int = Field(description="the rank with the most compute + transfer")
    why: str = Field(description="compute or communication, and by how much")
    efficiency: float = Field(description="the median rank's compute / the slowest wall time")
    preflight_busbw_gbps: float | None = None
    notes: list[str] = []
    rows: list[dict[str, Any]] = Field(description="the table as %%distributed --profile shows it")
    verdict: str


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


def trace_events(manager: JobManager, job: JobRecord) -> tuple[Path | None, list[dict[str, Any]]]:
    """The timeline's path and its events: the merged file's, then each rank's unmerged part."""
    path = trace_file(manager, job)
    if path is None:
        return None, []
    events = _lines(path)
    for rank in range(job.spec.workers):
        events += _lines(part_path(path, rank))
    return path, events


def job_scaling(manager: JobManager, job: JobRecord) -> JobScaling | None:
    """The job's scaling report; None when it has no timeline or no rank recorded a collective."""
    path, events = trace_events(manager, job)
    if path is None:
        return None
    report = from_trace(events, preflight_busbw(job_preflight(manager, job)))
    if report is None:
        return None
    return JobScaling(timeline=str(path), **report.to_dict())
