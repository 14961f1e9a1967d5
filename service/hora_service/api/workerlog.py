r"""Each rank's log of an elastic job, read from its driver's log (control plane, pure).

An elastic job runs as one process, ``hora run``'s elastic driver, whose output (rank 0's
log file) holds its own lines and every worker's, each line of a worker prefixed with the
worker's number as Horovod prefixes ranks (``[3]<stdout>:``). Worker numbers never change;
ranks do, each time the world re-forms. Rank ``R`` of the job is the worker the current
world puts at ``R`` (``ElasticInfo.members``): its log is that worker's lines, prefix removed;
rank 0's also has the driver's own lines (how the world changed, why the job failed).

Offsets stay those of the driver's log, so that reading and following resume exactly where
they stopped: :meth:`WorkerView.take` consumes whole lines, and what it drops still counts as
read. The membership is the job's own report: it only chooses which lines are shown.

Example:
    >>> view = WorkerView(3, driver=False)
    >>> view.take(b"hora run: generation 2\n[3]<stdout>:loss 1\n[4]<stdout>:loss 2\n[3]<st")
    ('loss 1\n', 61)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hora.errors import SpecError
from hora.spec import ElasticInfo

from hora_service.api.logstream import complete_prefix

if TYPE_CHECKING:
    from hora_service.manager import JobManager
    from hora_service.models import JobRecord

Take = Callable[[bytes, bool], tuple[str, int]]

_PREFIX = re.compile(rb"\[(\d+)\]<std(?:out|err)>:")


def worker_of(info: ElasticInfo | None, rank: int) -> int | None:
    """The number of the worker at ``rank`` in the current world (None: no such rank).

    Example:
        >>> from hora.spec import ElasticMember
        >>> info = ElasticInfo(min_workers=1, max_workers=3, size=2, members=[
        ...     ElasticMember(worker="w2", rank=0, pid=9), ElasticMember(worker="w0", rank=1,
        ...     pid=8)])
        >>> worker_of(info, 1), worker_of(info, 2)
        (0, None)
    """
    for m in info.members if info is not None else ():
        if m.rank == rank and m.worker[1:].isdigit():
            return int(m.worker[1:])
    return None


@dataclass(frozen=True)
class WorkerView:
    """The lines of one worker (and, for rank 0, the driver's own) in the driver's log."""

    number: int
    driver: bool

    def take(self, data: bytes, final: bool = False) -> tuple[str, int]:
        """The text of this view in ``data`` and the bytes consumed (whole lines only).

        A line not finished yet is left for the next read, unless ``final`` (nothing more
        will be written) or it fills ``data`` alone (a line longer than one read).
        """
        end = data.rfind(b"\n") + 1
        if final or (end == 0 and data):
            end = len(data)
        kept = [self._keep(line) for line in data[:end].splitlines(keepends=True)]
        text, _ = complete_prefix(b"".join(k for k in kept if k is not None), final=True)
        return text, end

    def _keep(self, line: bytes) -> bytes | None:
        found = _PREFIX.match(line)
        if found is None:
            return line if self.driver else None
        return line[found.end() :] if int(found.group(1)) == self.number else None


def rank_log(manager: JobManager, job: JobRecord, rank: int, attempt: int) -> tuple[Path, Take]:
    """The file of rank ``rank``'s log and how its text is read from it.

    An elastic job's rank is a worker of its current world, read from the driver's log
    (rank 0's file); before its first world (or of an earlier attempt) rank 0 is the
    driver's whole log.

    Raises:
        SpecError: the job has no rank ``rank`` (now), or a negative rank or attempt.
    """
    if job.spec.elastic is None:
        if rank >= job.spec.workers:
            raise SpecError("rank", _no_rank(job, rank))
        return manager.log_path(job.id, rank, attempt), complete_prefix
    number = worker_of(job.elastic, rank) if attempt == job.attempt else None
    if number is None and rank != 0:
        raise SpecError("rank", _no_rank(job, rank))
    take = complete_prefix if number is None else WorkerView(number, driver=rank == 0).take
    return manager.log_path(job.id, 0, attempt), take


def _no_rank(job: JobRecord, rank: int) -> str:
    """Which ranks the job has, for a request of one it does not have."""
    e = job.spec.elastic
    if e is None:
        return f"job {job.id} has ranks 0..{job.spec.workers - 1}; rank {rank} does not exist"
    size = job.elastic.size if job.elastic is not None else 0
    world = f"ranks 0..{size - 1}" if size else "no world yet"
    return (
        f"job {job.id} is elastic ({e.min_workers}..{e.max_workers} workers) and has {world} "
        f"now; rank {rank} does not exist"
    )
