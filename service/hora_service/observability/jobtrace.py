"""A job's merged per-rank timeline: where it is, its events, its scaling report (control plane).

A job that sets ``HOROVOD_TIMELINE`` in its env writes a Chrome trace there (rank 0 merges
the per-rank parts; see :mod:`hora.timeline_merge`). This module finds it (relative to the
job's working directory; it must lie under the work root), reads it and any parts not merged
yet without writing anything, and computes the job's scaling report from it with
:func:`hora.scaling.from_trace`, the same computation as ``%%distributed --profile``'s, against
the job's preflight bandwidth. The dashboard draws the events
(:mod:`hora_service.ui.timeline`); ``GET /v1/jobs/{id}/scaling`` answers the report.

The path is the job's word and the files are the job's: they are read as files of the job's
account (:mod:`hora_service.observability.jobfiles`: no link followed, no FIFO or device opened for
reading, another account's file refused, :data:`MAX_BYTES` at most in all). A refusal is
:class:`~hora_service.observability.jobfiles.UntrustedJobFile`, an error of that job's request
alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hora.errors import SpecError
from hora.scaling import from_trace, preflight_busbw
from hora.service_wire import JobScaling
from hora.spec import RuntimeName
from hora.timeline_merge import part_path

from hora_service.jobs.preflight import job_preflight
from hora_service.manager import JobManager
from hora_service.models import JobRecord
from hora_service.observability.jobfiles import (
    Account,
    UntrustedJobFile,
    open_dir,
    read_at,
    relative_to_root,
)

MAX_BYTES = 32 << 20  # the merged trace and its parts together
VAR = "HOROVOD_TIMELINE"


def _lines(data: bytes) -> list[dict[str, Any]]:
    text = data.decode(errors="replace")
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
    """Where the job's timeline is (not resolved: never through a link), or None if it set none.

    Raises:
        UntrustedJobFile: the path lies outside the work root.
    """
    given = job.spec.env.get(VAR)
    if not given:
        return None
    try:
        workdir = manager.workdir(job.spec, job.user)
    except (SpecError, OSError, RuntimeError, ValueError):
        return None
    path = Path(os.path.normpath(workdir / given))
    if not relative_to_root(manager.settings.work_root, path).parts:
        raise UntrustedJobFile(str(path), "the work root itself, not a file")
    return path


def job_account(manager: JobManager, job: JobRecord) -> Account:
    """The account the job's ranks run as, whose files its timeline must be.

    Raises:
        SpecError: a multi-user job whose user has no account (any more).
    """
    if manager.user_mode == "multi":
        who = manager.users.run_as(job.user_id)
        return Account(who.uid, who.gid)
    if job.spec.runtime is RuntimeName.docker and os.geteuid() == 0:  # docker_uid, never root
        uid = manager.settings.docker_uid
        return Account(uid, uid)
    return Account(os.geteuid(), os.getegid())


def trace_events(manager: JobManager, job: JobRecord) -> tuple[Path | None, list[dict[str, Any]]]:
    """The timeline's path and its events: the merged file's, then each rank's unmerged part.

    Raises:
        UntrustedJobFile: the path or a file is not one the job's account wrote and may read
            (a link, FIFO, device, another account's, too large; see
            :mod:`hora_service.observability.jobfiles`).
    """
    path = trace_file(manager, job)
    if path is None:
        return None, []
    try:
        who = job_account(manager, job)
    except SpecError as e:
        raise UntrustedJobFile(str(path), f"not readable: {e.message}") from None
    root = manager.settings.work_root
    left, events = MAX_BYTES, []
    try:
        with open_dir(root, relative_to_root(root, path.parent), who) as dfd:
            parts = [part_path(path.name, r).name for r in range(job.spec.workers)]
            for name in [path.name, *parts]:
                data = read_at(dfd, name, str(path.parent / name), who, left)
                if data is not None:
                    left -= len(data)
                    events += _lines(data)
    except FileNotFoundError:
        return path, []
    except OSError as e:
        raise UntrustedJobFile(str(path), f"not readable ({e.strerror})") from None
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
