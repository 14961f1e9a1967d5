"""Process-group and orphan helpers for the ``hora run`` supervisor (data plane, POSIX).

Every rank runs in its own session (``start_new_session=True``), so its process group id is
its pid and one ``killpg`` reaches the rank and every descendant that stayed in its group
(DataLoader workers, ``subprocess`` children). On Linux the supervisor can also become a
*child subreaper*: descendants whose parent died are re-parented to it instead of to init, so
even a grandchild that called ``setsid()`` can be found (``/proc/self/task/*/children``),
stopped and reaped.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from hora.procs import signal_group as signal_group  # the callers' procs.signal_group

log = logging.getLogger("hora.launch")

_PR_SET_CHILD_SUBREAPER = 36


def exit_code(returncode: int) -> int:
    """Map a ``Popen.returncode`` to a shell-style exit code (death by signal N -> 128 + N).

    Args:
        returncode: the value from ``Popen.returncode`` (negative for a signal).

    Returns:
        An exit code in 0..255.

    Example:
        >>> exit_code(-9)
        137
    """
    return 128 - returncode if returncode < 0 else returncode & 0xFF


def group_has_live_members(pgid: int) -> bool:
    """Return whether any non-zombie process is still in group ``pgid`` (Linux: via /proc).

    Args:
        pgid: the process group id.

    Returns:
        True while a running (or stopped) member remains. Zombies do not count: they hold no
        resources and their parent reaps them. Without /proc, falls back to ``killpg(pgid, 0)``.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return signal_group(pgid, 0)
    for entry in proc.iterdir():
        if entry.name.isdigit() and _stat_fields(int(entry.name))[1:] == ("live", pgid):
            return True
    return False


def running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` still runs: not waited for, and not a zombie (Linux: via /proc).

    A rank that has just ended is a zombie until its waiter thread reaps it; it is not
    running, although no one has handled its exit yet.
    """
    return proc.returncode is None and _stat_fields(proc.pid)[1] == "live"


def _stat_fields(pid: int) -> tuple[int, str, int]:
    """Return (ppid, "live"/"zombie"/"gone", pgid) of ``pid`` from /proc/PID/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return (0, "gone", -1)
    fields = raw[raw.rfind(")") + 2:].split()
    state = "zombie" if fields[0] in ("Z", "X") else "live"
    return (int(fields[1]), state, int(fields[2]))


def set_subreaper(on: bool) -> bool:
    """Make this process (not) adopt its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    Args:
        on: True to adopt orphans, False to stop.

    Returns:
        True when the setting took effect; False on other systems.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def child_pids() -> set[int]:
    """Return the pids of this process's children (Linux /proc; empty elsewhere)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").glob("*/children"):
        try:
            pids.update(int(p) for p in task.read_text().split())
        except OSError:
            continue
    return pids


def reap_adopted(exclude: set[int], rounds: int = 5) -> list[int]:
    """SIGKILL and reap children of ours not in ``exclude`` (orphans adopted as subreaper).

    Killing an adopted orphan re-parents its own children to us, so this repeats until no
    new child appears (at most ``rounds`` times).

    Args:
        exclude: pids not to touch (children that existed before the launch, and the ranks,
            which their ``Popen`` objects reap).
        rounds: how many times to look for newly adopted children.

    Returns:
        The pids that were still running and got killed.
    """
    killed: list[int] = []
    for _ in range(rounds):
        found = sorted(child_pids() - exclude)
        if not found:
            break
        for pid in found:
            if _stat_fields(pid)[1] == "live":
                killed.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    if killed:
        log.warning("stopped %d process(es) the ranks left running: %s", len(killed), killed)
    return killed
