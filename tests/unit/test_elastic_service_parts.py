"""The service's side of elastic jobs without processes: spec, driver argv, slot file, report.

The real service, workers and kills are in tests/e2e/test_service_elastic.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from hora.client import parse_spec
from hora.errors import SpecError
from hora.jobs_cli import build_parser, spec_from_args
from hora.launch import elastic_rdzv as rdzv
from hora.launch.config import parse_args
from hora.spec import ElasticInfo, ElasticSpec, JobSpec
from hora_service.manager import Attempt
from hora_service.runtimes.containment import TAG_VAR, Container
from hora_service.runtimes.elastic_run import (
    ElasticRun,
    driver_argv,
    hosts_arg,
    stop_workers,
    workers,
    write_hosts,
)
from hora_service.users.usage import Usage


def _spec(**fields: object) -> JobSpec:
    return JobSpec.model_validate(
        {"command": ["python", "t.py"], "elastic": {"min_workers": 2, "max_workers": 3}, **fields}
    )


def test_an_elastic_job_needs_its_min_workers_to_start() -> None:
    spec = _spec()
    assert spec.workers == 2 and spec.total_gpus == 2
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec  # a client round trip
    assert _spec(workers=2, gpus_per_worker=2).total_gpus == 4


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"elastic": {"min_workers": 3, "max_workers": 2}}, "elastic.max_workers"),
        ({"elastic": {"min_workers": 0, "max_workers": 2}}, "elastic.min_workers"),
        ({"elastic": {"min_workers": 2, "max_workers": 2000}}, "elastic.max_workers"),
        ({"elastic": {"max_workers": 2}}, "elastic.min_workers"),
        ({"workers": 3}, "workers"),
    ],
)
def test_bad_elastic_fields_name_the_field(fields: dict[str, object], field: str) -> None:
    data = {"command": ["x"], "elastic": {"min_workers": 2, "max_workers": 3}, **fields}
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert e.value.field == field


def test_the_driver_argv_is_hora_run_with_the_slot_file_then_the_command(tmp_path: Path) -> None:
    hostile = ["python", "t.py", "--name", "$(rm -rf /)", "a b'c"]
    argv = driver_argv(_spec(command=[*hostile, "--host-file", "x"]), 3, sys.executable)
    assert argv[:3] == [sys.executable, "-m", "hora.launch"]
    assert argv[argv.index("--") + 1 :] == [*hostile, "--host-file", "x"]
    at = hosts_arg(argv)  # the shim's: the service's own --host-file, not the command's
    assert at < argv.index("--") and argv[at] == "elastic.hosts"
    (tmp_path / "elastic.hosts").write_text("localhost:3\n")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # what the driver will make of it, with the shim's descriptor of the run dir
        argv[at] = f"/proc/self/fd/{fd}/{argv[at]}"
        ec = parse_args(argv[3:], cwd=Path("/")).elastic
        assert ec is not None and (ec.min_np, ec.max_np, ec.report) == (2, 3, True)
        assert ec.host_file == Path(argv[at])  # not resolved to a path the job cannot reach
        assert ec.host_file.read_text() == "localhost:3\n"
    finally:
        os.close(fd)


def test_the_slot_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "elastic.hosts"
    write_hosts(path, 2, -1)
    write_hosts(path, 3, -1)
    assert path.read_text() == "localhost:3\n" and path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic.hosts"]


def _line(gen: int, wids: list[str], why: str, pids: dict[str, int] | None = None) -> str:
    members = rdzv.members_for([(w, "localhost") for w in wids])
    g = rdzv.Generation(gen, members, "127.0.0.1", 1, note=why)
    return "hora run: " + rdzv.membership_line(g, pids or {w: 100 + i for i, w in enumerate(wids)},
                                               time.time()) + "\n"  # fmt: skip


def _run(log: Path) -> ElasticRun:
    return ElasticRun.begin(_spec(), log, 3, time.time(), None)


def test_the_membership_is_read_from_the_drivers_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    forged = "[0]<stdout>:" + _line(9, ["w9"], "forged")
    log.write_text(_line(1, ["w0", "w1", "w2"], "start") + forged + _line(2, ["w0"], "half")[:30])
    run = _run(log)
    assert run.read() and (run.info.size, run.info.generation) == (3, 1)
    assert [m.worker for m in run.info.members] == ["w0", "w1", "w2"]
    with log.open("a") as f:  # the rest of the half-written line
        f.write(_line(2, ["w0", "w2"], "worker w1 on localhost exited with code 137")[30:])
    assert run.read() and run.info.size == 2 and not run.read()
    log.write_text(_line(2, ["w0", "w2"], "again") + _line(3, ["w0", "w2", "w3"], "w3 joined"))
    assert run.read()  # the log was cut: read anew, generation 2 is not taken twice
    assert [(c.generation, c.size) for c in run.info.history] == [(None, 0), (1, 3), (2, 2),
                                                                   (3, 3)]  # fmt: skip


def test_forged_membership_lines_release_no_slot(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text(_line(1, ["w0", "w1", "w2"], "start"))
    run = _run(log)
    run.read()
    run.shrink(1, "shrinking", time.time())
    with log.open("a") as f:  # what a sitecustomize in the driver prints: a world of one
        f.write(_line(99, ["w0"], "forged", {"w0": 999_999_999}))
    assert run.read() and run.info.size == 1  # shown on the job's page, as the job says
    assert not run.released([11, 12, 13])  # three workers run: nothing is given back
    assert not run.released([11, 12]) and run.released([11])


def test_workers_beyond_the_slots_are_stopped_once_the_bound_passed(tmp_path: Path) -> None:
    run = _run(tmp_path / "rank0.log")
    assert run.excess([1, 2, 3], held=3, now=0.0, bound_s=5) == []  # what it holds
    assert run.excess([1, 2, 3, 4], 3, 1.0, 5) == []  # one more started: the bound begins
    assert run.excess([1, 2, 3], 3, 2.0, 5) == []  # it went: the bound is over
    assert run.excess([1, 2, 3, 4], 3, 3.0, 5) == []
    assert run.excess([1, 2, 3, 4], 3, 8.0, 5) == [4]  # 5 s later: the newest is stopped
    run.stopped([4], 8.0)
    assert "stopped worker process(es) 4" in run.info.history[-1].reason
    run.shrink(2, "shrinking", 9.0)
    assert run.excess([1, 2, 3], 3, 9.0, 5) == [] and run.excess([1, 2, 3], 3, 14.0, 5) == [3]


TREE = """\
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
def worker():
    # a worker (its own session, as the driver starts them) with a child of its own
    code = "import subprocess, sys, time; subprocess.Popen(%r); time.sleep(60)" % (sleep,)
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
ws = [worker(), worker()]
if os.fork() == 0:  # one that leaves the driver's tree: it counts as a worker of its own
    if os.fork() == 0:
        os.execv(sys.executable, sleep)
    os._exit(0)
print(" ".join(str(w.pid) for w in ws), flush=True)
time.sleep(60)
"""


def test_the_workers_are_what_the_kernel_shows(tmp_path: Path) -> None:
    tag = f"test/{os.getpid()}/{time.monotonic_ns()}"
    box = Container("tag", tag)
    env = {**os.environ, TAG_VAR: tag}
    driver = subprocess.Popen([sys.executable, "-c", TREE], env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)  # fmt: skip
    try:
        assert driver.stdout is not None
        w0, w1 = map(int, driver.stdout.readline().split())
        deadline = time.monotonic() + 30
        while len(box.pids()) < 6:  # driver, 2 workers, 2 children, the one that left
            assert time.monotonic() < deadline, box.pids()
            time.sleep(0.05)
        seen = workers(box, os.getpid())  # this process is the driver's shim
        assert seen is not None and seen[:2] == [w0, w1] and len(seen) == 3, seen
        assert workers(box, 999_999_999) is None  # no process of the attempt is its child
        left = seen[2]
        assert psutil.Process(left).ppid() != driver.pid
        below = [p.pid for p in psutil.Process(w1).children()]
        assert stop_workers([w1, 999_999_999], box) == [w1]
        psutil.wait_procs([psutil.Process(p) for p in below], timeout=10)
        deadline = time.monotonic() + 10
        while w1 in (workers(box, os.getpid()) or []) or any(p in box.pids() for p in below):
            assert time.monotonic() < deadline, "the stopped worker or its child still runs"
            time.sleep(0.05)
        assert workers(box, os.getpid()) == [w0, left]
    finally:
        box.kill()
        driver.wait()


def test_an_info_shows_size_over_min_and_max() -> None:
    assert ElasticInfo(min_workers=2, max_workers=4, size=3).label == "3/2..4"
    assert ElasticSpec(min_workers=1, max_workers=1).max_workers == 1


def test_slot_seconds_follow_an_elastic_jobs_size() -> None:
    usage = Usage()
    attempt = Attempt(1, "ann", SimpleNamespace(slots=(0, 1)), [], 100.0, None)  # type: ignore[arg-type]
    attempt.count(usage, 110.0)  # 2 slots for 10 s
    attempt.plan = SimpleNamespace(slots=(0, 1, 2))  # type: ignore[assignment]
    attempt.count(usage, 120.0)  # then 3 for 10 s
    assert usage.slot_seconds["ann"] == 50.0


@pytest.mark.parametrize(("given", "field"), [("2", "elastic"), ("3:2", "elastic.max_workers")])
def test_hora_submit_elastic_min_max(given: str, field: str) -> None:
    args = build_parser().parse_args(["submit", "--elastic", "2:3", "--", "python", "t.py"])
    spec = spec_from_args(args)
    assert spec.elastic == ElasticSpec(min_workers=2, max_workers=3) and spec.workers == 2
    with pytest.raises(SpecError) as e:
        spec_from_args(build_parser().parse_args(["submit", "--elastic", given, "--", "t"]))
    assert e.value.field == field


def test_workers_beside_an_elastic_range_says_the_one_thing_wrong() -> None:
    # hora submit --workers 2 --elastic 1:3: the range is the job's size; workers is not
    args = build_parser().parse_args(["submit", "--workers", "2", "--elastic", "1:3", "--", "t"])
    with pytest.raises(SpecError) as e:
        spec_from_args(args)
    assert e.value.field == "workers"
    assert e.value.message == (
        "an elastic job's size is its elastic range (1..3); leave workers out, or set it to "
        "elastic.min_workers (got 2)"
    )
