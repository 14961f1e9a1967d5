"""What earlier runs of this service left that no attempt owns any more (control plane).

An attempt leaves its cgroup directories (``hora/<instance>/<job>-<attempt>`` under each
cgroup root), tagged processes (containment ``tag``) and, without a ``/tmp`` of its own, its
private temporary directory (``hora-tmp-<instance>-<job>-<attempt>-*``, see
:mod:`hora_service.runtimes.scratch`). The service removes them when the attempt ends; if it
was killed (or its store no longer knows the attempt), nothing did. At start, once the
attempts its store says are active are adopted again (:mod:`hora_service.jobs.recovery`),
:func:`reap` finds every other attempt of this service's instance on the machine, kills
what still runs in it and removes its directories.

Only names of this instance are looked at (derived from the data directory), so another
service's attempts on the same machine are never touched; a directory is removed without
following links.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import tempfile
from pathlib import Path

from hora_service.runtimes import scratch
from hora_service.runtimes.containment import Containment, process_tags

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (job, attempt)
REAP_WAIT_S = 5.0  # how long a start waits for a stray's killed processes to exit
_LEAF = re.compile(r"^(\d+)-(\d+)$")


def found(containment: Containment, tmp: str | None = None) -> set[Key]:
    """Every attempt of this instance that left something on the machine.

    Example:
        >>> found(Containment("tag", instance="ab12"))  # doctest: +SKIP
        {(7, 1)}
    """
    keys = {k for root in containment.roots for k in _leaves(root / "hora" / containment.instance)}
    if containment.kind == "tag":
        keys |= _tagged(containment.instance)
    where = Path(tmp or tempfile.gettempdir())
    start = scratch.PREFIX + containment.instance + "-"
    for path in where.glob(start + "*"):
        job, _, rest = path.name[len(start) :].partition("-")
        attempt = rest.partition("-")[0]
        if job.isdigit() and attempt.isdigit() and _is_dir(path):
            keys.add((int(job), int(attempt)))
    return keys


def reap(containment: Containment, known: set[Key], tmp: str | None = None) -> list[Key]:
    """Kill and remove what attempts outside ``known`` left; the ones reaped.

    An attempt whose processes cannot be killed yet (one in uninterruptible sleep) keeps
    its directories and is named in the log; the next start tries again.
    """
    reaped = []
    for job, attempt in sorted(found(containment, tmp) - known):
        box = containment.container(job, attempt)
        try:
            cleared = box.clear(wait_s=REAP_WAIT_S)
        except OSError as e:
            cleared = False
            log.warning("job %d attempt %d: cannot clear what it left: %s", job, attempt, e)
        if not cleared:
            log.warning("job %d attempt %d: processes are left; kept for now", job, attempt)
            continue
        scratch.remove_tagged(box.tag, job, tmp)
        reaped.append((job, attempt))
    if reaped:
        log.info("reaped what %d ended attempt(s) left: %s", len(reaped), reaped)
    return reaped


def _leaves(parent: Path) -> set[Key]:
    keys = set()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(parent):
            m = _LEAF.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False):
                keys.add((int(m[1]), int(m[2])))
    return keys


def _tagged(instance: str) -> set[Key]:
    keys = set()
    for _, tag in process_tags().values():
        parts = (tag or "").split("/")
        if len(parts) == 3 and parts[0] == instance and parts[1].isdigit():
            keys.add((int(parts[1]), int(parts[2]) if parts[2].isdigit() else 0))
    return keys


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
