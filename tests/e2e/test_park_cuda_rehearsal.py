"""bench/gpu/park_cuda.py, the GPU check's parking step, rehearsed on the CPU (issue 28).

This machine has no GPU, so the script's ``--cpu`` form runs here: the same cells with the
device swapped for the CPU, against a real service (uvicorn on 127.0.0.1, one CPU slot) and
a real one-engine session that is parked and resumed, then timed against the hand-made path.
Only the device differs from what bench/gpu/check.sh runs on a GPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "park_cuda.py"


def test_the_parking_step_passes_its_cpu_rehearsal(tmp_path: Path) -> None:
    report = tmp_path / "park.json"
    argv = [sys.executable, str(SCRIPT), "--cpu", "--mb", "8", "--pairs", "1",
            "--report", str(report)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and last["pass"] is True, proc.stdout + proc.stderr
    assert json.loads(report.read_text()) == last
    checks = last["checks"]
    assert (last["step"], last["device"]) == ("park_cuda", "cpu")
    assert checks["after"] == checks["before"] and checks["after"]["devices"] == ["cpu"]
    assert checks["after"]["shared"] is True and checks["before"]["adam"] != 0.0
    assert checks["draw"][0] == checks["draw"][1]  # the generator went on where it was
    assert last["bytes"] > 3 * 7.9e6  # the model (8 MB) and Adam's two moments: all saved
    assert last["park_ratio"] > 0 and last["resume_ratio"] > 0


def test_without_a_gpu_the_cuda_form_fails_and_says_why(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1
    assert last == {"step": "park_cuda", "pass": False, "device": "cuda",
                    "error": "no CUDA device"}  # fmt: skip
