"""Submission's shortcuts: a start check that passed lately stands, the request's own user row.

A burst of submissions of one program from one directory is checked once
(:class:`hora_service.runtimes.startcheck.Passed`); a launch checks afresh, a failure is never
remembered, another account or another program is checked for real. The quota at submission
comes from the user the request read (``account``) instead of a read of every user.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hora.errors import SpecError
from hora.spec import JobSpec, JobState
from hora_service.identity import RunAs
from hora_service.manager import JobManager
from hora_service.runtimes import startcheck
from hora_service.settings import Settings
from test_service_core import ScriptedRuntime


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pass_holds_for_its_time_and_the_oldest_goes_first() -> None:
    clock = Clock()
    passed = startcheck.Passed(ttl_s=2.0, most=2, clock=clock)
    kept = (Path("/tmp/a"),)
    passed.put("a", kept)
    clock.now += 1.9
    assert passed.get("a") == kept and passed.get("b") is None
    clock.now += 0.2
    assert passed.get("a") is None  # past its 2 s
    passed.put("a", ())
    passed.put("b", ())
    passed.put("a", ())  # again: now the newest
    passed.put("c", ())  # full: the oldest ("b") goes
    assert passed.get("b") is None and passed.get("a") == () and passed.get("c") == ()


def test_check_reuses_only_a_pass_with_the_same_arguments(tmp_path: Path) -> None:
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    clock = Clock()
    passed = startcheck.Passed(clock=clock)
    assert startcheck.check(None, tmp_path, "./prog", "/usr/bin:/bin", passed=passed) == ()
    prog.unlink()
    # the same arguments within the window: the pass stands
    assert startcheck.check(None, tmp_path, "./prog", "/usr/bin:/bin", passed=passed) == ()
    with pytest.raises(SpecError, match="does not exist"):  # without the memo: checked
        startcheck.check(None, tmp_path, "./prog", "/usr/bin:/bin")
    with pytest.raises(SpecError) as e:  # another PATH is another check
        startcheck.check(None, tmp_path, "./prog", "/bin", passed=passed)
    assert e.value.field == "command"
    # another account is checked for real, as itself (a child that drops to it)
    nobody = RunAs(uid=65534, gid=65534, home=Path("/nonexistent"), user="nobody")
    with pytest.raises(SpecError):
        startcheck.check(nobody, tmp_path, "./prog", "/usr/bin:/bin", passed=passed)
    clock.now += startcheck.REUSE_S
    with pytest.raises(SpecError, match="does not exist"):  # the window is over
        startcheck.check(None, tmp_path, "./prog", "/usr/bin:/bin", passed=passed)


def manager(tmp_path: Path, quota: int | None = None) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4,
        user_gpu_quota=quota, containment="tag",  # scripted ranks: no processes
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": ScriptedRuntime()})
    m.open_store()
    return m


def spec(**kw: object) -> JobSpec:
    return JobSpec.model_validate({"command": ["./prog"], "working_dir": "proj", **kw})


def test_submission_reuses_a_pass_and_the_launch_checks_afresh(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    clock = Clock()
    mgr.state.bounds.passed = startcheck.Passed(clock=clock)
    prog = tmp_path / "proj" / "prog"
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    first = mgr.submit("ann", spec(workers=4))  # holds every slot until it ends
    prog.unlink()
    waiting = mgr.submit("ann", spec())  # within the window: the pass of `first` stands
    mgr.tick()  # `first` launches, still within the window: checked afresh, the program is gone
    mgr.tick()  # then `waiting`, on the slots it freed
    for job in (first, waiting):
        done = mgr.get(job.id)
        assert done is not None and done.state == JobState.failed, done
        assert "command: " in (done.reason or "") and "does not exist" in (done.reason or "")
    clock.now += startcheck.REUSE_S
    with pytest.raises(SpecError, match="does not exist") as e:
        mgr.submit("ann", spec())
    assert e.value.field == "command"
    with pytest.raises(SpecError):  # a failure is not remembered either way: still missing
        mgr.submit("ann", spec())
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    assert mgr.submit("ann", spec()).state == JobState.queued  # fixed: accepted at once


def test_the_quota_at_submission_is_the_requests_user_row(tmp_path: Path) -> None:
    mgr = manager(tmp_path, quota=3)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "prog").write_text("#!/bin/sh\n")
    (tmp_path / "proj" / "prog").chmod(0o755)
    mgr.users.create("ann", quota=1)
    mgr.users.create("bob")
    ann, bob = mgr.users.by_name("ann"), mgr.users.by_name("bob")
    assert ann is not None and bob is not None
    with pytest.raises(SpecError, match="your quota is 1") as e:
        mgr.submit_or_find("ann", spec(workers=2), account=ann)
    assert e.value.field == "workers"
    with pytest.raises(SpecError, match="your quota is 3"):  # none of his own: the setting's
        mgr.submit_or_find("bob", spec(workers=4), account=bob)
    assert mgr.submit_or_find("bob", spec(workers=3), account=bob)[1]
    # a row of another user is not taken for this one's: the store is read
    with pytest.raises(SpecError, match="your quota is 1"):
        mgr.submit_or_find("ann", spec(workers=2), account=bob)
