"""A forked process that holds a machine-wide lease until it is killed (tests of hora.leases)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from hora.leases import Lease, LeaseDir


class Holder:
    """Fork a process that takes the lease ``name`` (or keeps the inherited ``fd``) and waits.

    ``took`` says whether it got the lease; :meth:`kill` is a SIGKILL, no clean-up.
    """

    def __init__(
        self,
        leases: LeaseDir,
        name: str,
        claims: dict[str, object] | None = None,
        fd: int | None = None,
    ) -> None:
        ready_r, ready_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: take, say so, wait to be killed
            try:
                _close_all_but(ready_w, fd)  # it holds nothing of its parent's but ``fd``
                held = None if fd is not None else leases.take(name, claims or {"kind": "kernel"})
                ok = fd is not None or isinstance(held, Lease)  # held: kept until killed
                os.write(ready_w, b"1" if ok else b"0")
                while True:
                    time.sleep(60)
            finally:
                os._exit(0)
        os.close(ready_w)
        self.took = os.read(ready_r, 1) == b"1"
        os.close(ready_r)

    def kill(self) -> None:
        """SIGKILL, then reap (harmless once gone)."""
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


def _close_all_but(*keep: int | None) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
