"""Clearing an attempt's container waits, within a bound, for the processes it killed."""

from __future__ import annotations

import contextlib
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


def test_a_child_without_the_tag_is_found_and_killed_through_its_parent() -> None:
    """A child started with another environment (or caught in exec, when its environment
    cannot be read yet) carries no tag; it is the attempt's as its tagged parent's child."""
    box = Containment("tag", instance=f"w{os.getpid()}").container(7, 1)
    code = "import subprocess as s, time; s.Popen(['/bin/sleep', '300'], env={}); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, TAG_VAR: box.tag})
    reaper = _reaper(proc)
    kids: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 10
        while not (kids := psutil.Process(proc.pid).children()) or kids[0].cmdline() != [
            "/bin/sleep", "300"
        ]:  # until the child runs sleep: its environment is then the one it keeps
            assert time.monotonic() < deadline, "the child never ran sleep"
            time.sleep(0.02)
        assert TAG_VAR not in kids[0].environ()
        assert box.pids() == {proc.pid, kids[0].pid}
        assert box.clear(wait_s=10.0) is True
        reaper.join(10)
        assert proc.returncode == -9
        assert not kids[0].is_running() or kids[0].status() == psutil.STATUS_ZOMBIE
    finally:
        proc.kill()
        for kid in kids:
            with contextlib.suppress(psutil.Error):
                kid.kill()
