"""Per-attempt process containers: every process of an attempt, found and killed (control plane).

A job's processes may fork, ignore SIGTERM, or ``setsid()`` into a session of their own; a
signal to the rank's process group misses those. Like systemd and Slurm's proctrack/cgroup,
hora puts each attempt in a **cgroup** of its own, which no process can leave, and kills the
attempt by its cgroup: freeze it (nothing can fork any more), SIGKILL every process in it,
thaw it (``cgroup.kill`` does all three at once on cgroup v2).

Backends, chosen by :func:`detect` (setting ``containment``):

* ``cgroup2`` where ``/sys/fs/cgroup`` is the unified hierarchy: ``hora/<instance>/<job>-<attempt>``
  under it (``cgroup.kill``, or ``cgroup.freeze`` on kernels before 5.14).
* ``cgroup1`` where the ``freezer`` and ``pids`` controllers are mounted and writable:
  ``/sys/fs/cgroup/{freezer,pids}/hora/<instance>/<job>-<attempt>`` (and the same under
  ``memory`` and ``cpu`` where those are writable, for the attempt's limits: see
  :mod:`hora_service.runtimes.limits`).
* ``cgroup2`` on the ``/sys/fs/cgroup/unified`` mount of a hybrid setup, when v1 is not usable.
* ``tag`` otherwise (no cgroup can be created, e.g. the service is not root): every rank's
  environment carries ``HORA_ATTEMPT=<instance>/<job>/<attempt>``, inherited by its
  descendants, and the attempt is every process whose environment carries it, and every
  descendant of one (a child started with another environment, or caught in the middle of
  ``exec``). A process that drops the tag and whose tagged ancestors have all ended escapes
  this fallback; a cgroup cannot be escaped.

``<instance>`` is derived from the data directory, so that two services on one machine never
share a cgroup and a restarted service finds its attempts again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
from hora.env import RankEnv

log = logging.getLogger(__name__)

CGROUP_FS = Path("/sys/fs/cgroup")
TAG_VAR = RankEnv.var("attempt")
FREEZE_WAIT_S = 2.0
KINDS = ("cgroup2", "cgroup1", "tag")
V1_LIMITS = ("memory", "cpu")  # v1 hierarchies an attempt also joins when writable


@dataclass(frozen=True)
class Container:
    """The processes of one attempt (see the module docstring).

    Attributes:
        kind: ``cgroup2``, ``cgroup1`` or ``tag``.
        tag: ``<instance>/<job>/<attempt>``, also the value of ``HORA_ATTEMPT`` in each rank.
        dirs: the cgroup directories a rank's command joins (none for ``tag``); for
            ``cgroup1`` the freezer's comes first.
    """

    kind: str
    tag: str
    dirs: tuple[Path, ...] = ()

    def create(self) -> None:
        """Create the cgroup directories (nothing for ``tag``)."""
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)

    def pids(self) -> set[int]:
        """Every live process of the attempt (zombies excluded)."""
        if self.kind == "tag":
            return _tagged(self.tag)
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(FileNotFoundError):
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return found

    def cpu_seconds(self) -> float:
        """CPU time its processes used: the cgroup's own count on v2, else theirs summed.

        The sum misses processes that have ended (unless a live one waited for them); it
        serves to see whether the attempt computes at all (session idle time).
        """
        if self.kind == "cgroup2" and self.dirs:
            with contextlib.suppress(FileNotFoundError, ValueError):
                for line in (self.dirs[0] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
        return cpu_seconds(self.pids())

    def kill(self) -> None:
        """SIGKILL every process of the attempt, forks in flight included where cgroups allow."""
        if self.kind == "tag":
            _kill_all(_tagged(self.tag))
        elif self.kind == "cgroup2" and (self.dirs[0] / "cgroup.kill").exists():
            _write(self.dirs[0] / "cgroup.kill", "1")
        elif self.dirs and self.dirs[0].is_dir():
            self._freeze(True)
            try:
                _kill_all(self.pids())
            finally:
                self._freeze(False)

    def clear(self, wait_s: float = 0.0) -> bool:
        """Kill what is left; True (and the cgroup removed) once no process is left.

        A killed process takes a moment to exit: ``wait_s`` bounds how long to wait for it
        (the monitor, which asks again on its next pass, waits not at all).
        """
        if self.pids():
            self.kill()
        deadline = time.monotonic() + wait_s
        while self.pids() or not self.remove():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def remove(self) -> bool:
        """Remove the cgroup directories; False while a process is still in one."""
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY:
                    return False
                raise
            with contextlib.suppress(OSError):  # the service's directory, once it is empty
                d.parent.rmdir()
        return True

    def _freeze(self, on: bool) -> None:
        d = self.dirs[0]
        if self.kind == "cgroup1":
            _write(d / "freezer.state", "FROZEN" if on else "THAWED")
            done = lambda: (d / "freezer.state").read_text().strip() == "FROZEN"  # noqa: E731
        else:
            _write(d / "cgroup.freeze", "1" if on else "0")
            done = lambda: "frozen 1" in (d / "cgroup.events").read_text()  # noqa: E731
        deadline = time.monotonic() + FREEZE_WAIT_S
        while on and not done() and time.monotonic() < deadline:
            time.sleep(0.01)  # a process in uninterruptible sleep delays the freeze


@dataclass(frozen=True)
class Containment:
    """A backend and where its cgroups live; builds the :class:`Container` of each attempt.

    Example:
        >>> Containment("tag", instance="ab12").container(7, 2)
        Container(kind='tag', tag='ab12/7/2', dirs=())
    """

    kind: str
    instance: str
    roots: tuple[Path, ...] = ()

    def container(self, job_id: int, attempt: int) -> Container:
        """The container of one attempt (not created yet)."""
        leaf = f"{int(job_id)}-{int(attempt)}"
        dirs = tuple(root / "hora" / self.instance / leaf for root in self.roots)
        return Container(self.kind, f"{self.instance}/{int(job_id)}/{int(attempt)}", dirs)


def instance_id(data_dir: Path) -> str:
    """A short stable name for one service's data directory.

    Example:
        >>> instance_id(Path("/var/lib/hora"))
        '52917616a735'
    """
    return hashlib.sha256(str(data_dir).encode()).hexdigest()[:12]


def detect(preference: str, data_dir: Path, fs: Path = CGROUP_FS) -> Containment:
    """The best usable backend, or the one asked for (see the module docstring).

    Args:
        preference: ``auto`` or one of :data:`KINDS`.
        data_dir: the service's data directory (names its instance).
        fs: where cgroup file systems are mounted.

    Raises:
        OSError: a cgroup backend was asked for by name and cannot be used here.
    """
    instance = instance_id(data_dir)
    pure_v2 = (fs / "cgroup.controllers").exists()
    order = [("cgroup2", [fs])] if pure_v2 else []
    order += [("cgroup1", [fs / "freezer", fs / "pids"]), ("cgroup2", [fs / "unified"])]
    for kind, roots in order:
        if preference in ("auto", kind) and _usable(roots):
            if kind == "cgroup1":  # resource limits (runtimes.limits), where mounted
                roots += [fs / c for c in V1_LIMITS if _usable([fs / c])]
            return Containment(kind, instance, tuple(roots))
    if preference not in ("auto", "tag"):
        raise OSError(f"containment {preference!r} is not usable here (no writable cgroup)")
    if preference == "auto":
        log.warning(
            "no writable cgroup hierarchy: attempts are tracked by their environment tag; a "
            "process that clears its environment can outlive its job"
        )
    return Containment("tag", instance)


def _usable(roots: list[Path]) -> bool:
    for root in roots:
        if not (root / "cgroup.procs").exists():
            return False
        try:
            (root / "hora").mkdir(exist_ok=True)
        except OSError:
            return False
        if not os.access(root / "hora", os.W_OK):
            return False
    return True


def cpu_seconds(pids: Iterable[int]) -> float:
    """User and system CPU seconds of ``pids`` and the children they waited for."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_cpu_seconds(pid: int) -> float | None:
    """:func:`cpu_seconds` of ``pid`` and all its descendants; None if it is gone."""
    try:
        top = psutil.Process(pid)
        return cpu_seconds([pid, *(p.pid for p in top.children(recursive=True))])
    except psutil.NoSuchProcess:
        return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def process_tags() -> dict[int, tuple[int, str | None]]:
    """Every live process but this one (zombies left out): its parent and its ``TAG_VAR``.

    The tag is None where the environment has none or cannot be read (another user's
    process, one in the middle of ``exec``).
    """
    me = os.getpid()
    out: dict[int, tuple[int, str | None]] = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.pid == me or proc.info["status"] in (None, psutil.STATUS_ZOMBIE):
            continue
        tag = None
        with contextlib.suppress(psutil.Error, OSError):
            tag = proc.environ().get(TAG_VAR)
        out[proc.pid] = (proc.info["ppid"], tag)
    return out


def _tagged(tag: str) -> set[int]:
    """The live processes whose environment carries ``tag``, and their descendants.

    A descendant is the attempt's whatever its environment says: a child started with
    another environment, or one in the middle of ``exec`` (whose environment cannot be read
    until the new program's arguments and environment are in place).
    """
    procs = process_tags()
    found = {pid for pid, (_, t) in procs.items() if t == tag}
    while more := {pid for pid, (up, _) in procs.items() if up in found and pid not in found}:
        found |= more
    return found
