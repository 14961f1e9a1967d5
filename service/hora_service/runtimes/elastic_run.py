"""Elastic jobs in the service: their driver, their slot file, their workers (control plane).

An elastic job (``spec.elastic``) runs as one process under the rank shim: ``hora run``'s
elastic driver (:mod:`hora.launch.elastic`), which starts the workers, replaces one that dies
while the others keep their processes, and re-forms the world through ``hora.torch.elastic``.
The service stays the owner of the slots: it grants them by rewriting the attempt's slot file
(``RUN_DIR/elastic.hosts``, one ``localhost:N`` line that the driver re-reads every second,
``--host-file``).

The driver runs as the job's account, which in multi-user mode cannot reach the run
directory by its path (the data directory is the service's alone, and the attempt's mount
namespace hides it). So the rank shim, still root, opens the run directory and hands the
driver that descriptor: its ``--host-file`` is ``/proc/self/fd/N/elastic.hosts``
(:data:`HOSTS_ARG`, the launch file's ``run_dir_arg``). The directory and the file stay the
service's (mode 0750 and 0640, group the job's account's): the driver can read the slots it
is offered but neither change the file nor put another in its place, and no other account
can read them.

The driver and its workers are the job's own code (a ``sitecustomize`` on its
``PYTHONPATH`` runs in both), so nothing they print is a fact the service acts on. The
``membership`` lines the driver prints (``--report-membership``, in rank 0's log) are read
for the job's page only (its size and history, :class:`ElasticRun`). Which workers exist is
what the kernel shows (:func:`workers`): the processes of the attempt's container whose
parent is the driver (or that left the driver's tree), oldest first; the slots they hold are
the attempt's first ones. A shrink is done when no more of them run than the slots it keeps;
a job that runs more workers than it holds (it ignores a shrink, or starts more than it was
offered) has its newest extra workers stopped, with their processes, once the excess has
lasted ``elastic_shrink_timeout_s`` (:meth:`ElasticRun.excess`, :func:`stop_workers`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from hora.launch.elastic_rdzv import read_membership
from hora.procs import signal_group
from hora.spec import ElasticInfo, ElasticMember, JobSpec, MembershipChange

if TYPE_CHECKING:  # the runtimes import this module (the slot file's name)
    from hora_service.runtimes.containment import Container

HOSTS_FILE = "elastic.hosts"
HOSTS_ARG = "--host-file"  # the driver's argument the shim points into the run directory
HISTORY_MAX = 200  # the newest membership changes a job keeps
READ_MAX = 1 << 20  # most log bytes one poll reads


def driver_argv(spec: JobSpec, workers: int, python: str) -> list[str]:
    """The argument list of an elastic job's one process: the driver, then the job's command.

    The slot file is named relative to the run directory (``elastic.hosts``); the shim makes
    it a path through its descriptor of that directory (:func:`hosts_arg`).

    Example:
        >>> from hora.spec import ElasticSpec
        >>> spec = JobSpec(command=["python", "t.py"], elastic=ElasticSpec(min_workers=2,
        ...                max_workers=3))
        >>> driver_argv(spec, 3, "py")[3:11]
        ['-np', '3', '--min-np', '2', '--max-np', '3', '--host-file', 'elastic.hosts']
    """
    assert spec.elastic is not None
    e = spec.elastic
    return [
        python, "-m", "hora.launch", "-np", str(workers), "--min-np", str(e.min_workers),
        "--max-np", str(e.max_workers), HOSTS_ARG, HOSTS_FILE, "--report-membership",
        "--", *spec.command,
    ]  # fmt: skip


def hosts_arg(driver: Sequence[str]) -> int:
    """The index of the slot file's name in a driver's argument list (``run_dir_arg``).

    Only the service's own part, before ``--``, can hold it: the first ``--host-file``.

    Example:
        >>> from hora.spec import ElasticSpec
        >>> spec = JobSpec(command=["x", "--host-file", "y"], elastic=ElasticSpec(
        ...                min_workers=1, max_workers=2))
        >>> hosts_arg(driver_argv(spec, 1, "py"))
        10
    """
    return list(driver).index(HOSTS_ARG) + 1


def write_hosts(path: Path, workers: int, gid: int) -> None:
    """Offer the driver ``workers`` slots (atomically: it reads the old or the new file).

    The file is the service's, readable by the job's group (``gid``) as the run directory is.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
    try:
        os.fchmod(fd, 0o640)
        if os.geteuid() == 0 or gid == os.getegid():
            os.fchown(fd, -1, gid)
        os.write(fd, f"localhost:{workers}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def workers(container: Container, shim: int) -> list[int] | None:
    """An elastic attempt's worker processes as the kernel shows them, oldest first.

    The driver is the process of the attempt whose parent is the rank shim (``shim``, from
    the shim's own pid file); a worker is a process of the attempt, of the driver's account,
    whose parent is the driver, or whose parent is outside the attempt (it left the driver's
    tree, and counts as a worker of its own). The workers' own children (a data loader's) are
    not counted, nor the service's own helpers in the attempt (its namespace holder runs as
    root, never a job's account). None while there is no driver to tell them by (it has not
    started yet, or has ended).
    """
    procs: dict[int, tuple[int, int, float]] = {}
    for pid in container.pids():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            procs[pid] = (proc.ppid(), proc.uids().real, proc.create_time())
    drivers = {pid: uid for pid, (parent, uid, _) in procs.items() if parent == shim}
    if not drivers:
        return None
    found = [
        (started, pid)
        for pid, (parent, uid, started) in procs.items()
        if pid not in drivers and uid in drivers.values()
        and (parent in drivers or parent not in procs)
    ]
    return [pid for _, pid in sorted(found)]


def stop_workers(pids: Sequence[int], container: Container) -> list[int]:
    """SIGKILL these workers of the attempt and every process below them; the ones stopped.

    A pid no longer in the attempt's container is left alone (it ended; its number may
    belong to another process by now).
    """
    live, stopped = container.pids(), []
    for pid in pids:
        if pid not in live:
            continue
        try:
            below = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            below = []
        signal_group(pid, signal.SIGKILL)  # a worker leads a process group of its own
        for each in (pid, *below):
            if each in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(each, signal.SIGKILL)
        stopped.append(pid)
    return stopped


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


@dataclass
class ElasticRun:
    """What the service knows of one running elastic attempt (see the module docstring).

    Attributes:
        info: the job's size and history as ``GET /v1/jobs/{id}`` shows it.
        log: rank 0's log of the attempt (the driver's output).
        per_worker: slots per worker (``gpus_per_worker``).
    """

    info: ElasticInfo
    log: Path
    per_worker: int = 1
    offset: int = 0
    target: int | None = None  # slots it is being shrunk to (None: not shrinking)
    over_since: float | None = None  # since when more workers run than it may hold
    next_look: float = 0.0  # when the monitor looks at its workers again
    _partial: bytes = field(default=b"", repr=False)

    @classmethod
    def begin(
        cls, spec: JobSpec, log: Path, slots: int, now: float, before: ElasticInfo | None
    ) -> ElasticRun:
        """A run starting with ``slots`` slots; ``before``: the job's info from earlier attempts."""
        assert spec.elastic is not None
        e, g = spec.elastic, spec.gpus_per_worker
        info = before or ElasticInfo(min_workers=e.min_workers, max_workers=e.max_workers)
        run = cls(info.model_copy(update={"members": [], "size": 0}), log, g)
        run.granted(slots, f"started with slots for {slots // g} of {e.min_workers}.."
                           f"{e.max_workers} workers", now)  # fmt: skip
        return run

    def granted(self, slots: int, reason: str, now: float) -> None:
        """Record that the job holds ``slots`` slots now, and why."""
        change = MembershipChange(at=_at(now), size=self.info.size, reason=reason, slots=slots)
        self._change(change, slots=slots)

    def shrink(self, slots: int, reason: str, now: float) -> None:
        """Begin giving slots back: the driver is offered ``slots``; :meth:`released` says when.

        Its newest workers leave at the next commit (they exit 0); the others go on.
        """
        self.target, self.next_look = slots, 0.0  # look at its workers at the next pass
        self._change(MembershipChange(at=_at(now), size=self.info.size, reason=reason,
                                      slots=self.info.slots))  # fmt: skip

    def released(self, seen: Sequence[int]) -> bool:
        """Whether a shrink is done: no more workers run (``seen``) than the slots it keeps."""
        return self.target is not None and len(seen) <= self.target // self.per_worker

    def excess(self, seen: Sequence[int], held: int, now: float, bound_s: float) -> list[int]:
        """The workers to stop now: the newest beyond what it may hold, once ``bound_s`` passed.

        Args:
            seen: its workers, oldest first (:func:`workers`).
            held: slots it holds (during a shrink it may keep only ``target``).
            now: the time.
            bound_s: how long an excess may last (``elastic_shrink_timeout_s``).

        Example:
            >>> from hora.spec import ElasticInfo
            >>> run = ElasticRun(ElasticInfo(min_workers=1, max_workers=4), Path("log"))
            >>> run.excess([11, 12, 13], held=3, now=0.0, bound_s=60)
            []
            >>> run.target = 1  # shrinking to one slot: two too many, stopped after 60 s
            >>> run.excess([11, 12, 13], 3, 10.0, 60), run.excess([11, 12, 13], 3, 70.0, 60)
            ([], [12, 13])
        """
        allowed = (held if self.target is None else self.target) // self.per_worker
        extra = list(seen[allowed:])
        if not extra:
            self.over_since = None
            return []
        if self.over_since is None:
            self.over_since = now
        return extra if now - self.over_since >= bound_s else []

    def stopped(self, pids: Sequence[int], now: float) -> None:
        """Record that the service stopped these workers (they outlived the bound)."""
        waited = now - (self.over_since if self.over_since is not None else now)
        self.over_since = None
        names = ", ".join(map(str, pids))
        reason = (f"stopped worker process(es) {names}: more workers than the "
                  f"{self.target if self.target is not None else self.info.slots} slot(s) it "
                  f"may hold, still running {waited:.0f} s later")  # fmt: skip
        self._change(MembershipChange(at=_at(now), size=self.info.size, reason=reason,
                                      slots=self.info.slots))  # fmt: skip

    def read(self) -> bool:
        """Read the driver's new ``membership`` lines; True when the membership changed."""
        changed = False
        for line in self._new_lines():
            found = read_membership(line)
            if found is not None and self._take(found):
                changed = True
        return changed

    def _new_lines(self) -> list[str]:
        try:
            with self.log.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # the log was cut (past its limit): read it anew
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                data = f.read(READ_MAX)
        except OSError:
            return []
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > READ_MAX:
            self._partial = b""
        return [raw.decode(errors="replace") for raw in lines]

    def _take(self, found: dict[str, object]) -> bool:
        generation, size, at = found.get("generation"), found.get("size"), found.get("at")
        members = found.get("members")
        if not (isinstance(generation, int) and isinstance(size, int)):
            return False
        if generation <= self.info.generation or not isinstance(members, list):
            return False  # one already seen (a log read again after it was cut)
        rows = [
            ElasticMember(worker=str(m[0]), rank=r, pid=int(m[1]))
            for r, m in enumerate(members)
            if isinstance(m, list) and len(m) == 2 and isinstance(m[1], int)
        ]
        when = float(at) if isinstance(at, int | float) else datetime.now(UTC).timestamp()
        reason = str(found.get("reason") or "")
        change = MembershipChange(
            at=_at(when), size=size, reason=reason, generation=generation, slots=self.info.slots
        )
        self._change(change, size=size, generation=generation, members=rows)
        return True

    def _change(self, change: MembershipChange, **update: object) -> None:
        history = [*self.info.history, change][-HISTORY_MAX:]
        self.info = self.info.model_copy(update={**update, "history": history})


def python() -> str:
    """The Python the driver runs with: the service's own (it has hora installed)."""
    return sys.executable
