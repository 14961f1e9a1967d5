"""Shared helpers of the magics e2e tests (real engines on CPU/gloo)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def alive(pids: Iterable[int]) -> list[int]:
    """Return the pids that still exist and are not zombies."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def wait_gone(pids: Iterable[int], timeout: float = 15.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the timeout."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def children_of(pid: int) -> list[int]:
    """Return the pids whose parent is ``pid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(name))
    return out


def group_members(pgids: Iterable[int]) -> list[int]:
    """Return live pids whose process group is one of ``pgids`` (hora's processes lead groups)."""
    wanted = set(pgids)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in wanted:
            out.append(int(name))
    return out
