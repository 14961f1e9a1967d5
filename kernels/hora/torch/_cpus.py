"""How many CPUs the ranks of one host can run on at once (data plane, launch layer).

The shared-memory ring (:mod:`hora.torch._shm`) passes one barrier a chunk, and every member
must reach it. When the members outnumber the CPUs they may run on (three ranks on two cores,
a job whose cgroup caps it below its rank count), one of them is always waiting for a CPU, and
in some states of a host each barrier costs about a millisecond, however the wait is made. The
ring then takes bigger chunks, so fewer barriers (``bench/RESULTS.md`` section 17). What
limits the members:
their CPU affinity (``sched_getaffinity``, the union over the members) and the CPU cap of each
one's cgroup (cgroup v2's ``cpu.max`` or v1's CFS quota, on its own group and every group above
it; the lowest over the members).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"

CapReader = Callable[[Path], "float | None"]  # one group's cap, in CPUs (None: none)


def mine() -> tuple[list[int], float | None]:
    """This process's CPUs: the ones it may run on, and its cgroup's cap (None: no cap)."""
    return sorted(os.sched_getaffinity(0)), cgroup_cap()


def cgroup_cap(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> float | None:
    """The CPU time this process's cgroup and those above it allow, in CPUs.

    The lowest ``quota / period`` from the process's own group up to the root of its
    hierarchy: ``cpu.max`` on cgroup v2; ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` on
    v1's ``cpu`` controller (mounted at ``root/cpu,cpuacct`` or ``root/cpu``; an older Slurm
    or Docker host); both, the lowest, on a host with both. None where no group caps it or
    the files cannot be read.

    Example:
        >>> cap = cgroup_cap()
        >>> cap is None or cap > 0
        True
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    caps = [cap for top, rel, read in _hierarchies(lines, root) for cap in _walk(top, rel, read)]
    return min(caps) if caps else None


def _hierarchies(lines: list[str], root: str) -> Iterator[tuple[Path, str, CapReader]]:
    """(mount point, group path, reader) of the hierarchies ``/proc/self/cgroup`` names."""
    for line in lines:
        hid, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and not controllers:
            yield Path(root), rel, _v2_cap
        elif "cpu" in controllers.split(","):
            top = next((Path(root, name) for name in (controllers, "cpu,cpuacct", "cpu")
                        if Path(root, name).is_dir()), None)
            if top is not None:
                yield top, rel, _v1_cap


def _walk(top: Path, rel: str, read: CapReader) -> list[float]:
    """The caps ``read`` finds from group ``rel`` under ``top`` up to ``top`` (never above)."""
    top = Path(os.path.normpath(top))
    group = Path(os.path.normpath(os.path.join(top, rel.lstrip("/"))))
    if group != top and top not in group.parents:
        return []
    caps = []
    while True:
        cap = read(group)
        if cap is not None:
            caps.append(cap)
        if group == top:
            return caps
        group = group.parent


def _v2_cap(group: Path) -> float | None:
    try:
        quota, period = Path(group, "cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def _v1_cap(group: Path) -> float | None:
    try:
        quota = int(Path(group, "cpu.cfs_quota_us").read_text())
        period = int(Path(group, "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def at_once(rows: Iterable[tuple[list[int], float | None]]) -> int:
    """How many of the members can run at the same time, from each member's :func:`mine`.

    Example:
        >>> at_once([([0, 1], None), ([1], None), ([0, 1], 1.5)])
        2
        >>> at_once([(list(range(16)), 2.0), (list(range(16)), None)])
        2
    """
    cpus: set[int] = set()
    caps = []
    for affinity, cap in rows:
        cpus.update(affinity)
        if cap is not None:
            caps.append(math.ceil(cap))
    return max(1, min([len(cpus), *caps]))
