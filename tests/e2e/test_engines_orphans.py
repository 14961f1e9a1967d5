"""No process of a notebook's engines outlives what started it, even when killed outright.

The controller forks a process of its own (ipyparallel's heart monitor) into its process
group. When the kernel dies, the controller's watchdog takes that group down; but a controller
killed with SIGKILL runs no watchdog, and its fork lived on alone, reparented to init (CI saw
one after an e2e test that killed a kernel). Each fork now watches its parent in turn.
Real engines (kernel-local, in this process), real signals.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from hora.engines import Cluster, ClusterOptions

pytestmark = pytest.mark.timeout(120)


def test_the_controllers_fork_ends_when_the_controller_is_killed() -> None:
    cluster = Cluster(ClusterOptions(n=1, start_timeout_s=60))
    cluster.start()
    try:
        mine = psutil.Process().children(recursive=True)
        controller = next(p for p in mine if "controller" in p.cmdline()
                          and p.ppid() == os.getpid())  # fmt: skip
        forks = controller.children()
        assert forks, "the controller forked nothing: the premise of this test changed"
        os.kill(controller.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(forks, timeout=10)
        assert alive == [], f"the controller's forks outlived it: {alive}"
    finally:
        cluster.stop()
