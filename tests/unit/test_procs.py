"""The one failure vocabulary and process-group signaller (hora.procs), and who uses it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from hora.engines.errors import UNSEEN_EXIT, exit_status
from hora.launch import procs as launch_procs
from hora.procs import ended, exit_words, signal_group, signal_name
from hora_service.jobs.attempt import describe
from hora_service.runtimes import container_init
from hora_service.runtimes.base import Exit

CODES = [0, 1, 3, 127, 255, -1, -2, -6, -9, -11, -15, -64, -99]


@pytest.mark.parametrize("code", CODES)
def test_words_of_every_call_site_come_from_one_place(code: int) -> None:
    assert exit_status(code) == exit_words(code)
    assert describe(2, code) == f"rank 2 {ended(code)}"
    assert describe(2, code, "why") == f"rank 2 {ended(code)} (why)"
    if code < 0:
        name = signal_name(-code)
        assert ended(code) == f"was killed by {name}"
        assert exit_words(code).startswith(f"killed by {name}")
    else:
        assert (ended(code), exit_words(code)) == (f"exited with code {code}", f"exit code {code}")


def test_the_words_users_read() -> None:
    assert [exit_words(c) for c in (-9, -11, -6, -15, -99)] == [
        "killed by SIGKILL (out of memory?)", "killed by SIGSEGV (segmentation fault)",
        "killed by SIGABRT (abort)", "killed by SIGTERM", "killed by signal 99"]
    assert [describe(0, c) for c in (-9, -99, 3)] == [
        "rank 0 was killed by SIGKILL", "rank 0 was killed by signal 99",
        "rank 0 exited with code 3"]
    assert exit_status(None) == "still running"
    assert exit_status(UNSEEN_EXIT) == "gone; its exit status is in the session's events"
    assert describe(1, Exit.lost).startswith("rank 1 ended while the service was down")


def test_signal_group_reaches_the_group_and_ignores_a_gone_one() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        assert signal_group(proc.pid, 0)
        assert signal_group(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert not signal_group(proc.pid, signal.SIGKILL)  # reaped: its group is gone
    assert launch_procs.signal_group is signal_group


def _forward_via_container_init(pgid: int, sig: int) -> None:
    container_init._shims.clear()
    container_init._shims[pgid] = 0
    try:
        container_init._forward(sig, None)
    finally:
        container_init._shims.clear()
        container_init._pending.clear()


@pytest.mark.parametrize("error", [ProcessLookupError(errno.ESRCH, "gone"),
                                   PermissionError(errno.EPERM, "not ours"),
                                   OSError(errno.EINVAL, "bad signal"), None])
def test_container_inits_stdlib_copy_agrees(monkeypatch: pytest.MonkeyPatch,
                                            error: OSError | None) -> None:
    # container_init.py runs with ``python -I`` before hora is importable, so it keeps its own
    # killpg loop; it must swallow exactly what signal_group swallows
    sent: list[tuple[int, int]] = []

    def killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig))
        if error is not None:
            raise error

    monkeypatch.setattr(os, "killpg", killpg)
    calls: list[Callable[[int, int], object]] = [signal_group, _forward_via_container_init]
    outcomes = []
    for call in calls:
        try:
            call(4321, signal.SIGTERM)
            outcomes.append("ignored")
        except OSError as e:
            outcomes.append(type(e).__name__)
    assert outcomes[0] == outcomes[1]
    assert sent == [(4321, signal.SIGTERM)] * 2
