"""The per-attempt TMPDIR of attempts without a private /tmp (runtimes/scratch.py)."""

from __future__ import annotations

import os
from pathlib import Path

from hora.spec import JobSpec
from hora_service.runtimes import scratch
from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.containment import Container


def _plan(tmp_path: Path, job: int = 7, tag: str = "ab12/7/2") -> AttemptPlan:
    return AttemptPlan(
        job_id=job, attempt=2, spec=JobSpec(command=["python", "t.py"], workers=1), slots=(0,),
        slot_kind="cpu", run_dir=tmp_path / "run", workdir=tmp_path, master_port=29500,
        container=Container("tag", tag),
    )  # fmt: skip


def test_made_private_and_removed_with_what_is_inside(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    made = scratch.make(plan, str(tmp_path))
    assert made is not None and made.name.startswith("hora-tmp-ab12-7-2-")
    assert made.stat().st_mode & 0o777 == 0o700
    (made / "hora-session-engine-x").mkdir()
    (made / "hora-session-engine-x" / "engine.json").write_text("{}")
    other = scratch.make(_plan(tmp_path, 8, "ab12/8/2"), str(tmp_path))  # another attempt's
    scratch.remove(plan, str(tmp_path))
    assert not made.exists()
    assert other is not None and other.is_dir()


def test_a_planted_symlink_is_neither_followed_nor_removed(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    os.symlink(target, tmp_path / "hora-tmp-ab12-7-2-planted")
    made = scratch.make(plan, str(tmp_path))
    assert made is not None
    (made / "link").symlink_to(target)  # inside: removed as a link, not followed
    scratch.remove(plan, str(tmp_path))
    assert (target / "keep").read_text() == "x"
    assert (tmp_path / "hora-tmp-ab12-7-2-planted").is_symlink() and not made.exists()


def test_nothing_without_a_containment_tag(tmp_path: Path) -> None:
    plan = AttemptPlan(
        job_id=1, attempt=1, spec=JobSpec(command=["x"]), slots=(0,), slot_kind="cpu",
        run_dir=tmp_path, workdir=tmp_path, master_port=1,
    )  # fmt: skip
    assert scratch.make(plan, str(tmp_path)) is None
    scratch.remove(plan, str(tmp_path))
