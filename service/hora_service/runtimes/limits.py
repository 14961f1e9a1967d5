"""Resource limits of one attempt: memory, processes, CPU (control plane).

Like Slurm's ``task/cgroup`` and Kubernetes' pod limits, every attempt runs inside bounds of
its own, so one job cannot take the machine from everyone:

* ``memory``: bytes the attempt's processes may hold together (page cache included); past
  it the kernel's OOM killer ends one of them.
* ``pids``: processes **and threads** the attempt may have at once; past it ``fork()`` and
  thread creation fail with ``EAGAIN`` in the job.
* ``cpus``: a hard cap on CPU time, in CPUs (``1.5``: one and a half cores' worth per
  scheduling period); none by default.
* a CPU **share** (always): under contention each attempt gets CPU time in proportion to the
  slots it holds (``cpu.shares`` = 1024 per slot on cgroup v1, ``cpu.weight`` = 100 per slot
  on v2, ``--cpu-shares`` in docker); an idle machine is never held back by it.

Each is a setting (``job_memory_limit``, ``job_pids_limit``, ``job_cpu_limit``) that a user
may override (``hora user set NAME --memory 8g --pids 4096 --cpus 4``). A value is ``auto``
(the attempt's share of the machine: the slots it holds over all slots, see
:func:`resolve`), ``none``, or a number (sizes take ``k``, ``m``, ``g``, ``t`` suffixes,
powers of 1024). The local runtime writes them into the attempt's cgroup
(:func:`apply_cgroup`); the docker runtime into the container's host config
(:func:`docker_limits`). When a rank fails, :func:`hits` reads the cgroup's event counters and
:func:`note` says which limit was hit, for the job's reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$")
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MEMORY_SHARE = 0.9  # of the machine's memory, split over its slots (the rest: service, OS)
PIDS_SHARE = 0.5  # of the machine's process table, split over its slots
PIDS_MIN, PIDS_MAX = 1024, 65536
MEMORY_MIN = 256 << 20
CFS_PERIOD_US = 100_000
KINDS = ("memory", "pids", "cpus")


class LimitError(ValueError):
    """A limit's value cannot be read; ``field`` names the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class JobLimits:
    """The limits of one attempt; None: unlimited.

    Attributes:
        memory_bytes: most bytes of memory the attempt's processes hold together.
        pids: most processes and threads at once.
        cpus: most CPUs' worth of time.
        slots: slots the attempt holds (its CPU share); None: the default share.
    """

    memory_bytes: int | None = None
    pids: int | None = None
    cpus: float | None = None
    slots: int | None = None

    def describe(self, kind: str) -> str:
        """The value of one limit in words (``2 GiB``, ``1000 processes``, ``1.5 CPUs``)."""
        if kind == "memory":
            return human_bytes(self.memory_bytes) if self.memory_bytes else "none"
        if kind == "pids":
            return f"{self.pids} processes and threads" if self.pids else "none"
        return f"{self.cpus:g} CPUs" if self.cpus else "none"


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it to one decimal.

    Example:
        >>> human_bytes(2 << 30), human_bytes(1536 << 20), human_bytes(1000)
        ('2 GiB', '1.5 GiB', '1000 bytes')
    """
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


def parse(kind: str, text: str) -> int | float | str | None:
    """One limit's value as written: ``auto``, None for ``none``, or the number.

    Raises:
        LimitError: not ``auto``, ``none`` or a positive number of the right kind.

    Example:
        >>> parse("memory", "2g"), parse("pids", "1000"), parse("cpus", "none")
        (2147483648, 1000, None)
    """
    value = text.strip().lower()
    if value in ("auto", "none"):
        return None if value == "none" else "auto"
    number: int | float = 0
    try:
        if kind == "memory":
            m = SIZE.match(value)
            number = int(float(m.group(1)) * UNITS[m.group(2)]) if m else 0
        elif kind == "pids":
            number = int(value)
        else:
            number = float(value)
    except ValueError:
        number = 0
    if not (0 < number < float("inf")):
        examples = {"memory": "8g, 512m", "pids": "4096", "cpus": "2, 0.5"}[kind]
        raise LimitError(kind, f"{text!r} is not a {kind} limit (auto, none, or e.g. {examples})")
    return number


@dataclass(frozen=True)
class Machine:
    """What ``auto`` limits are shares of.

    Attributes:
        memory_bytes: the machine's memory.
        cpus: its CPUs.
        pids: its process table (``pid_max``, or ``threads-max`` if smaller).
    """

    memory_bytes: int
    cpus: int
    pids: int

    @classmethod
    def here(cls) -> Machine:
        """This machine, from ``/proc``."""
        memory = 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
        pids = []
        for name in ("pid_max", "threads-max"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(Path(f"/proc/sys/kernel/{name}").read_text()))
        return cls(memory or 1 << 34, os.cpu_count() or 1, min(pids) if pids else 32768)


def resolve(
    values: dict[str, str], slots: int, total_slots: int, machine: Machine
) -> JobLimits:
    """The limits of an attempt holding ``slots`` of ``total_slots``.

    Args:
        values: ``memory``, ``pids`` and ``cpus`` as written (the user's, else the setting).
        slots: slots the attempt holds.
        total_slots: slots of the machine.
        machine: what ``auto`` shares.

    ``auto`` is the attempt's share (``slots / total_slots``) of 90 % of the memory (at least
    256 MiB), of every CPU (at least one), and of half the process table (between 1024 and
    65536).

    Raises:
        LimitError: a value cannot be read.

    Example:
        >>> machine = Machine(1 << 34, 8, 32768)
        >>> resolve({"memory": "2g", "pids": "none", "cpus": "auto"}, 1, 4, machine)
        JobLimits(memory_bytes=2147483648, pids=None, cpus=2.0, slots=1)
    """
    share = max(1, slots) / max(1, total_slots, slots)
    auto: dict[str, int | float] = {
        "memory": max(MEMORY_MIN, int(machine.memory_bytes * MEMORY_SHARE * share)),
        "pids": min(PIDS_MAX, max(PIDS_MIN, int(machine.pids * PIDS_SHARE * share))),
        "cpus": max(1.0, round(machine.cpus * share, 2)),
    }
    got: dict[str, Any] = {}
    for kind in KINDS:
        value = parse(kind, values.get(kind, "auto"))
        got[kind] = auto[kind] if value == "auto" else value
    return JobLimits(
        memory_bytes=got["memory"], pids=got["pids"], cpus=got["cpus"], slots=max(1, slots)
    )


# the local runtime: the attempt's cgroup ---------------------------------------------------


def cgroup_files(kind: str, limits: JobLimits) -> list[tuple[str, str, str]]:
    """``(controller, file, value)`` to write for ``limits`` on cgroup ``kind`` (pure).

    On cgroup v1 the controller names the hierarchy (``memory``, ``pids``, ``cpu``); on v2
    every file is in the one directory. Swap is limited to nothing beyond the memory limit.

    Example:
        >>> cgroup_files("cgroup2", JobLimits(pids=100))
        [('pids', 'pids.max', '100')]
    """
    out: list[tuple[str, str, str]] = []
    if limits.pids:
        out.append(("pids", "pids.max", str(limits.pids)))
    if limits.memory_bytes:
        mem = str(limits.memory_bytes)
        if kind == "cgroup2":
            out += [("memory", "memory.max", mem), ("memory", "memory.swap.max", "0")]
        else:
            out += [("memory", "memory.limit_in_bytes", mem),
                    ("memory", "memory.memsw.limit_in_bytes", mem)]  # fmt: skip
    if limits.slots:
        if kind == "cgroup2":
            out.append(("cpu", "cpu.weight", str(min(10_000, 100 * limits.slots))))
        else:
            out.append(("cpu", "cpu.shares", str(1024 * limits.slots)))
    if limits.cpus:
        quota = str(max(1000, int(limits.cpus * CFS_PERIOD_US)))
        if kind == "cgroup2":
            out.append(("cpu", "cpu.max", f"{quota} {CFS_PERIOD_US}"))
        else:
            out += [("cpu", "cpu.cfs_period_us", str(CFS_PERIOD_US)),
                    ("cpu", "cpu.cfs_quota_us", quota)]  # fmt: skip
    return out


def controller_dir(kind: str, dirs: tuple[Path, ...], controller: str) -> Path | None:
    """The directory of ``controller`` among an attempt's cgroup directories.

    On v1 each controller has its own hierarchy; on v2 the attempt has one directory.
    """
    if kind == "cgroup2":
        return dirs[0] if dirs else None
    for d in dirs:
        # .../<controller>/hora/<instance>/<leaf>
        if len(d.parts) > 3 and d.parts[-4] == controller:
            return d
    return None


def apply_cgroup(kind: str, dirs: tuple[Path, ...], limits: JobLimits) -> list[str]:
    """Write ``limits`` into an attempt's cgroup; return what could not be enforced.

    On v2 the controllers are first enabled in the ancestors' ``cgroup.subtree_control``
    (``hora`` and ``hora/<instance>`` hold no process, so they may delegate them).
    """
    missed: list[str] = []
    if kind == "cgroup2" and dirs:
        _delegate_v2(dirs[0])
    for controller, name, value in cgroup_files(kind, limits):
        where = controller_dir(kind, dirs, controller)
        path = where / name if where is not None else None
        if path is None or not path.exists():
            if name != "memory.memsw.limit_in_bytes":  # without swap accounting: no swap
                missed.append(f"{name} (no {controller} controller)")
            continue
        try:
            path.write_text(value)
        except OSError as e:
            missed.append(f"{name}: {e.strerror or e}")
    return missed


def _delegate_v2(leaf: Path) -> None:
    root = leaf.parents[2]  # <root>/hora/<instance>/<leaf>
    for d in (root, root / "hora", leaf.parent):
        control = d / "cgroup.subtree_control"
        have = set((d / "cgroup.controllers").read_text().split()) if d.exists() else set()
        for controller in ("memory", "pids", "cpu"):
            if controller in have:
                with contextlib.suppress(OSError):
                    control.write_text(f"+{controller}")


@dataclass(frozen=True)
class Hits:
    """How often an attempt ran into its limits (counters of the cgroup's events)."""

    oom_kills: int = 0
    pids_max: int = 0


def counter(path: Path, key: str) -> int:
    """The value of ``key`` in a cgroup file of ``key value`` lines (0 if it is not there)."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def hits(kind: str, dirs: tuple[Path, ...]) -> Hits:
    """What the attempt's cgroup counted: OOM kills and refused forks (zero where unknown)."""
    mem = controller_dir(kind, dirs, "memory")
    pids = controller_dir(kind, dirs, "pids")
    events = "memory.events" if kind == "cgroup2" else "memory.oom_control"
    return Hits(
        oom_kills=counter(mem / events, "oom_kill") if mem is not None else 0,
        pids_max=counter(pids / "pids.events", "max") if pids is not None else 0,
    )


def recorded_hits(path: Path) -> Hits:
    """What a docker container's init recorded of its cgroup's counters in ``path`` (JSON).

    Zero where it wrote nothing or what it wrote does not read.
    """
    try:
        raw = json.loads(path.read_text())
        return Hits(oom_kills=int(raw.get("oom_kills", 0)), pids_max=int(raw.get("pids_max", 0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return Hits()


def note(limits: JobLimits, found: Hits, killed: bool) -> tuple[str | None, str | None]:
    """What a failed job's reason says of the limits it hit.

    Returns:
        What replaces "was killed by SIGKILL" (a rank the OOM killer ended), and what is
        added in parentheses (other hits); None for either when there is nothing to say.

    Example:
        >>> note(JobLimits(memory_bytes=2 << 30), Hits(oom_kills=1), killed=True)
        ('was killed by the memory limit (2 GiB per attempt)', None)
    """
    killed_by = extra = None
    parts = []
    if found.oom_kills and limits.memory_bytes:
        memory = f"the memory limit ({human_bytes(limits.memory_bytes)} per attempt)"
        if killed:
            killed_by = f"was killed by {memory}"
        else:
            parts.append(f"{memory} killed {found.oom_kills} process(es) of the attempt")
    if found.pids_max and limits.pids:
        parts.append(
            f"the attempt reached its pids limit ({limits.pids} processes and threads per "
            f"attempt) {found.pids_max} time(s): fork or thread creation failed there"
        )
    if parts:
        extra = "; ".join(parts)
    return killed_by, extra


# the docker runtime: the container's host config -----------------------------------------


def docker_limits(limits: JobLimits | None) -> dict[str, Any]:
    """Keyword arguments of ``containers.create`` for ``limits`` (pure).

    Example:
        >>> docker_limits(JobLimits(memory_bytes=1 << 30, pids=100, cpus=1.5))["nano_cpus"]
        1500000000
    """
    if limits is None:
        return {}
    out: dict[str, Any] = {}
    if limits.memory_bytes:
        out["mem_limit"] = limits.memory_bytes
        out["memswap_limit"] = limits.memory_bytes  # no swap beyond the limit
    if limits.pids:
        out["pids_limit"] = limits.pids
    if limits.cpus:
        out["nano_cpus"] = int(limits.cpus * 1e9)
    if limits.slots:
        out["cpu_shares"] = 1024 * limits.slots
    return out


def tmp_mounts(size: int | None) -> dict[str, str]:
    """``containers.create``'s ``tmpfs``: ``/tmp`` and ``/var/tmp`` of ``size`` bytes each.

    The setting ``job_disk_limit``; None: none (the container's own layer, as before).

    Example:
        >>> tmp_mounts(1 << 20)["/tmp"]
        'rw,exec,nosuid,nodev,mode=1777,size=1048576'
    """
    opts = f"rw,exec,nosuid,nodev,mode=1777,size={size}"
    return {d: opts for d in ("/tmp", "/var/tmp")} if size else {}
