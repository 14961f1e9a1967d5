"""``hora run`` end to end: real ranks, exit codes, prefixed output, signals, no orphans, timeline.

Each test starts ``python -m hora.cli run ... -- python tests/dist/_launch_script.py MODE``;
the script's modes are plain Python except the ones that need torch (the ``--start-timeout``
and ``--timeline-filename`` tests). After the runs that stop ranks, the processes the ranks
reported (the ranks, their children, a child in a session of its own) must all be gone.

The last test runs the same script under Open MPI's ``mpirun`` and checks what hora.torch
detected from ``OMPI_COMM_WORLD_*`` (no MASTER_* variables: a file rendezvous).
tests/e2e/test_example_launchers.py trains the example under mpirun but checks accuracy only,
not the detected world.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).with_name("_launch_script.py")
RUN_TIMEOUT = 120


def _argv(np: int, *mode: str, flags: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "hora.cli", "run", "-np", str(np), *flags, "--",
        sys.executable, str(SCRIPT), *mode,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HORA_TIMEOUT")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(
    argv: list[str], cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    res = subprocess.run(
        argv, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=cwd
    )
    return res, time.monotonic() - t0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reported_pids(d: Path) -> list[int]:
    return [int(p) for f in sorted(d.glob("pids-*")) for p in f.read_text().split()]


def _assert_no_orphans(pids: list[int]) -> None:
    deadline = time.monotonic() + 5  # an exiting process may need a moment to vanish
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.05)
    left = [p for p in pids if not _gone(p)]
    for p in left:  # do not leave them behind even when the test fails
        psutil.Process(p).kill()
    assert not left, f"processes left running after hora run exited: {left}"


# -------------------------------------------------------------------- exit codes
@pytest.mark.parametrize(
    ("np", "codes", "delays", "expected"),
    [
        (2, "0,0", "0,0", 0),
        (2, "0,3", "0,1", 3),
        (2, "5,0", "1,2", 5),
        (3, "0,9,4", "30,30,1", 4),  # rank 2 fails first; ranks 0 and 1 are stopped
        (2, "kill,0", "1,30", 128 + signal.SIGKILL),
    ],
    ids=["all-succeed", "rank1-fails", "rank0-fails", "first-failure-wins", "rank-killed"],
)
def test_exit_code_is_the_first_nonzero_rank_code(
    np: int, codes: str, delays: str, expected: int
) -> None:
    res, elapsed = _run(_argv(np, "exit", codes, delays))
    assert res.returncode == expected, res.stderr
    assert elapsed < 25, "ranks still sleeping were not stopped when one failed"
    if expected:
        assert "hora run: rank" in res.stderr and f"exit code {expected}" in res.stderr
    # the failing rank's output got out before the launcher stopped everyone
    pairs = zip(codes.split(","), map(float, delays.split(",")), strict=True)
    first = min(((d, r) for r, (c, d) in enumerate(pairs) if c != "0"), default=(0, 0))[1]
    assert f"[{first}]<stdout>:hello from rank {first}" in res.stdout.splitlines()


def test_a_failure_names_only_the_ranks_still_running_as_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # rank 0's exit is handled while rank 1 has ended too, its exit not handled yet (both
    # ranks failed at once): "stopping" names rank 2 alone, the one still running
    from hora.launch.config import LaunchConfig
    from hora.launch.launcher import Supervisor, _Rank

    procs = [subprocess.Popen(argv, start_new_session=True)  # noqa: S603
             for argv in (["true"], ["true"], ["sleep", "30"])]
    for p in procs[:2]:
        while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:  # ended, not reaped
            time.sleep(0.01)
    sup = Supervisor(LaunchConfig(np=3, command=("true",)), [{}, {}, {}])
    sup._ranks = [_Rank(r, p) for r, p in enumerate(procs)]
    with caplog.at_level("ERROR", logger="hora.launch"):
        sup._record(0, 1)
    assert caplog.messages == ["rank 0 exited with code 1; stopping rank 2"]
    assert procs[2].wait(timeout=10) == -signal.SIGTERM
    for p in procs[:2]:
        p.wait()


def test_output_is_rank_prefixed_and_arguments_pass_through() -> None:
    args = ["--flag", "two words", "$(touch x)", "ünïcode"]
    res, _ = _run(_argv(2, "echo", *args))
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    for r in range(2):
        assert [ln for ln in out if ln.startswith(f"[{r}]<stdout>:arg:")] == [
            f"[{r}]<stdout>:arg:{a}" for a in args
        ]
        assert f"[{r}]<stdout>:no newline {r}" in out  # a partial last line is flushed too
    assert all(ln.startswith(("[0]<stdout>:", "[1]<stdout>:")) for ln in out)
    assert "<stdout>" not in res.stderr

    res, _ = _run(_argv(2, "exit", "0,0", "0,0"))
    err = res.stderr.splitlines()
    assert "[0]<stderr>:warn 0" in err and "[1]<stderr>:warn 1" in err
    assert "warn" not in res.stdout


# -------------------------------------------------------------- stopping, orphans
def test_failure_stops_every_rank_and_leaves_no_orphans(tmp_path: Path) -> None:
    res, elapsed = _run(_argv(2, "orphans", str(tmp_path), flags=["--grace-period", "1"]))
    assert res.returncode == 3, res.stderr
    assert elapsed < 20, "rank 0 ignores SIGTERM: SIGKILL must follow the 1 s grace period"
    pids = _reported_pids(tmp_path)
    assert len(pids) == 6  # 2 ranks x (rank, child in its group, child in its own session)
    _assert_no_orphans(pids)


def _signalled_run(
    d: Path, mode: str, signals: list[signal.Signals], grace: str
) -> tuple[int, str, float]:
    """Start hora run, wait until both ranks are ready, send ``signals`` 0.5 s apart.

    Returns:
        hora run's exit code, its stderr, and the seconds from the last signal to its exit.
    """
    proc = subprocess.Popen(
        _argv(2, mode, str(d), flags=["--grace-period", grace]), env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all(Path(d, f"ready-{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks never got ready"
            time.sleep(0.05)
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.5)
            proc.send_signal(sig)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_is_forwarded_to_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    code, err, _ = _signalled_run(tmp_path, "signals", [sig], grace="5")
    for r in range(2):
        assert Path(tmp_path, f"got-{r}-{sig.name}").exists(), f"rank {r} did not get {sig.name}"
    assert code == 128 + sig, err  # the ranks exited 0 after the signal
    assert f"received {sig.name}" in err
    _assert_no_orphans(_reported_pids(tmp_path))


def test_second_sigint_kills_ranks_that_ignore_the_first(tmp_path: Path) -> None:
    code, err, after = _signalled_run(
        tmp_path, "stubborn", [signal.SIGINT, signal.SIGINT], grace="60"
    )
    assert all(Path(tmp_path, f"got-{r}-SIGINT").exists() for r in range(2))
    assert after < 10, "the second SIGINT must not wait for the 60 s grace period"
    assert code == 128 + signal.SIGKILL, err  # the ranks' status: killed
    assert "again; killing all ranks" in err
    _assert_no_orphans(_reported_pids(tmp_path))


# --------------------------------------------------------- torch: start timeout, timeline
def test_start_timeout_names_the_rank_that_never_arrived() -> None:
    res, elapsed = _run(_argv(2, "late-init", flags=["--start-timeout", "3"]))
    assert res.returncode == 1, res.stderr
    assert elapsed < 40, "rank 0 must give up after 3 s and rank 1 be stopped"
    rank0 = "\n".join(ln for ln in res.stderr.splitlines() if ln.startswith("[0]<stderr>:"))
    assert "CollectiveTimeout" in rank0
    assert "init" in rank0 and "waiting for missing ranks: 1" in rank0


def test_timeline_is_one_chrome_trace_with_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    res, _ = _run(_argv(2, "collectives", flags=["--timeline-filename", "timeline.json"]), tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]  # parts merged
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {
        (e["pid"], e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {(0, "rank 0"), (1, "rank 1")}
    for e in spans:
        assert isinstance(e["ts"], float) and e["dur"] >= 0 and e["args"]["bytes"] >= 0
    for rank in (0, 1):

        def phases(tensor: str, rank: int = rank) -> dict[str, int]:
            return {
                e["name"]: e["args"]["bytes"]
                for e in spans
                if e["pid"] == rank and e["args"]["tensor"] == tensor
            }

        assert phases("grad.w") == {"QUEUED": 4000, "ALLREDUCE": 4000}
        assert phases("bcast.b") == {"QUEUED": 80, "BROADCAST": 80}
        assert phases("gather.g")["ALLGATHER"] == (1 + 2) * 4 * 4  # every rank's rows
        assert phases("weight") == {"MEMCPY_IN_FUSION_BUFFER": 64, "QUEUED": 64, "ALLREDUCE": 64}
        assert phases("bias")["ALLREDUCE"] == 8


def test_timeline_keeps_the_events_of_ranks_that_failed_or_were_stopped(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    res, _ = _run(_argv(2, "crash", flags=["--timeline-filename", str(path)]))
    assert res.returncode == 3, res.stderr
    events = json.loads(path.read_text())["traceEvents"]
    seen = {
        e["pid"] for e in events if e["ph"] == "X" and e["args"]["tensor"] == "grad.before_crash"
    }
    assert seen == {0, 1}, "every rank's events up to the failure are in the merged file"
    assert not list(tmp_path.glob("*.part"))


def test_openmpi_world_is_detected() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (apt install openmpi-bin; CI installs it)")
    env = {k: v for k, v in _env().items() if not k.startswith(("MASTER_", "LOCAL_", "OMPI_"))}
    # Open MPI refuses to run as root unless told so (CI and containers run as root)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none",
            sys.executable, str(SCRIPT), "world"]  # fmt: skip
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    worlds = sorted(
        (json.loads(ln.removeprefix("WORLD ")) for ln in res.stdout.splitlines()
         if ln.startswith("WORLD ")),
        key=lambda w: w["rank"],
    )  # fmt: skip
    assert worlds == [
        {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "cross_size": 1,
         "launcher": "openmpi", "sum": 3.0}
        for r in range(2)
    ]  # fmt: skip
