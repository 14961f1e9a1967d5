"""bench/gpu/check.sh, the GPU check, passes its own dry run on a machine without a GPU.

Every step the issue names is present in the report and skipped with the reason "no GPU";
a step whose program cannot run fails the dry run instead of being skipped quietly.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["cuda_tests", "nccl_world1", "notebook", "optimizer_overhead", "preflight_nccl",
         "park_cuda", "gpu_image"]


CHECK = ROOT / "bench" / "gpu" / "check.sh"


def _bench(name: str) -> Any:
    """bench/gpu/NAME.py as a module (registered, so that its dataclasses resolve)."""
    where = ROOT / "bench" / "gpu" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_gpu_{name}", where)
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp: Path, *args: str, check_sh: Path = CHECK) -> tuple[int, dict[str, Any], str]:
    report = tmp / "report.md"
    proc = subprocess.run([str(check_sh), "--dry-run", "--report", str(report), *args],
                          capture_output=True, text=True, timeout=60)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc.returncode, last, report.read_text()


def test_dry_run_lists_every_step_skipped_for_want_of_a_gpu(tmp_path: Path) -> None:
    code, last, report = _run(tmp_path)
    assert code == 0, report
    assert last["bench"] == "gpu_check" and last["pass"] is True and last["gpus"] == 0
    assert list(last["steps"]) == STEPS
    assert set(last["steps"].values()) == {"skipped"}
    for step in STEPS:
        row = next(ln for ln in report.splitlines() if ln.startswith(f"| {step} |"))
        assert row.split("|")[3].strip() == "skipped" and row.split("|")[5].strip() == "no GPU"


def test_a_step_whose_program_cannot_run_fails_the_dry_run(tmp_path: Path) -> None:
    copy = tmp_path / "repo" / "bench" / "gpu"
    shutil.copytree(ROOT / "bench" / "gpu", copy)
    (copy / "nccl_world1.py").write_text("def broken(:\n")
    code, last, report = _run(tmp_path, check_sh=copy / "check.sh")
    assert code == 1
    assert last["failed"] == ["nccl_world1"]
    row = next(ln for ln in report.splitlines() if ln.startswith("| nccl_world1 |"))
    assert "cannot run" in row


def test_the_cuda_step_collects_only_the_modules_that_mark_tests_cuda(tmp_path: Path) -> None:
    # a GPU machine has torch but not the whole suite's dependencies (playwright, schemathesis):
    # collecting every module there would fail on imports that no CUDA test needs
    check = _bench("check")
    tests = tmp_path / "tests" / "e2e"
    tests.mkdir(parents=True)
    (tests / "test_gpu.py").write_text("import pytest\npytestmark = pytest.mark.cuda\n")
    (tests / "test_web.py").write_text("import playwright\n")
    ctx = check.Context(tmp_path, "python", gpus=1, docker=False, image=None)
    argv, _ = check._cuda_tests(ctx)
    assert argv[-5:] == ["-m", "cuda", "-p", "no:cacheprovider",
                         str(tests / "test_gpu.py")]
    assert check._cuda_tests(check.Context(tmp_path / "none", "python", 1, False, None)) == (
        None, "no test is marked cuda")
    # the real suite: the NCCL engine test is among them
    assert ROOT / "tests/e2e/test_magics_cuda.py" in check.cuda_test_files(ROOT)


def test_the_optimizer_overhead_is_timed_only_where_identical_runs_agree() -> None:
    # figures of the launch-bound and the GPU-bound shape as an H200 gave them (bench/RESULTS.md)
    overhead = _bench("optimizer_overhead")

    def shape(o: float, aa: tuple[float, float], wrapper_us: float) -> dict[str, Any]:
        return {"overhead": {"median": o}, "aa": {"min": aa[0], "max": aa[1]},
                "wrapper_us": wrapper_us, "step_us": 1500.0}

    # the A/A rounds agree within 2 %: the timed median decides, either way
    assert overhead.judge(shape(0.0002, (-0.001, 0.001), 6.0)) == (True, "timed")
    assert overhead.judge(shape(0.03, (-0.001, 0.001), 6.0)) == (False, "timed")
    # two identical trainings differ by +-20 %: the wrapper's cost a step decides
    ok, by = overhead.judge(shape(0.0234, (-0.193, 0.198), 1.7))
    assert ok and by.startswith("wrapper")
    ok, by = overhead.judge(shape(0.0, (-0.193, 0.198), 45.0))  # 3 % of a step
    assert not ok and by.startswith("wrapper")
