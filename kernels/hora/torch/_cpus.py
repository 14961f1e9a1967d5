"""How many CPUs the ranks of one host can run on at once (data plane, launch layer).

The shared-memory ring (:mod:`hora.torch._shm`) passes one barrier a chunk, and every member
must reach it. When the members outnumber the CPUs they may run on (three ranks on two cores,
a job whose cgroup caps it below its rank count), one of them is always waiting for a CPU, and
in some states of a host each barrier costs about a millisecond, however the wait is made. The
ring then takes bigger chunks, so fewer barriers (``bench/RESULTS.md`` section 17). What
limits the members:
their CPU affinity (``sched_getaffinity``, the union over the members) and the CPU cap of each
one's cgroup (``cpu.max``, cgroup v2, on its own group and every group above it; the lowest
over the members).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def mine() -> tuple[list[int], float | None]:
    """This process's CPUs: the ones it may run on, and its cgroup's cap (None: no cap)."""
    return sorted(os.sched_getaffinity(0)), cgroup_cap()


def cgroup_cap(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> float | None:
    """The CPU time this process's cgroup (v2) and those above it allow, in CPUs.

    The lowest ``quota / period`` of ``cpu.max`` from the process's own group up to the root;
    None where no group caps it, on cgroup v1, or where the files cannot be read.

    Example:
        >>> cap = cgroup_cap()
        >>> cap is None or cap > 0
        True
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None
    caps = []
    top = Path(os.path.normpath(root))
    group = Path(os.path.normpath(os.path.join(top, rel.lstrip("/"))))
    if group != top and top not in group.parents:
        return None
    while True:
        try:
            quota, period = Path(group, "cpu.max").read_text().split()[:2]
            if quota != "max" and int(period) > 0:
                caps.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if group == top:
            break
        group = group.parent
    return min(caps) if caps else None


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
