"""The local runtime with real processes: the rank shim's pid and exit files, re-adoption
by a new manager, and recovery of an attempt the service left half started."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hora import net
from hora.spec import JobSpec, JobState
from hora_service.manager import JobManager
from hora_service.runtimes import AttemptPlan, Exit, RankProcess
from hora_service.runtimes.core import read_pid, write_pid
from hora_service.runtimes.local import AdoptedRank, LocalRuntime
from hora_service.runtimes.paths import JobPaths
from hora_service.settings import Settings

PY = sys.executable
pytestmark = pytest.mark.timeout(120)


def plan(tmp_path: Path, command: list[str], workers: int = 1) -> AttemptPlan:
    return AttemptPlan(
        job_id=1, attempt=1, spec=JobSpec(command=command, workers=workers),
        slots=tuple(range(workers)), slot_kind="cpu", run_dir=tmp_path / "run", workdir=tmp_path,
        master_port=net.free_port(),
    )  # fmt: skip


def wait_done(rank: RankProcess, timeout: float = 30) -> int | Exit:
    deadline = time.monotonic() + timeout
    while (status := rank.poll()) is Exit.running:
        assert time.monotonic() < deadline, "rank did not finish"
        time.sleep(0.02)
    return status


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import sys; print('out'); sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
        ("print('fine')", 0),
    ],
)
def test_shim_records_exit_status(tmp_path: Path, code: str, expected: int) -> None:
    p = plan(tmp_path, [PY, "-c", code])
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    assert wait_done(rank) == expected
    assert (p.run_dir / "rank0.exit").read_text().strip() == str(expected)
    assert read_pid(p.paths, 0) == rank.proc.pid  # type: ignore[attr-defined]


def test_missing_program_is_127_with_a_message(tmp_path: Path) -> None:
    p = plan(tmp_path, ["no-such-program-hora", "x"])
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    assert wait_done(rank) == 127
    assert "cannot start 'no-such-program-hora'" in p.paths.log(0).read_text()


def test_adopted_rank_follows_a_process_it_did_not_start(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
    p = plan(tmp_path, [PY, "-c", code], workers=2)
    started = LocalRuntime().start(p, dict(os.environ))
    try:
        deadline = time.monotonic() + 20
        while not all(read_pid(p.paths, r) for r in (0, 1)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        adopted = LocalRuntime().adopt(p)
        assert [r.poll() for r in adopted] == [Exit.running, Exit.running]
    finally:
        gate.touch()  # the ranks end, whatever failed above
    assert [wait_done(r) for r in started] == [0, 0]
    assert [r.poll() for r in adopted] == [0, 0]  # read from the exit files


def test_a_rank_caught_in_exec_is_running(tmp_path: Path) -> None:
    """Popen returns before the kernel has put the new program's arguments in place (an
    empty ``/proc/PID/cmdline``): a rank polled in that window is running, not lost."""
    p = plan(tmp_path, [PY, "-c", "pass"])
    p.run_dir.mkdir()
    argv = [PY, "-I", "-S", "-c", "import time; time.sleep(30)", str(p.run_dir)]
    for _ in range(20):  # each start is one chance to look inside the window
        rank = AdoptedRank(0, p.paths)
        proc = subprocess.Popen(argv)
        try:
            rank.pid = proc.pid  # as if read from its pid file: poll at once, in the window
            assert rank.poll() is Exit.running
        finally:
            proc.kill()
            proc.wait()


def test_a_kernel_thread_with_the_ranks_pid_is_not_the_rank(tmp_path: Path) -> None:
    """A kernel thread has no arguments either, but it is not young: the rank is lost."""
    kthreads = [  # kthreadd (pid 2, parent 0) and its children: no command line
        q.pid for q in psutil.process_iter(["ppid", "cmdline"])
        if q.pid > 1 and q.info["ppid"] in (0, 2) and not q.info["cmdline"]
    ]  # fmt: skip
    assert kthreads, "no kernel thread visible (they are, outside a pid namespace)"
    p = plan(tmp_path, [PY, "-c", "pass"])
    p.run_dir.mkdir()
    write_pid(p.paths, 0, kthreads[0])
    assert psutil.Process(kthreads[0]).cmdline() == []
    assert AdoptedRank(0, p.paths).poll() is Exit.lost


def test_rank_with_no_pid_file_is_waited_for_then_lost(tmp_path: Path) -> None:
    p = plan(tmp_path, [PY, "-c", "pass"])
    p.run_dir.mkdir()
    (rank,) = LocalRuntime().adopt(p)
    assert rank.poll() is Exit.running  # the old service may have just forked it
    late = AdoptedRank(0, p.paths, wait_s=0)
    assert late.poll() is Exit.lost


def test_signal_to_a_rank_not_yet_seen_is_delivered_when_it_appears(tmp_path: Path) -> None:
    p = plan(tmp_path, [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    p.run_dir.mkdir()
    (adopted,) = LocalRuntime().adopt(p)
    adopted.signal(signal.SIGTERM)  # nothing to signal yet: owed
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    deadline = time.monotonic() + 20
    while "up" not in p.paths.log(0).read_text():  # the shim started the command
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.01)
    # this poll finds the pid file and delivers the owed SIGTERM; on a busy machine the rank
    # may already have ended, and recorded its exit, before the poll looks at it again
    assert adopted.poll() in (Exit.running, -signal.SIGTERM)
    assert wait_done(rank) == -signal.SIGTERM  # only the owed signal can have ended it


def test_adopted_rank_that_vanished_is_lost(tmp_path: Path) -> None:
    p = plan(tmp_path, [PY, "-c", "import time; time.sleep(60)"])
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    deadline = time.monotonic() + 20
    while read_pid(p.paths, 0) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (adopted,) = LocalRuntime().adopt(p)
    rank.signal(signal.SIGKILL)  # shim and command die together: nobody records an exit
    wait_done(rank)
    assert adopted.poll() is Exit.lost


def test_crash_while_starting_is_failed_then_retried(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2,
        retry_backoff_s=0, kill_grace_s=2,
    )  # fmt: skip
    first = JobManager(settings)
    first.open_store()
    sleep = JobSpec(command=[PY, "-c", "import time; time.sleep(60)"], max_retries=1)
    job = first.submit("ann", sleep)
    first.tick()
    assert first.get(job.id).state == JobState.running  # type: ignore[union-attr]
    store = first.open_store()
    with store.tx() as conn:  # as if the service died between "starting" and "running"
        store.update_job(conn, job.id, state=JobState.starting)
    first.close_store()  # the first service is gone; its rank lives on
    second = JobManager(settings)
    second.open_store()
    second.recovery.recover()  # what start() does before its loop
    deadline = time.monotonic() + 30
    while second.get(job.id).attempt < 2:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, second.get(job.id)
        second.tick()
        time.sleep(0.05)
    done = second.get(job.id)
    assert done is not None and done.state == JobState.running and done.attempt == 2
    assert "retrying" in [t.state for t in done.transitions]
    why = "the service stopped while the job was starting"
    assert any(t.reason == why for t in done.transitions)
    old = read_pid(JobPaths.of(settings.logs_dir, job.id, 1), 0)
    assert old is not None
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie"
    second.shutdown_jobs()
    assert second.get(job.id).state == JobState.cancelled  # type: ignore[union-attr]
    second.close_store()


def test_shim_ignores_the_jobs_pythonpath(tmp_path: Path) -> None:
    # modules the shim imports, shadowed where the job's PYTHONPATH points: had the shim
    # loaded them, the job would have recorded its own exit code
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    forge = "import os, sys\nopen(sys.argv[1] + '/rank0.exit', 'w').write('0')\nos._exit(0)\n"
    for name in ("subprocess", "select", "json"):
        (shadow / f"{name}.py").write_text(forge)
    code = "import sys; sys.exit(3)"
    p = plan(tmp_path, [PY, "-I", "-c", code])
    p = dataclasses.replace(
        p, spec=JobSpec(command=p.spec.command, env={"PYTHONPATH": str(shadow)})
    )
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    assert wait_done(rank) == 3
    assert (p.run_dir / "rank0.exit").read_text().strip() == "3"


def test_log_past_its_limit_keeps_the_tail_after_a_marker(tmp_path: Path) -> None:
    code = "for i in range(20000): print(f'line {i:06d}', flush=i % 1000 == 0)\nprint('END')"
    p = dataclasses.replace(plan(tmp_path, [PY, "-c", code]), log_bytes=1 << 16)
    (rank,) = LocalRuntime().start(p, dict(os.environ))
    assert wait_done(rank) == 0
    text = p.paths.log(0).read_bytes()
    assert 0 < len(text) <= 1 << 16  # 20000 lines are 240 kB
    assert text.startswith(b"\n[hora: log truncated here") and text.endswith(b"line 019999\nEND\n")
    assert b"line 000000" not in text
