"""One attempt's own temporary directory, where it has no private ``/tmp`` (control plane).

An attempt with its own mount namespace (:mod:`hora_service.runtimes.namespaces`) has a
fresh ``/tmp`` that vanishes with it. Every other attempt of the local runtime (single-user
and shared mode, sessions, whose engines must stay on the host) gets a directory of its own
in the service's temporary directory, ``hora-tmp-<instance>-<job>-<attempt>-XXXXXXXX``
(mode 0700, owned by the job's account), as its ranks' ``TMPDIR`` unless the job's ``env``
sets one. Python's ``tempfile`` and most tools put their files there: a session engine's
private directory (which holds the controller's key), a job's scratch files.

The service removes it once the attempt's last process is gone (:func:`remove`, called from
the runtime's ``clear``), so nothing is left even when a rank was killed with SIGKILL and no
handler of its own ran, and after a restart of the service (the name is found again from the
attempt's containment tag).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from hora_service.runtimes.base import AttemptPlan

log = logging.getLogger(__name__)

VAR = "TMPDIR"
PREFIX = "hora-tmp-"


def prefix_of(tag: str) -> str:
    """The name an attempt's directory starts with, from its containment tag.

    Example:
        >>> prefix_of("ab12cd/7/1")
        'hora-tmp-ab12cd-7-1-'
    """
    return PREFIX + tag.replace("/", "-") + "-"


def prefix(plan: AttemptPlan) -> str | None:
    """The name the attempt's directory starts with; None without a containment tag."""
    return None if plan.container is None else prefix_of(plan.container.tag)


def make(plan: AttemptPlan, where: str | None = None) -> Path | None:
    """Create the attempt's directory (0700, the job account's); None without a tag."""
    start = prefix(plan)
    if start is None:
        return None
    path = Path(tempfile.mkdtemp(prefix=start, dir=where))  # a fresh name, never followed
    if plan.run_as is not None:
        os.chown(path, plan.run_as.uid, plan.run_as.gid)
    return path


def _dirs(start: str | None, where: str | None) -> list[Path]:
    """The attempt's directories: real directories (never links) named with its prefix."""
    if start is None:
        return []
    found = []
    for path in sorted(Path(where or tempfile.gettempdir()).glob(start + "*")):
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                found.append(path)
        except OSError:  # removed meanwhile
            continue
    return found


def existing(plan: AttemptPlan, where: str | None = None) -> Path | None:
    """The attempt's directory made by :func:`make` (a real directory, never a link), if any."""
    return next(iter(_dirs(prefix(plan), where)), None)


def remove(plan: AttemptPlan, where: str | None = None) -> None:
    """Remove the attempt's directories (call once none of its processes is left).

    Only real directories whose names start with the attempt's prefix; a symlink of that
    name is left alone, and what lies inside is removed without following links.
    """
    if plan.container is not None:
        remove_tagged(plan.container.tag, plan.job_id, where)


def remove_tagged(tag: str, job_id: int, where: str | None = None) -> None:
    """:func:`remove` for the attempt tagged ``tag`` (one a restarted service reaps)."""
    for path in _dirs(prefix_of(tag), where):
        try:
            shutil.rmtree(path)
        except OSError as e:
            log.warning("job %d: cannot remove %s: %s", job_id, path, e)
