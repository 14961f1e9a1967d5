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
from hora.engines import ClusterState, RankDiedError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(120)

N = 3


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output():
        shell.run_line_magic("dist_start", f"-n {N} --timeout 30 --no-preflight")
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
    assert cluster().state is ClusterState.READY
    assert [r["alive"] for r in cluster().status()] == [True] * N


def test_push_and_pull_after_a_death_reach_every_rank(ip):
    old = pids()
    os.kill(old[2], signal.SIGKILL)
    assert exited(cluster().engines[2].proc) is not None
    with capture_output() as cap:
        ip.user_ns["lr"] = 0.5
        ip.run_line_magic("dist_push", "lr")
        ip.run_line_magic("dist_pull", "lr")
    assert f"hora: rank 2 (pid {old[2]}) died (killed by SIGKILL" in cap.stderr
    assert ip.user_ns["lr"] == [0.5] * N
    assert pids()[0] == old[0] and pids()[2] != old[2]


KILL = "import os, signal\n    doomed = lambda: os.kill(os.getpid(), signal.SIGKILL)"

ELASTIC_CELL = """%%distributed --all
import os
torch.manual_seed(1234 + hvd.rank())  # a new engine's model starts different: sync fixes it
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = hvd.elastic.TorchState(model, opt, step=0)

@hvd.elastic.run
def train(state):
    while state.step < 40:
        if state.step == 10 and callable(globals().get("doomed")):
            doomed()
        grad = hvd.allreduce(torch.ones(1), op=hvd.Sum)
        with torch.no_grad():
            model.weight.add_(0.01 * grad)
        state.step += 1
        state.commit()

train(state)
weights = hvd.allgather_object(round(model.weight.sum().item(), 4))
print(os.getpid(), hvd.size(), state.step, weights[0], len(set(weights)), globals().get("mine"))
"""


def expected_weight() -> float:
    """Rank 0's first weights plus 40 steps of 4 x 0.01 x 3: no step lost, none done twice."""
    import torch

    torch.manual_seed(1234)
    return round(torch.nn.Linear(4, 1).weight.sum().item() + 40 * 4 * 0.01 * 3, 4)


def test_engine_killed_in_elastic_run_is_replaced_and_training_carries_on(ip):
    cell = f"%%distributed\nmine = 100 + hvd.rank()\nif hvd.rank() == 2:\n    {KILL}"
    result, cap = run(ip, cell)
    assert result.success, cap.stdout + cap.stderr
    old = pids()
    result, cap = run(ip, ELASTIC_CELL)
    assert result.success, cap.stdout + cap.stderr
    new = pids()
    assert new[0] == old[0] and new[1] == old[1] and new[2] != old[2]
    assert f"hora: rank 2 (pid {old[2]}) died during the cell (killed by SIGKILL" in cap.stderr
    assert "took its place and ran the cell from its start" in cap.stderr
    # every rank finished at the same step with the same weights (the new engine took them
    # from rank 0), those of a run without the failure; the survivors kept their variables
    # and processes, the new engine has none
    w = expected_weight()
    assert sorted(cap.stdout.splitlines()) == [
        f"[rank 0] {old[0]} 3 40 {w} 1 100",
        f"[rank 1] {old[1]} 3 40 {w} 1 101",
        f"[rank 2] {new[2]} 3 40 {w} 1 None",
    ]
    result, cap = run(ip, "%%distributed\nprint(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert result.success and cap.stdout == "3.0\n", cap.stdout + cap.stderr


def test_rank_0_killed_in_elastic_run_ends_the_cell_and_is_replaced_after_it(ip):
    # rank 0 syncs the others: its new engine has no state to give, so the cell stops
    result, cap = run(ip, f"%%distributed\ndoomed = None\nif hvd.rank() == 0:\n    {KILL}")
    assert result.success, cap.stdout + cap.stderr
    old = pids()
    result, cap = run(ip, ELASTIC_CELL)
    err = result.error_in_exec
    assert isinstance(err, RankDiedError), cap.stdout + cap.stderr
    assert list(err.dead) == [0]
    assert sorted(e.rank for e in err.errors) == [1, 2]
    assert {e.ename for e in err.errors} == {"RootLostError"}
    assert "engine replaced" in cap.stdout and "ranks 1-2 kept theirs" in cap.stdout
    new = pids()
    assert new[1] == old[1] and new[2] == old[2] and new[0] != old[0]
    result, cap = run(ip, "%%distributed\nprint(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert result.success and cap.stdout == "3.0\n", cap.stdout + cap.stderr


RAISE = """%%distributed
doomed = None
if hvd.rank() == 1:
    def doomed():
        global doomed
        doomed = None  # once
        raise hvd.elastic.HorovodInternalError("rank 1 lost a collective")
"""


def test_failed_collective_in_elastic_run_re_forms_the_same_engines(ip):
    # nobody died: every rank goes back to the last commit and they meet again
    result, cap = run(ip, RAISE)
    assert result.success, cap.stdout + cap.stderr
    old = pids()
    result, cap = run(ip, ELASTIC_CELL)
    assert result.success, cap.stdout + cap.stderr
    assert pids() == old
    w = expected_weight()
    assert [line.split()[3:7] for line in sorted(cap.stdout.splitlines())] == [
        ["3", "40", str(w), "1"]
    ] * N


def test_fresh_engines_after_a_restart_are_replaced_in_elastic_run_too(ip):
    cluster().restart()  # the same cluster object (as after a rank that did not stop)
    cell = f"%%distributed\ndoomed = None\nif hvd.rank() == 1:\n    {KILL}"
    result, cap = run(ip, cell)
    assert result.success, cap.stdout + cap.stderr
    old = pids()
    result, cap = run(ip, ELASTIC_CELL)
    assert result.success, cap.stdout + cap.stderr
    assert f"hora: rank 1 (pid {old[1]}) died during the cell" in cap.stderr
    assert pids()[0] == old[0] and pids()[1] != old[1]
