"""Clearing an attempt's container waits, within a bound, for the processes it killed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
from hora_service.runtimes import strays
from hora_service.runtimes.containment import TAG_VAR, Containment


def _tagged_sleeper(tag: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, TAG_VAR: tag}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until its environment is readable
        try:
            if psutil.Process(proc.pid).environ().get(TAG_VAR) == tag:
                return proc
        except psutil.Error:
            pass
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the tagged process never showed its tag")


def _reaper(proc: subprocess.Popen[bytes]) -> threading.Thread:
    """Reap the child once killed, as its real parent (or init) would."""
    t = threading.Thread(target=proc.wait, daemon=True)
    t.start()
    return t


def test_clear_with_a_wait_reports_the_killed_process_gone() -> None:
    box = Containment("tag", instance=f"t{os.getpid()}").container(7, 1)
    proc = _tagged_sleeper(box.tag)
    reaper = _reaper(proc)
    try:
        assert box.clear(wait_s=10.0) is True
        reaper.join(10)
        assert proc.returncode == -9
        assert box.pids() == set()
    finally:
        proc.kill()


def test_clear_without_a_wait_never_blocks_and_the_next_call_finishes() -> None:
    box = Containment("tag", instance=f"u{os.getpid()}").container(7, 1)
    proc = _tagged_sleeper(box.tag)
    reaper = _reaper(proc)
    try:
        box.clear()  # may or may not see the process gone yet; it must not wait
        reaper.join(10)
        assert box.clear() is True
    finally:
        proc.kill()


def test_a_start_reaps_a_stray_in_one_pass() -> None:
    instance = f"v{os.getpid()}"
    contained = Containment("tag", instance=instance)
    proc = _tagged_sleeper(contained.container(9, 2).tag)
    reaper = _reaper(proc)
    try:
        assert strays.reap(contained, known=set(), tmp="/nonexistent-hora-tmp") == [(9, 2)]
        reaper.join(10)
        assert proc.returncode == -9
    finally:
        proc.kill()
