"""Nothing of an ended attempt outlives it, not even when the service is gone (issue 25).

A real ``hora serve`` as root (a multi-user one with two fresh OS accounts, the fixtures of
:mod:`test_service_isolation`, and a shared-mode one): jobs whose ranks wait for a gate file.
What an attempt makes besides its ranks must go with it: the namespace holder of a job with
its own network (``nsholder.py``, seen still running 12 minutes after its job had ended and
the service had stopped), its cgroup directories, and the private temporary directory
(``hora-tmp-*``) of an attempt without its own ``/tmp``. The service is stopped (SIGTERM:
running jobs keep running) or killed with -9 while the attempt runs; the attempt then ends
with no service to see it; the holder must be gone by then, and the next start of the
service must reap the rest. Needs root.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import test_service_isolation as iso
from helpers.service_server import ServiceServer, wait_state
from hora_service.runtimes import containment, scratch

pytestmark = pytest.mark.timeout(300)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures

GATED = """\
import os, pathlib, sys, tempfile, time
work = pathlib.Path(sys.argv[1])
pathlib.Path(tempfile.gettempdir(), "scratch-file").write_bytes(b"x" * 4096)
(work / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while not (work / "gate").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _tagged(tag: str) -> list[tuple[int, str]]:
    """Processes whose environment carries the attempt's tag: (pid, command line)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(containment.TAG_VAR) == tag:
                found.append((proc.pid, " ".join(proc.info["cmdline"] or [])))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _cgroups(instance: str, job: int) -> list[Path]:
    """The attempt's cgroup directories (v2, or under each v1 controller).

    Not ``Path.glob("**/...")``: that walks every cgroup on the machine and raises when one
    goes while it walks (another test's attempt ending); ``glob.glob`` skips what vanished.
    """
    found = glob.glob(f"/sys/fs/cgroup/*/hora/{instance}/{job}-*")
    found += glob.glob(f"/sys/fs/cgroup/hora/{instance}/{job}-*")
    return sorted(Path(p) for p in found)


def _scratch(instance: str, job: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"hora-tmp-{instance}-{job}-*"))


def _ranks_end(work: Path, ranks: int, timeout: float = 60) -> None:
    """Open the gate and wait until every rank process has exited."""
    pids = [int((work / f"rank{r}.pid").read_text()) for r in range(ranks)]
    (work / "gate").write_text("go")
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "the ranks did not end"
        time.sleep(0.1)


def _started(srv: ServiceServer, user: str, work: Path, ranks: int) -> int:
    with srv.client(user) as c:
        body = {"command": [iso.JOB_PY, str(work / "gated.py"), str(work)], "workers": ranks}
        job = iso.submit(c, **body)
        deadline = time.monotonic() + 90
        while not all((work / f"rank{r}.pid").exists() for r in range(ranks)):
            state = c.get(f"/v1/jobs/{job}").json()
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
    return job


def _gone(what: list[object], name: str) -> None:
    assert not what, f"{name} left: {what}"


@pytest.fixture
def work(base: Path) -> Iterator[Path]:
    where = iso.work_dir(base)
    (where / "gated.py").write_text(GATED)
    yield where


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_private_attempt_leaves_nothing_when_the_service_is_gone(
    base: Path, accounts: dict[str, int], work: Path, how: str
) -> None:
    """Multi-user, with the attempt's own network and /tmp: its holder never outlives its
    ranks, service or not; its cgroups go at the next start."""
    ann = next(iter(accounts))
    srv = iso.serve(base, accounts, HORA_JOB_PRIVATE_NETWORK="true")
    instance = containment.instance_id(srv.data_dir)
    with srv:
        job = _started(srv, ann, work, 2)
        tag = f"{instance}/{job}/1"
        srv.stop() if how == "stop" else srv.crash()  # running jobs keep running
        _ranks_end(work, 2)
        _gone(_tagged(tag), "processes of the attempt")  # the holder with them
        srv.restart()
        with srv.client(ann) as c:
            assert wait_state(c, job, ("succeeded",), timeout=60)["state"] == "succeeded"
        deadline = time.monotonic() + 30
        while _cgroups(instance, job) and time.monotonic() < deadline:
            time.sleep(0.1)
        _gone(_cgroups(instance, job), "cgroup directories")


def test_a_dead_services_leftovers_are_reaped_at_the_next_start(
    root: None, tmp_path: Path
) -> None:
    """Shared mode (cgroups, and a private TMPDIR per attempt): kill -9 while two attempts
    run, they end meanwhile; the next start finds them ended and removes what they left."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "gated.py").write_text(GATED)
    env = {"HORA_JOB_ENV_PASSTHROUGH": "PYTHONPATH,OMP_NUM_THREADS,PYTHONUNBUFFERED"}
    with ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=2, env=env) as srv:
        instance = containment.instance_id(srv.data_dir)
        with srv.client("ann") as c:
            job = iso.submit(c, command=[sys.executable, str(work / "gated.py"), str(work)],
                             workers=2)  # fmt: skip
            deadline = time.monotonic() + 90
            while not all((work / f"rank{r}.pid").exists() for r in range(2)):
                assert time.monotonic() < deadline, c.get(f"/v1/jobs/{job}").json()
                time.sleep(0.1)
        assert _cgroups(instance, job) and _scratch(instance, job)  # what there is to reap
        srv.crash()
        _ranks_end(work, 2)
        srv.restart()
        with srv.client("ann") as c:
            assert wait_state(c, job, ("succeeded",), timeout=60)["state"] == "succeeded"
        deadline = time.monotonic() + 30
        while (_cgroups(instance, job) or _scratch(instance, job)) and time.monotonic() < deadline:
            time.sleep(0.1)
        _gone(_cgroups(instance, job), "cgroup directories")
        _gone(_scratch(instance, job), "private temporary directories")


def test_what_an_attempt_unknown_to_the_store_left_is_reaped_at_start(
    root: None, tmp_path: Path
) -> None:
    """An attempt of this service's instance that its store does not know as active (the
    service died at the wrong moment; its data was restored) left a cgroup with a process in
    it and a private TMPDIR: the service's start kills the process and removes both; another
    instance's are left alone."""
    srv = ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=1)
    ours = containment.detect("auto", srv.data_dir)
    theirs = containment.detect("auto", tmp_path / "another-service")
    sleepers, boxes, dirs = [], [], []
    for contained in (ours, theirs):
        box = contained.container(999, 2)
        box.create()
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        for d in box.dirs:
            (d / "cgroup.procs").write_text(str(proc.pid))
        made = Path(tempfile.mkdtemp(prefix=scratch.prefix_of(box.tag)))
        (made / "left.bin").write_bytes(b"x" * 1024)
        sleepers.append(proc)
        boxes.append(box)
        dirs.append(made)
    try:
        with srv:
            deadline = time.monotonic() + 30
            while sleepers[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sleepers[0].poll() is not None, "the stray attempt's process still runs"
            _gone([d for d in boxes[0].dirs if d.exists()], "the stray's cgroup directories")
            _gone([dirs[0]] if dirs[0].exists() else [], "the stray's TMPDIR")
            assert sleepers[1].poll() is None and dirs[1].exists()  # another instance's
    finally:
        sleepers[1].kill()
        sleepers[1].wait()
        boxes[1].clear()
        shutil.rmtree(dirs[1], ignore_errors=True)
