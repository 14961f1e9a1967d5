"""The per-attempt TMPDIR of attempts without a private /tmp (runtimes/scratch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


SHIM = Path(scratch.__file__).with_name("shim.py")
SHOWS_TMP = """\
import os, pathlib, sys
tmp = pathlib.Path(os.environ["TMPDIR"])
(tmp / "work").mkdir()
(tmp / "work" / "f").write_text("x")
os.symlink(sys.argv[1], tmp / "link")  # what a job could plant: never followed at removal
print("TMPDIR", tmp, oct(tmp.stat().st_mode & 0o777), flush=True)
if sys.argv[2] == "exit":
    os._exit(3)  # no handler of the rank runs: the shim still removes it
"""


def _shim(run: Path, launch: dict, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """Run the real shim on ``launch`` as rank 0 of ``run`` (its log is ``run/rank0.log``)."""
    run.mkdir()
    (run / "rank0.launch").write_text(json.dumps(launch))
    return subprocess.run([sys.executable, "-I", "-S", str(SHIM), str(run), "0"], env=env,
                          timeout=60)


def _run_shim(tmp_path: Path, how: str, own_tmp: bool) -> tuple[str, int]:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("x")
    script = tmp_path / "shows_tmp.py"
    script.write_text(SHOWS_TMP)
    base = tmp_path / "node-tmp"  # the node's TMPDIR, where the shim makes the rank's own
    base.mkdir()
    launch = {"command": [sys.executable, str(script), str(keep), how],
              "env": {"PATH": os.environ.get("PATH", "")}, "uid": None, "gid": None,
              "cgroups": [], "log_limit": 1 << 20, "cwd": str(tmp_path)}
    if own_tmp:
        launch["own_tmp"] = True
    proc = _shim(tmp_path / "run", launch, {"TMPDIR": str(base)})
    assert (keep / "precious").read_text() == "x"  # the planted link was not followed
    return (tmp_path / "run" / "rank0.log").read_text(), proc.returncode


def test_a_slurm_ranks_own_tmpdir_is_private_and_gone_when_it_ends(tmp_path: Path) -> None:
    out, code = _run_shim(tmp_path, "ok", own_tmp=True)
    assert code == 0, out
    _, tmp, mode = next(ln for ln in out.splitlines() if ln.startswith("TMPDIR ")).split()
    assert Path(tmp).parent == tmp_path / "node-tmp" and Path(tmp).name.startswith(
        "hora-tmp-rank0-")
    assert mode == "0o700"
    assert not Path(tmp).exists()


def test_a_rank_that_dies_without_its_handlers_leaves_no_tmpdir(tmp_path: Path) -> None:
    out, code = _run_shim(tmp_path, "exit", own_tmp=True)
    assert code == 3, out
    tmp = next(ln for ln in out.splitlines() if ln.startswith("TMPDIR ")).split()[1]
    assert not Path(tmp).exists()
    assert list((tmp_path / "node-tmp").iterdir()) == []


def test_without_own_tmp_the_rank_keeps_the_tmpdir_it_was_given(tmp_path: Path) -> None:
    # the local runtime's ranks (their TMPDIR is the attempt's, which the service removes)
    given = tmp_path / "given"
    given.mkdir()
    launch = {"command": [sys.executable, "-c", "import os; print('TMPDIR', os.environ['TMPDIR'])"],
              "env": {"TMPDIR": str(given)}, "uid": None, "gid": None, "cgroups": [],
              "log_limit": 1 << 20}
    assert _shim(tmp_path / "run", launch, {}).returncode == 0
    assert f"TMPDIR {given}" in (tmp_path / "run" / "rank0.log").read_text()
    assert given.is_dir()
