"""Horovod's own PyTorch test suite, unmodified, against hora.torch (conformance).

``../shared/conformance/horovod/`` (beside the repository; CI clones it there) holds
``test/parallel/test_torch.py`` as Horovod ships it. This module never copies or edits it: it
writes a ``horovod`` package into a temporary folder whose ``horovod/torch/__init__.py``
re-exports ``hora.torch`` (``horovod/runner/util/threads.py`` is linked from the shared copy,
as its README says; ``mock`` is the standard library's ``unittest.mock``), and runs the file
with pytest under ``hora run -np N`` in Horovod's Gloo-runner mode (each rank gets
``HOROVOD_RANK`` / ``HOROVOD_SIZE``: the suite shuts down and re-initialises around every
test; tests/conformance/_rank.py). Nothing is deselected; GPU-only tests skip themselves.

A test passes when it passed on every rank, is skipped when every rank skipped it, and fails
otherwise. The module prints the figures per world size and fails when a test outside
KNOWN_INCOMPATIBLE fails.

Not in the default run yet (set ``HORA_CONFORMANCE=1``): hora.torch does not pass the suite
today (2 ranks: 63 passed, 42 failed, 10 skipped in 287 s; 3 ranks: 51 / 54 / 10 in 582 s,
on 2 cores); README.md
("Coming from Horovod") lists what the failures come from (process sets, autograd of some
collectives, name-based matching, ``join``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOROVOD = REPO.parent / "shared" / "conformance" / "horovod"
SUITE = HOROVOD / "test" / "parallel" / "test_torch.py"
RANK_MAIN = Path(__file__).with_name("_rank.py")

# Suite-side incompatibilities: tests that fail for reasons outside hora.torch, with why.
KNOWN_INCOMPATIBLE = {
    # torch 2.13 added torch.optim.Muon, which the suite's loops over every optimizer class
    # meet; Muon accepts only 2-D parameters and the suite's models have 1-D biases, so the
    # tests fail inside torch before reaching hvd (Horovod 0.28.1 fails them too).
    "test_broadcast_state": "torch 2.13's Muon optimizer refuses the suite's 1-D parameters",
    "test_broadcast_state_options": "torch 2.13's Muon optimizer refuses 1-D parameters",
    "test_force_allreduce": "torch 2.13's Muon optimizer refuses 1-D parameters",
}


def _shim(root: Path) -> Path:
    pkg = root / "horovod"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "runner" / "util").mkdir(parents=True)
    for init in (pkg, pkg / "runner", pkg / "runner" / "util"):
        (init / "__init__.py").write_text("")
    (pkg / "torch" / "__init__.py").write_text(
        '"""horovod.torch for the conformance run: hora.torch under Horovod\'s name."""\n'
        "from hora.torch import *  # noqa: F403\n"
    )
    threads = HOROVOD / "horovod" / "runner" / "util" / "threads.py"
    (pkg / "runner" / "util" / "threads.py").symlink_to(threads)
    (root / "mock.py").write_text("from unittest.mock import *  # noqa: F403\n")
    (root / "pytest.ini").write_text("[pytest]\n")
    return root


def _outcomes(xml: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        out[case.get("name", "")] = outcome
    return out


def _merge(per_rank: list[dict[str, str]]) -> dict[str, str]:
    names = sorted(set().union(*per_rank))
    merged = {}
    for name in names:
        seen = {r.get(name, "missing") for r in per_rank}
        merged[name] = (
            seen.pop() if len(seen) == 1 and seen <= {"passed", "skipped", "failed"} else "failed"
        )
    return merged


@pytest.mark.skipif(
    os.environ.get("HORA_CONFORMANCE") != "1",
    reason="opt-in until hora.torch passes Horovod's suite: HORA_CONFORMANCE=1 runs it",
)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np", [2, 3])
def test_horovod_torch_suite_passes_under_hora_run(np: int, tmp_path: Path) -> None:
    assert SUITE.is_file(), f"Horovod's suite is not at {SUITE} (clone it beside the repository)"
    shim, out = _shim(tmp_path / "shim"), tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RANK", "MASTER_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HORA_TIMEOUT="20")
    argv = [sys.executable, "-m", "hora.cli", "run", "-np", str(np), "--",
            sys.executable, str(RANK_MAIN), str(shim), str(SUITE), str(out)]  # fmt: skip
    t0 = time.monotonic()
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=840, cwd=tmp_path)
    took = time.monotonic() - t0
    reports = [out / f"rank{r}.xml" for r in range(np)]
    missing = [str(p) for p in reports if not p.is_file()]
    assert not missing, f"no report from {missing}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    merged = _merge([_outcomes(p) for p in reports])
    counts = Counter(merged.values())
    print(f"\nHorovod suite, {np} ranks: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped, in {took:.0f} s")  # fmt: skip
    failed = sorted(n for n, o in merged.items() if o == "failed")
    unexpected = [n for n in failed if n not in KNOWN_INCOMPATIBLE]
    assert not unexpected, f"{len(unexpected)} tests failed: {unexpected}\n{res.stdout[-6000:]}"
