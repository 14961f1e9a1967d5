"""A notebook's engines survive the death of one of them (real engines on CPU, gloo).

An engine killed between cells is replaced before the next cell: the survivors keep their
processes and variables, the process group is re-formed with the replacement, and the cell
runs on every rank. The module shares one cluster of three engines.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _magics_util import wait_gone
from hora.engines import State
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(120)

N = 3


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output():
        shell.run_line_magic("dist_start", f"-n {N} --timeout 20 --no-preflight")
    yield shell
    from hora import magics

    pids = magics._MAGICS.cluster.pids if magics._MAGICS and magics._MAGICS.cluster else []
    shell.run_line_magic("unload_ext", "hora")
    assert wait_gone(pids) == []


def cluster():
    from hora import magics

    return magics._MAGICS.cluster


def run(ip, cell: str):
    with capture_output() as cap:
        result = ip.run_cell(cell)
    return result, cap


def exited(proc, timeout: float = 15.0) -> int | None:
    """Wait for an engine process to be reaped (its threads may outlive its /proc zombie)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()


def pids() -> dict[int, int]:
    return {e.rank: e.pid for e in cluster().engines}


def test_engine_killed_between_cells_is_replaced_and_the_others_keep_their_variables(ip):
    result, cap = run(ip, "%%distributed\nmine = 100 + hvd.rank()")
    assert result.success, cap.stdout + cap.stderr
    old = pids()
    os.kill(old[1], signal.SIGKILL)
    assert exited(cluster().engines[1].proc) is not None
    result, cap = run(
        ip,
        "%%distributed --all\n"
        "print(globals().get('mine'), hvd.size(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item())",
    )
    assert result.success, cap.stdout + cap.stderr
    # the magic says which engine died and that it was replaced, before the cell's output
    assert f"hora: rank 1 (pid {old[1]}) died (killed by SIGKILL" in cap.stderr
    assert "engine replaced; variables lost on rank 1: mine; ranks 0, 2 kept theirs" in cap.stderr
    new = pids()
    assert new[0] == old[0] and new[2] == old[2] and new[1] != old[1]
    assert sorted(cap.stdout.splitlines()) == [
        "[rank 0] 100 3 3.0",
        "[rank 1] None 3 3.0",
        "[rank 2] 102 3 3.0",
    ]
    assert cluster().state is State.READY
    assert [r["alive"] for r in cluster().status()] == [True] * N
