"""Find every process a test started, however deep, by a tag in its environment.

Jupyter servers start kernels, kernels start an ipyparallel controller and engines, and some of
these start new sessions, so a process-group or parent walk can miss them. Environments are
inherited instead: a test puts ``HORA_TEST_TAG=<uuid>`` into the environment of the first process
it starts, and any process still carrying that tag after shutdown is a leak.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from hora import net

TAG_VAR = "HORA_TEST_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def tagged_pids(tag: str) -> list[int]:
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        lines.append(f"{pid}: {cmd[:200]}")
    return "\n".join(lines)


def wait_gone(tag: str, timeout: float = 20.0) -> list[int]:
    """Wait until no process carries the tag; return those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = tagged_pids(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_tagged(tag: str) -> None:
    """SIGKILL what a failed test left behind (only processes carrying this test's tag)."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A free port below the ephemeral range (hora.net.free_port): no outgoing connection of
    another process takes it before the server binds it."""
    return net.free_port()
