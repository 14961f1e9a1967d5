"""The magics in a real Jupyter kernel (jupyter_client): live streaming, interrupt, shutdown.

This is the faithful setting for what the notebook's stop button does (SIGINT to the kernel's
process group) and for the order in which output reaches the frontend over iopub.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _magics_util import alive, group_members, wait_gone
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(180)


class Kernel:
    """A kernel plus helpers that collect each request's iopub messages."""

    def __init__(self) -> None:
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=60)

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(
        self, msg_id: str, timeout: float = 90, on_msg: Any = None
    ) -> tuple[dict, list[dict]]:
        """Read iopub until the request is idle; return (reply content, iopub messages)."""
        msgs: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no idle within {timeout}s; got {[m['msg_type'] for m in msgs]}"
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            msgs.append(msg)
            if on_msg is not None:
                on_msg(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        while True:
            reply = self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"], msgs

    def run(self, code: str, timeout: float = 90) -> tuple[dict, str, list[dict]]:
        reply, msgs = self.collect(self.send(code), timeout)
        out = "".join(
            m["content"]["text"]
            for m in msgs
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )
        return reply, out, msgs

    def pids(self) -> list[int]:
        reply, out, _ = self.run("from hora import magics; print(magics._MAGICS.cluster.pids)")
        assert reply["status"] == "ok", reply
        return list(ast.literal_eval(out.strip()))

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def error_text(msgs: list[dict]) -> str:
    return "\n".join("\n".join(m["content"]["traceback"]) for m in msgs if m["msg_type"] == "error")


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    reply, _, msgs = k.run("%load_ext hora\n%dist_start -n 2 --timeout 20")
    assert reply["status"] == "ok", error_text(msgs)
    pids = k.pids()
    yield k
    k.close()
    assert wait_gone(pids) == [], "engines outlived the kernel's shutdown"


def test_stream_reaches_frontend_while_cell_runs(kernel, tmp_path):
    go: Path = tmp_path / "go"
    code = (
        f"%%distributed --all\nimport os, time\nprint('first', flush=True)\n"
        f"deadline = time.time() + 30\n"
        f"while not os.path.exists({str(go)!r}) and time.time() < deadline: time.sleep(0.05)\n"
        f"print('second' if os.path.exists({str(go)!r}) else 'not streamed', flush=True)"
    )

    def on_msg(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "first" in msg["content"]["text"]:
            go.touch()

    reply, msgs = kernel.collect(kernel.send(code), on_msg=on_msg)
    assert reply["status"] == "ok"
    text = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    for rank in (0, 1):
        assert text.index(f"[rank {rank}] first") < text.index(f"[rank {rank}] second")
    assert "not streamed" not in text


def test_failing_cell_is_an_error_reply(kernel):
    reply, _, msgs = kernel.run("%%distributed\nraise KeyError('k')")
    assert reply["status"] == "error"
    assert reply["ename"] == "CellFailedError"
    assert "also failed on rank 1 (same error)" in error_text(msgs)


def test_interrupt_reaches_every_rank_and_engines_stay_usable(kernel):
    # each rank reports the KeyboardInterrupt it got: the interrupt must reach all of them.
    # 'started' is printed inside the try: a flushing print returns only after the IO thread
    # sent its text, so the interrupt, sent once both lines arrived, can land inside it
    msg_id = kernel.send(
        "%%distributed --all\nimport time\n"
        "try:\n    print('started', flush=True)\n    time.sleep(120)\n"
        "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    raise"
    )
    started = time.monotonic()
    seen: set[str] = set()

    def on_msg(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            seen.update(line for line in msg["content"]["text"].splitlines() if "started" in line)
            if seen == {"[rank 0] started", "[rank 1] started"}:
                seen.add("sent")
                kernel.km.interrupt_kernel()

    reply, msgs = kernel.collect(msg_id, timeout=60, on_msg=on_msg)
    assert time.monotonic() - started < 60
    assert reply["status"] == "error"
    assert reply["ename"] == "EnginesInterrupted"
    # one line, no hora frames around it
    assert error_text(msgs) == "interrupted on ranks 0-1; engines usable, variables kept"
    text = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    assert "[rank 0] interrupted" in text and "[rank 1] interrupted" in text, text
    reply, out, _ = kernel.run(
        "%%distributed\nprint(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())"
    )
    assert reply["status"] == "ok" and out == "2.0\n"


def test_interrupt_releases_a_rank_blocked_in_a_collective(kernel):
    # rank 0 waits in an allreduce while rank 1 computes alone: the interrupt stops rank 1, and
    # rank 0 (deaf to SIGINT inside the collective) is released; the variables stay
    reply, _, msgs = kernel.run("%%distributed\nkept = 10 + hvd.rank()")
    assert reply["status"] == "ok", error_text(msgs)
    pids = kernel.pids()
    msg_id = kernel.send(
        "%%distributed --all\nimport time\nprint('started', flush=True)\n"
        "if hvd.rank() == 0:\n    hvd.allreduce(torch.ones(1))\nelse:\n    time.sleep(120)"
    )
    sent: list[bool] = []

    def on_msg(msg: dict) -> None:
        if msg["msg_type"] == "stream" and "[rank 1] started" in msg["content"]["text"]:
            if not sent:
                sent.append(True)
                time.sleep(0.5)  # let rank 0 reach the allreduce
                kernel.km.interrupt_kernel()

    reply, msgs = kernel.collect(msg_id, timeout=60, on_msg=on_msg)
    assert reply["ename"] == "EnginesInterrupted"
    assert error_text(msgs).splitlines() == [
        "interrupted on ranks 0-1",
        "rank 0 blocked in a collective: released",
        "process group rebuilt; engines usable, variables kept",
    ]
    assert kernel.pids() == pids
    reply, out, _ = kernel.run(
        "%%distributed --all\nprint(kept, hvd.allreduce(torch.ones(1), op=hvd.Sum).item())"
    )
    assert reply["status"] == "ok"
    assert sorted(out.splitlines()) == ["[rank 0] 10 2.0", "[rank 1] 11 2.0"]


def test_engine_traceback_shows_the_notebook_cell_number(kernel):
    reply, _, msgs = kernel.run("%%distributed\nx = 1\nraise KeyError('k')")
    text = re.sub(r"\x1b\[[0-9;]*m", "", error_text(msgs))
    assert f"Cell In[{reply['execution_count']}], line 2" in text, text


def test_interrupt_restarts_engines_that_ignore_it(kernel):
    old = kernel.pids()
    code = (
        "%%distributed --all\nimport signal, time\n"
        "if hvd.rank() == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "print('started', flush=True)\ntime.sleep(120)"
    )
    msg_id = kernel.send(code)
    sent, seen = [], set()

    def on_msg(msg: dict) -> None:
        # interrupt only once both ranks run the cell (an interrupt that reaches rank 0 before
        # its cell began is not the cell's) and rank 1 has ignored SIGINT (it prints after)
        if msg["msg_type"] == "stream":
            seen.update(r for r in (0, 1) if f"[rank {r}] started" in msg["content"]["text"])
            if seen == {0, 1} and not sent:
                sent.append(True)
                kernel.km.interrupt_kernel()

    reply, msgs = kernel.collect(msg_id, timeout=90, on_msg=on_msg)
    assert reply["status"] == "error"
    text = error_text(msgs)
    assert "rank 1 did not stop" in text and "restarted (their variables are lost)" in text
    assert wait_gone(old) == []
    reply, out, _ = kernel.run("%%distributed\nprint(hvd.size())")
    assert reply["status"] == "ok" and out == "2\n"


def test_killed_kernel_leaves_no_engines():
    k = Kernel()
    try:
        reply, _, msgs = k.run("%load_ext hora\n%dist_start -n 2")
        assert reply["status"] == "ok", error_text(msgs)
        pids = k.pids()
        reply, out, _ = k.run("print(magics._MAGICS.cluster.workdir)")
        workdir = Path(out.strip())
        assert len(alive(pids)) == 3 and workdir.is_dir()
        # the controller forks a heart monitor: every process in hora's groups must go
        members = group_members(pids)
        assert len(members) > len(pids)
        os.kill(k.km.provisioner.process.pid, signal.SIGKILL)
        assert wait_gone(members, timeout=15) == [], "engines outlived a killed kernel"
        assert group_members(pids) == []
        assert not workdir.exists()
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_kernel_restart_leaves_no_engines():
    # what the notebook's "Restart Kernel" does (jupyter_server: restart_kernel(now=False))
    k = Kernel()
    try:
        reply, _, msgs = k.run("%load_ext hora\n%dist_start -n 2")
        assert reply["status"] == "ok", error_text(msgs)
        members = group_members(k.pids())
        k.km.restart_kernel(now=False)
        k.kc.wait_for_ready(timeout=60)
        assert wait_gone(members, timeout=15) == [], "engines outlived the kernel restart"
        # the restarted kernel is a fresh one: no engines, and it can start new ones
        reply, _, msgs = k.run("%load_ext hora\n%distributed print(hvd.size())")
        assert reply["status"] == "ok", error_text(msgs)
        new = k.pids()
        assert not set(new) & set(members)
    finally:
        k.close()
    assert wait_gone(new) == []


def test_failing_distributed_cell_fails_nbclient_execution(tmp_path):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hora\n%dist_start -n 2"),
        nbformat.v4.new_code_cell("%%distributed\nprint('ok', hvd.rank())"),
        nbformat.v4.new_code_cell("%%distributed\nassert hvd.rank() == 0, 'boom'"),
        nbformat.v4.new_code_cell("print('never runs')"),
    ]
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    with pytest.raises(CellExecutionError) as exc:
        client.execute()
    assert exc.value.ename == "CellFailedError"
    assert "[rank 1] AssertionError: boom" in str(exc.value)
    assert nb.cells[1].outputs[0]["text"] == "ok 0\n"
    assert nb.cells[3].get("outputs", []) == []
