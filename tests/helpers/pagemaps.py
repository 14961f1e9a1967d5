"""What the kernel says about one address of this process's memory (/proc/self/smaps).

Used by the tests of hora.torch._pages in the test process and inside rank processes, which
load this file by path (the ``helpers`` package is not importable there).
"""

from __future__ import annotations

from typing import Any

HUGE = 2 << 20


def mapping_at(addr: int) -> dict[str, str]:
    """The smaps entry (``VmFlags``, ``AnonHugePages``, ...) of the mapping holding ``addr``."""
    found: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                if found is not None:
                    return found
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = {} if lo <= addr < hi else None
            elif found is not None:
                key, _, value = line.partition(":")
                found[key] = value.strip()
    if found is None:
        raise LookupError(f"no mapping holds {addr:#x}")
    return found


def inside(t: Any) -> int:
    """The first 2 MiB boundary inside tensor ``t``'s memory."""
    return (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)


def advised(t: Any) -> bool:
    """Whether huge pages were asked for (``madvise(MADV_HUGEPAGE)``) inside ``t``'s memory."""
    return "hg" in mapping_at(inside(t)).get("VmFlags", "").split()


def huge_kb(t: Any) -> int:
    """The kB of huge pages backing the mapping inside ``t``'s memory."""
    return int(mapping_at(inside(t)).get("AnonHugePages", "0 kB").split()[0])
