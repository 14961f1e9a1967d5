"""Dying, stalling and crashing ranks, restart and stop, on real engines (CPU, gloo).

The module shares one cluster; tests that break it restart it (that is part of what they test).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from _magics_util import alive, children_of, group_members, wait_gone
from hora.engines import (
    CellFailedError,
    Cluster,
    ClusterBrokenError,
    ClusterNotRunningError,
    ClusterOptions,
    ClusterState,
    CudaInitializedError,
    EngineStartError,
    RankDiedError,
    StallError,
)
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output():
        shell.run_line_magic("dist_start", "-n 2 --timeout 15")
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


def restart(ip) -> None:
    with capture_output() as cap:
        ip.run_line_magic("dist_restart", "")
    assert "2 engines ready" in cap.outputs[0].data["text/plain"]


@pytest.mark.parametrize(
    ("kill", "status"),
    [
        ("os._exit(3)", "exit code 3"),
        ("os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ],
)
def test_rank_death_is_reported_and_only_the_dead_engine_is_replaced(ip, kill, status):
    result, cap = run(ip, "%%distributed\nmine = 100 + hvd.rank()")
    assert result.success, cap.stdout
    old = {e.rank: e.pid for e in cluster().engines}
    cell = (
        "%%distributed\nimport os, signal\n"
        f"if hvd.rank() == 1:\n    {kill}\n"
        "hvd.allreduce(torch.ones(1))"
    )
    result, cap = run(ip, cell)
    err = result.error_in_exec
    assert isinstance(err, RankDiedError), cap.stdout
    assert err.rank == 1 and list(err.dead) == [1]
    assert f"rank 1 died ({status}" in cap.stdout
    # the cell says which variables were lost on which rank, and that the others kept theirs
    assert "engine replaced; variables lost on rank 1: mine, os, signal; rank 0 kept theirs" in (
        cap.stdout
    )
    # rank 0 was not left hanging in the allreduce: it failed and the cell returned
    assert [e.rank for e in err.errors] == [0]
    assert wait_gone([old[1]]) == []
    new = {e.rank: e.pid for e in cluster().engines}
    assert new[0] == old[0] and new[1] != old[1]
    assert cluster().state is ClusterState.READY
    assert [r["alive"] for r in cluster().status()] == [True, True]
    result, cap = run(
        ip,
        "%%distributed --all\n"
        "print('mine' in dir(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item())",
    )
    assert result.success, cap.stdout
    assert sorted(cap.stdout.splitlines()) == ["[rank 0] True 2.0", "[rank 1] False 2.0"]


def test_rank_left_running_after_a_death_is_named(ip):
    # rank 0 is not in a collective, so nothing makes it fail: the cell still returns (after
    # a short grace period), and the report says rank 0 was still running
    cell = "%%distributed\nimport os, time\nif hvd.rank() == 1:\n    os._exit(5)\ntime.sleep(90)"
    result, cap = run(ip, cell)
    err = result.error_in_exec
    assert isinstance(err, RankDiedError), cap.stdout
    assert err.dead == {1: 5} and err.running == [0]
    assert "rank 1 died (exit code 5)" in cap.stdout
    assert "rank 0 still running the cell" in cap.stdout
    assert "Not using CurveZMQ" not in cap.stdout  # engine start-up noise is not "last output"
    # a rank still inside the cell cannot be reached: the cluster is broken, work is refused
    # (instead of hanging) until %dist_restart
    with capture_output() as st:
        ip.run_line_magic("dist_status", "")
    assert st.outputs[0].data["text/plain"].startswith("cluster broken (rank 1 died")
    result, cap = run(ip, "%%distributed\nprint(1)")
    assert isinstance(result.error_in_exec, ClusterBrokenError)
    assert "%dist_restart" in cap.stdout
    old = cluster().pids
    restart(ip)
    assert wait_gone(old) == []
    result, cap = run(ip, "%%distributed\nprint(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert result.success and cap.stdout == "2.0\n"


def test_segfault_stack_lands_in_the_report(ip):
    result, cap = run(
        ip, "%%distributed\nimport ctypes\nif hvd.rank() == 0:\n    ctypes.string_at(0)"
    )
    assert isinstance(result.error_in_exec, RankDiedError)
    assert "rank 0 died (killed by SIGSEGV" in cap.stdout
    assert "Fatal Python error: Segmentation fault" in cap.stdout
    assert "engine replaced" in cap.stdout


def test_stall_names_missing_rank_and_shows_its_stack(ip):
    cell = (
        "%%distributed --timeout 2\n"
        "def stuck_here():\n    hvd.allreduce(torch.ones(1))\n"
        "if hvd.rank() == 1:\n    stuck_here()"
    )
    result, cap = run(ip, cell)
    err = result.error_in_exec
    assert isinstance(err, StallError), cap.stdout
    assert err.missing_ranks == [1] and err.finished == [0]
    assert "ranks 1 still running 2s after ranks 0 finished" in cap.stdout
    assert "--- rank 1 is here" in cap.stdout
    assert "in stuck_here" in err.stacks[1] and "allreduce" in err.stacks[1]
    # the blocked rank was released and the process group rebuilt: no restart needed
    assert "process group rebuilt; engines usable, variables kept" in cap.stdout
    assert cluster().state is ClusterState.READY


@pytest.mark.parametrize(
    "collective", ["hvd.allreduce(torch.ones(1))", "torch.distributed.all_reduce(torch.ones(1))"]
)
def test_a_stall_is_reported_before_the_collective_s_own_timeout(ip, collective):
    # no cell --timeout: the engines' collectives time out after %dist_start's --timeout (15 s
    # here), and the stall, which names the rank and shows its stack, must come first
    result, cap = run(ip, f"%%distributed\nif hvd.rank() == 0:\n    {collective}")
    err = result.error_in_exec
    assert isinstance(err, StallError), cap.stdout
    assert err.missing_ranks == [0] and err.finished == [1]
    assert "--- rank 0 is here" in cap.stdout and "all" in err.stacks[0]
    assert "Timed out" not in cap.stdout and "CollectiveTimeout" not in cap.stdout
    assert cluster().state is ClusterState.READY


def test_rank_computing_alone_past_the_timeout_is_not_a_stall(ip):
    # rank 0 works alone (no collective) longer than --timeout: that is not a stall
    cell = (
        "%%distributed --timeout 1\nimport time\n"
        "if hvd.rank() == 0:\n    time.sleep(3)\nprint('done')"
    )
    result, cap = run(ip, cell)
    assert result.success, cap.stdout
    assert cap.stdout == "done\n"
    assert cluster().state is ClusterState.READY


def test_stall_in_a_collective_shows_the_collective(ip):
    result, cap = run(
        ip, "%%distributed --timeout 2\nif hvd.rank() == 0:\n    hvd.allreduce(torch.ones(1))"
    )
    err = result.error_in_exec
    assert isinstance(err, StallError)
    assert err.missing_ranks == [0]
    assert "allreduce" in err.stacks[0]


SETUP = (
    "%%distributed\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(2, 1)\n"
    "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),"
    " named_parameters=model.named_parameters())\n"
    "w = model.weight.detach().clone()\ndata = torch.full((4, 2), float(hvd.rank()))"
)
# the next cell: every variable is there, the optimizer and collectives work again
AFTER = (
    "%%distributed --all\n"
    "same = bool(torch.equal(model.weight, w))\n"
    "opt.zero_grad(); model(data).sum().backward(); opt.step()\n"
    "print(type(model).__name__, same, hvd.allreduce(torch.ones(1), op=hvd.Sum).item())"
)


@pytest.mark.parametrize(
    ("cell", "error"),
    [
        # a stall: rank 0 waits in an allreduce that rank 1 never enters
        (
            "%%distributed --timeout 3\nif hvd.rank() == 0:\n    hvd.allreduce(torch.ones(1))",
            StallError,
        ),
        # rank 1 fails before the allreduce rank 0 is waiting in
        (
            "%%distributed\nif hvd.rank() == 1:\n    raise ValueError('bad batch')\n"
            "hvd.allreduce(torch.ones(1))",
            CellFailedError,
        ),
        # the ranks pass different shapes to one allreduce: it fails on every rank
        ("%%distributed\nhvd.allreduce(torch.ones(1 + hvd.rank()))", CellFailedError),
    ],
    ids=["stall", "rank-error-mid-allreduce", "collective-failed"],
)
def test_engines_keep_their_variables_after_a_broken_collective(ip, cell, error):
    result, cap = run(ip, SETUP)
    assert result.success, cap.stdout
    pids = cluster().pids
    result, cap = run(ip, cell)
    assert isinstance(result.error_in_exec, error), cap.stdout
    assert cluster().state is ClusterState.READY
    assert cluster().pids == pids  # the same engine processes
    result, cap = run(ip, AFTER)
    assert result.success, cap.stdout
    assert sorted(cap.stdout.splitlines()) == [
        "[rank 0] Linear True 2.0",
        "[rank 1] Linear True 2.0",
    ]


def test_rank_error_mid_allreduce_is_shown_first_and_short(ip):
    ip.execution_count = 42  # the notebook's number of the cell, not the engine's count
    result, cap = run(
        ip,
        "%%distributed\nif hvd.rank() == 1:\n    raise ValueError('bad batch')\n"
        "hvd.allreduce(torch.ones(1))",
    )
    err = result.error_in_exec
    assert isinstance(err, CellFailedError)
    assert err.rank == 1 and err.released == [0]
    text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)  # IPython colours tracebacks
    assert text.startswith("[rank 1] ValueError: bad batch")
    assert "Cell In[42], line 2" in text
    assert "rank 0 blocked in a collective: released" in text
    assert text.rstrip().endswith("process group rebuilt; engines usable, variables kept")
    assert "[rank 0]" not in text  # the released rank's traceback is counted, not shown


def test_stop_leaves_no_process_and_then_work_is_refused(ip):
    pids = cluster().pids
    assert len(alive(pids)) == 3  # controller + 2 engines
    members = group_members(pids)  # and what they forked (the controller's heart monitor)
    ip.run_line_magic("dist_stop", "")
    assert wait_gone(members, timeout=5) == []
    with pytest.raises(ClusterNotRunningError):
        ip.run_line_magic("dist_status", "")
    # %%distributed starts a cluster when none runs
    result, cap = run(ip, "%%distributed -n 2\nprint(hvd.size())")
    assert result.success and "2 engines ready" in cap.outputs[0].data["text/plain"]
    assert cap.stdout == "2\n"


def test_cuda_initialised_in_kernel_is_refused():
    # A CUDA context cannot be created on this CPU-only machine, so the check gets a fake
    # predicate; the real one reads torch.cuda.is_initialized() without importing torch.
    c = Cluster(ClusterOptions(n=2), cuda_check=lambda: True)
    with pytest.raises(CudaInitializedError, match="restart the kernel and run %dist_start"):
        c.start()
    assert c.state is ClusterState.STOPPED and c.pids == []


def test_api_run_returns_every_rank_output():
    c = Cluster(ClusterOptions(n=2, timeout_s=15))
    c.start()
    try:
        res = c.run("print(hvd.rank())")
        assert res.stdout == {0: "0\n", 1: "1\n"}
        with pytest.raises(CellFailedError) as exc:
            c.run("assert hvd.rank() == 0, 'not zero'")
        assert exc.value.rank == 1
        c.push({"k": 7}, ranks=[1])
        assert c.pull("k", ranks=[1]) == [7]
    finally:
        pids = c.pids
        c.stop()
    assert wait_gone(pids, timeout=5) == []


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="needs a machine where NCCL cannot initialise"
)
def test_init_failure_names_the_rank_and_leaves_no_process():
    before = set(children_of(os.getpid()))
    c = Cluster(ClusterOptions(n=2, backend="nccl", timeout_s=10))
    with pytest.raises(EngineStartError) as exc:
        c.start()
    assert re.search(r"hora.torch.init\(\) failed on rank [01]: .*nccl", str(exc.value))
    assert "Traceback" in str(exc.value)
    assert c.state is ClusterState.STOPPED
    assert wait_gone(set(children_of(os.getpid())) - before, timeout=5) == []


def test_start_timeout_is_reported_and_leaves_no_process():
    before = set(children_of(os.getpid()))
    c = Cluster(ClusterOptions(n=2, start_timeout_s=0.2))
    with pytest.raises(EngineStartError, match=r"timed out after 0.2s .*raise --start-timeout"):
        c.start()
    assert wait_gone(set(children_of(os.getpid())) - before, timeout=5) == []


def test_tracebacks_and_stacks_name_the_notebook_cells(ip):
    # the engines count their own cells; the report uses the numbers the notebook shows
    ip.execution_count = 30
    assert run(ip, "%%distributed\ndef step():\n    raise KeyError('deep')")[0].success
    ip.execution_count = 31
    result, cap = run(ip, "%%distributed\nstep()")
    assert isinstance(result.error_in_exec, CellFailedError)
    text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)
    assert "Cell In[31], line 1" in text and "Cell In[30], line 2" in text, text
    ip.execution_count = 32
    assert run(ip, "%%distributed\ndef wait_here():\n    hvd.allreduce(torch.ones(1))")[0].success
    ip.execution_count = 33
    result, cap = run(ip, "%%distributed --timeout 2\nif hvd.rank() == 1:\n    wait_here()")
    err = result.error_in_exec
    assert isinstance(err, StallError), cap.stdout
    assert "Cell In[32], line 2 in wait_here" in err.stacks[1], err.stacks[1]
    assert "Cell In[33], line 2 in <module>" in err.stacks[1]


def test_hora_frames_are_hidden_from_engine_tracebacks(ip):
    result, cap = run(ip, "%%distributed\nhvd.allreduce(torch.ones(1 + hvd.rank()))")
    assert isinstance(result.error_in_exec, CellFailedError)
    text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)
    assert "hvd.allreduce(torch.ones(1 + hvd.rank()))" in text  # the user's own line
    assert "frames inside hora hidden" in text
    assert "hora/torch/" not in text and "_handles.py" not in text
    assert "also failed on rank 1 (same error)" in text


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_the_controller_listens_only_below_the_ephemeral_range(ip):
    """Every port the controller and its heart monitor listen on was chosen by hora below the
    OS's ephemeral range: ipyparallel's own choice (a port the OS picked, closed, and bound
    a second later by the forked heart monitor) could be taken meanwhile by any outgoing
    connection on the machine, leaving engines that register but never hear a heartbeat."""
    import psutil

    controller = psutil.Process(cluster().launcher._controller.pid)
    procs = [controller, *controller.children(recursive=True)]
    listening = {
        c.laddr.port
        for p in procs
        for c in p.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert len(procs) >= 2 and len(listening) >= 18, (procs, listening)  # hub + heart monitor
    assert max(listening) < _ephemeral_low(), sorted(listening)


def test_a_heart_monitor_that_cannot_bind_ends_the_start_at_once_and_says_why(monkeypatch):
    """The forked heart monitor binds its ports last; when one is taken, the controller
    ends, and the start says so with the monitor's error, instead of engines that register,
    never hear a heartbeat, and give up after their own 50 missed beats."""
    import socket

    from hora.engines import launchers

    hold = launchers.hold_ports(18)
    ping = hold.ports[5]  # the sixth port the controller binds is its heart monitor's ping
    taken = socket.socket()  # a process that ignores hora's placeholder (SO_REUSEADDR) and
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # listens there first
    taken.bind(("127.0.0.1", ping))
    taken.listen()
    monkeypatch.setattr(launchers, "hold_ports", lambda n, *a, **k: hold)
    before = set(children_of(os.getpid()))
    c = Cluster(ClusterOptions(n=2, start_timeout_s=60))
    try:
        with pytest.raises(EngineStartError) as exc:
            c.start()
    finally:
        taken.close()
    text = str(exc.value)
    assert text.startswith("the controller exited"), text
    assert f"Address already in use (addr='tcp://127.0.0.1:{ping}')" in text, text
    assert "the controller's heart monitor failed" in text, text
    assert wait_gone(set(children_of(os.getpid())) - before, timeout=5) == []


_BIND_EACH = """
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
"""


def _bindable_elsewhere(ports):
    """The ``ports`` another process can bind as :func:`hora.net.free_port` probes them."""
    out = subprocess.run(
        [sys.executable, "-c", _BIND_EACH, *map(str, ports)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return sorted(map(int, out.split()))


def _my_sockets():
    """The inodes of this process's open TCP sockets (not the Unix sockets that claim a drawn
    port for five minutes: hora.net._claim)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:"):
                with socket.socket(fileno=os.dup(int(fd))) as s:
                    if s.family in (socket.AF_INET, socket.AF_INET6):
                        found.add(link)
        except OSError:  # the directory's own fd, gone by now
            continue
    return found


def test_the_controllers_ports_are_held_from_the_draw_until_it_listens(monkeypatch):
    """From hora's draw until the controller binds them (its heart monitor a second or more
    later), the ports are held: another process's draw (a second notebook, the service, a
    test beside this one) cannot get them, as one did in CI once (a heart monitor's port
    taken, the controller ended). Once the cluster has started, nothing holds them."""
    from hora.engines import launchers

    held = []
    real = launchers.hold_ports

    def spy(n, *a, **k):
        before = _my_sockets()
        hold = real(n, *a, **k)
        held.extend(_my_sockets() - before)
        assert len(held) == n == len(hold.ports)
        assert _bindable_elsewhere(hold.ports) == [], "a held port was free to another process"
        return hold

    monkeypatch.setattr(launchers, "hold_ports", spy)
    c = Cluster(ClusterOptions(n=2, timeout_s=15))
    c.start()
    try:
        assert held and not _my_sockets() & set(held), "the placeholders outlived the start"
        assert c.run("print(hvd.size())").stdout == {0: "2\n", 1: "2\n"}
    finally:
        c.stop()
