"""The magics end to end in a real IPython shell driving real engines (CPU, gloo).

One cluster of 2 engines is shared by the whole module (starting engines is the slow part).
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _magics_util import group_members, wait_gone
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(120)


ENV_BEFORE: dict[str, str] = {}
START_OUTPUT: list[dict[str, str]] = []


@pytest.fixture(scope="module")
def ip():
    import os

    ENV_BEFORE.update(os.environ)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output() as cap:
        shell.run_line_magic("dist_start", "-n 2 --timeout 20")
    START_OUTPUT[:] = [o.data for o in cap.outputs]
    from hora import magics

    members = group_members(magics._MAGICS.cluster.pids)
    yield shell
    shell.run_line_magic("unload_ext", "hora")
    assert wait_gone(members) == []


def run(ip, cell: str):
    with capture_output() as cap:
        result = ip.run_cell(cell)
    return result, cap


def test_load_ext_registers_magics_without_heavy_imports():
    # a fresh interpreter: in this one torch may already be imported by other tests
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'hora')\n"
        "names = ['dist_start', 'distributed', 'dist_push', 'dist_pull', 'dist_status',\n"
        "         'dist_restart', 'dist_stop']\n"
        "cell = bool(ip.find_cell_magic('distributed'))\n"
        "print(all(ip.find_line_magic(n) for n in names), cell)\n"
        "print(sorted(m for m in ('torch', 'ipyparallel') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True True", "[]"]


def test_start_table_lists_rank_pid_device(ip):
    from hora import magics
    from hora.engines.cluster import EngineRow

    table = magics._MAGICS.cluster.table()
    assert [r["rank"] for r in table] == [0, 1]
    assert all(list(r) == list(EngineRow.__annotations__) for r in table)
    # each engine's init answer (bootstrap.EngineInfo) named its main thread and its host
    assert all(e.main_thread > 0 and e.local for e in magics._MAGICS.cluster.engines)
    assert all(r["device"] == "cpu" for r in table)
    # what %dist_start displayed: the table (a title, then one row per rank; text and HTML),
    # then the preflight's one line
    shown, preflight = START_OUTPUT
    assert preflight["text/plain"].startswith("preflight (2 ranks, ")
    lines = shown["text/plain"].splitlines()
    # the title says where the engines come from (kernel-local here, unless a service is set up)
    assert re.match(r"2 engines ready in [\d.]+s \(gloo\); (kernel-local|from the hora)", lines[0])
    cols = ["rank", "host", "pid", "device", "gpu", "engine_id"]
    assert lines[1].split() == cols
    for row, line in zip(table, lines[2:], strict=True):
        assert line.split() == [str(row[k]) for k in cols]
        assert f"<td>{row['pid']}</td>" in shown["text/html"]
    # the engine-id -> rank map is explicit: each engine's own RANK matches the map
    result, cap = run(ip, "%%distributed --all\nimport os; print(os.environ['RANK'], os.getpid())")
    assert result.success
    for row in table:
        assert f"[rank {row['rank']}] {row['rank']} {row['pid']}" in cap.stdout
        assert magics._MAGICS.cluster.rank_of(row["engine_id"]) == row["rank"]


def test_default_shows_rank0_only(ip):
    result, cap = run(ip, "%%distributed\nprint('hello from', hvd.rank(), 'of', hvd.size())")
    assert result.success
    assert cap.stdout == "hello from 0 of 2\n"


def test_all_prefixes_every_line(ip):
    result, cap = run(ip, "%%distributed --all\nprint('a'); print('b')")
    assert result.success
    lines = sorted(cap.stdout.splitlines())
    assert lines == ["[rank 0] a", "[rank 0] b", "[rank 1] a", "[rank 1] b"]


def test_all_keeps_each_rank_in_order_and_joins_partial_lines(ip):
    cell = (
        "%%distributed --all\nimport sys, time\n"
        "for i in range(8):\n"
        "    print('step', end=' ', flush=True)\n"
        "    time.sleep(0.01)\n"
        "    print(i, flush=True)\n"
        "print('warn', file=sys.stderr)"
    )
    result, cap = run(ip, cell)
    assert result.success
    for rank in (0, 1):
        mine = [x for x in cap.stdout.splitlines() if x.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] step {i}" for i in range(8)], cap.stdout
    assert sorted(cap.stderr.splitlines()) == ["[rank 0] warn", "[rank 1] warn"]


def test_rank_shows_only_that_rank(ip):
    result, cap = run(ip, "%%distributed --rank 1\nprint('me', hvd.rank())")
    assert result.success
    assert cap.stdout == "me 1\n"


def test_allreduce_and_out_gathers_by_rank(ip):
    result, _ = run(
        ip,
        "%%distributed --out total\n"
        "total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)",
    )
    assert result.success
    assert [t.item() for t in ip.user_ns["total"]] == [3.0, 3.0]


def test_line_form_runs_one_statement(ip):
    ip.run_line_magic("distributed", "line_value = hvd.rank() * 10")
    ip.run_line_magic("dist_pull", "line_value")
    assert ip.user_ns["line_value"] == [0, 10]


def test_last_value_and_rich_output_are_displayed(ip):
    cell = (
        "%%distributed\nfrom IPython.display import HTML, display\n"
        "display(HTML('<b>rank %d</b>' % hvd.rank()))\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3]); plt.show()\n'last'"
    )
    result, cap = run(ip, cell)
    assert result.success, result.error_in_exec
    kinds = [set(o.data) for o in cap.outputs]
    assert any("text/html" in k for k in kinds)
    assert any("image/png" in k for k in kinds)
    assert "<b>rank 0</b>" in cap.outputs[0].data["text/html"]
    assert cap.outputs[-1].data["text/plain"] == "'last'"


def test_display_updates_and_clear_output_are_forwarded(ip):
    cell = (
        "%%distributed\nfrom IPython.display import display, clear_output\n"
        "display('gone'); clear_output()\n"
        "h = display('v1', display_id='loss'); h.update('v2')"
    )
    with capture_output() as cap:
        result = ip.run_cell(cell)
    assert result.success
    outs = [(o.data["text/plain"], o.update, o.transient["display_id"]) for o in cap.outputs]
    # 'gone' was cleared; the update targets the same (rank-scoped) display id
    assert outs == [("'v1'", False, "rank0-loss"), ("'v2'", True, "rank0-loss")]


class _Recorder(io.StringIO):
    """stdout replacement that creates ``go`` once it has seen ``first``."""

    def __init__(self, go: Path) -> None:
        super().__init__()
        self.go = go

    def write(self, s: str) -> int:
        n = super().write(s)
        if "first" in self.getvalue():
            self.go.touch()
        return n


def test_output_streams_while_the_cell_runs(ip, tmp_path):
    # the cell only prints 'second' after the test saw 'first': that can happen only if
    # 'first' reached the notebook while the cell was still running
    go = tmp_path / "go"
    cell = (
        f"%%distributed\nimport os, time\nprint('first', flush=True)\n"
        f"deadline = time.time() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.time() < deadline: time.sleep(0.05)\n"
        f"print('second' if os.path.exists({str(go)!r}) else 'not streamed')"
    )
    rec = _Recorder(go)
    with contextlib.redirect_stdout(rec):
        result = ip.run_cell(cell)
    assert result.success
    assert rec.getvalue() == "first\nsecond\n"


def test_every_output_arrives_and_each_reply_counts_them(ip):
    # a rank is done at its reply once the outputs the reply announces came (not at IOPub's
    # idle, later): a cell with many outputs on every rank must lose none
    cell = (
        "%%distributed --all\nfrom IPython.display import display\n"
        "for i in range(40):\n    print('line', i, flush=True)\n"
        "    if i % 10 == 9: display({'text/plain': f'shown {i}'}, raw=True)\n'end'"
    )
    result, cap = run(ip, cell)
    assert result.success
    for rank in (0, 1):
        mine = [x for x in cap.stdout.splitlines() if x.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] line {i}" for i in range(40)]
    shown = [o.data["text/plain"] for o in cap.outputs]
    assert sorted(shown) == sorted([f"shown {i}" for i in (9, 19, 29, 39)] * 2 + ["'end'"] * 2)
    # the count an engine puts in its reply is the number of outputs it published
    import queue

    from hora import magics
    from hora.engines import _ipp, outputs

    cluster = magics._MAGICS.cluster
    got: queue.SimpleQueue = queue.SimpleQueue()
    seen: list[str] = []

    def hook(fut):
        fut.iopub_callbacks.append(lambda m: seen.append(m["header"]["msg_type"]))
        fut.output.add_done_callback(lambda _f: got.put(fut))  # idle: every output came

    code = "print(1, flush=True); print(2, flush=True); display('x'); 3"
    _ipp.send_cell(cluster.client, code, cluster.engines[0].ident, hook)
    reply = got.get(timeout=60).result(timeout=60)
    announced = outputs.expected(_ipp.reply_content(reply))
    assert announced == sum(kind in outputs.TYPES for kind in seen) >= 4, seen


def test_error_on_one_rank_shows_its_traceback(ip):
    result, cap = run(ip, "%%distributed\nif hvd.rank() == 1:\n    raise ValueError('only one')")
    assert not result.success
    from hora.engines import CellFailedError

    err = result.error_in_exec
    assert isinstance(err, CellFailedError)
    assert err.rank == 1 and err.others == []
    assert "[rank 1] ValueError: only one" in cap.stdout
    assert "Traceback" in cap.stdout
    assert "also failed" not in cap.stdout


def test_same_error_on_all_ranks_is_counted_not_repeated(ip):
    result, cap = run(ip, "%%distributed\n{}['missing']")
    assert not result.success
    assert cap.stdout.count("Traceback") == 1
    assert "also failed on rank 1 (same error)" in cap.stdout


def test_different_errors_are_summarised(ip):
    result, cap = run(ip, "%%distributed\nraise RuntimeError(f'r{hvd.rank()}')")
    assert not result.success
    assert "[rank 0] RuntimeError: r0" in cap.stdout
    assert "also failed on rank 1 (different errors: 1 (RuntimeError: r1))" in cap.stdout


def test_engines_usable_after_an_error(ip):
    run(ip, "%%distributed\n1/0")
    result, cap = run(ip, "%%distributed\nprint(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert result.success and cap.stdout == "2.0\n"


@pytest.mark.parametrize(
    ("value", "check"),
    [
        ("torch.arange(4.0)", lambda v: v.tolist() == [0.0, 1.0, 2.0, 3.0]),
        ("{'lr': 0.1, 'layers': [1, 2]}", lambda v: v == {"lr": 0.1, "layers": [1, 2]}),
        ("[torch.ones(2), 'x']", lambda v: v[0].tolist() == [1.0, 1.0] and v[1] == "x"),
    ],
)
def test_push_then_pull_roundtrip(ip, value, check):
    ip.run_cell(f"import torch\npushed = {value}")
    ip.run_line_magic("dist_push", "pushed")
    ip.run_line_magic("distributed", "pulled = pushed")
    ip.run_line_magic("dist_pull", "pulled")
    values = ip.user_ns["pulled"]
    assert len(values) == 2 and all(check(v) for v in values)
    ip.run_line_magic("dist_pull", "pulled --rank 1")
    assert check(ip.user_ns["pulled"])


def test_push_to_one_rank(ip):
    from hora.engines import CellFailedError

    assert ip.run_cell("import torch\nonly_one = torch.tensor([5.0])").success
    ip.run_line_magic("dist_push", "only_one --rank 1")
    ip.run_line_magic("dist_pull", "only_one --rank 1")
    assert ip.user_ns["only_one"].tolist() == [5.0]
    with pytest.raises(CellFailedError, match="only_one"):
        ip.run_line_magic("dist_pull", "only_one --rank 0")
    with pytest.raises(UsageError, match="outside 0..1"):
        ip.run_line_magic("dist_push", "only_one --rank 2")


def test_pulled_tensors_come_back_on_cpu_from_engine_device(ip):
    run(ip, "%%distributed\nt = torch.full((2,), float(hvd.rank()))")
    ip.run_line_magic("dist_pull", "t")
    assert [v.device.type for v in ip.user_ns["t"]] == ["cpu", "cpu"]
    assert [v.tolist() for v in ip.user_ns["t"]] == [[0.0, 0.0], [1.0, 1.0]]


def test_pull_of_missing_name_names_it(ip):
    from hora.engines import CellFailedError

    with pytest.raises(CellFailedError, match="nope"):
        ip.run_line_magic("dist_pull", "nope")


def test_push_of_undefined_name_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="undefined_thing"):
        ip.run_line_magic("dist_push", "undefined_thing")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--all --rank 1", "either --all or --rank"),
        ("--rank 5", "outside 0..1"),
        ("-n 3", "asks for -n 3"),
        ("--timeout 0", "must be > 0"),
        ("--out 'x;y'", "not a Python variable name"),
    ],
)
def test_bad_cell_arguments_are_refused(ip, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("distributed", line, "print(1)")


def test_status_reports_liveness_and_memory(ip):
    with capture_output() as cap:
        ip.run_line_magic("dist_status", "")
    text = cap.outputs[0].data["text/plain"]
    assert text.startswith("cluster ready")
    from hora import magics

    rows = magics._MAGICS.cluster.status()
    assert [r["alive"] for r in rows] == [True, True]
    assert all(r["rss_mb"] > 10 for r in rows)
    assert all(str(r["pid"]) in text for r in rows)


def test_second_start_is_refused_while_running(ip):
    with capture_output() as cap:
        ip.run_line_magic("dist_start", "-n 2")
    assert "already running" in cap.stderr


def test_kernel_environment_is_never_changed(ip):
    import os

    # the suite itself sets these for each test (tests/conftest.py gives each its lease dir)
    per_test = ("PYTEST_CURRENT_TEST", "HORA_LEASE_DIR")
    now = {k: v for k, v in os.environ.items() if k not in per_test}
    assert now == {k: v for k, v in ENV_BEFORE.items() if k not in per_test}
