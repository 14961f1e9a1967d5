"""Horovod's elastic unit tests, unmodified, against hora.torch.elastic (conformance).

``../shared/conformance/horovod/test/single/test_torch_elastic.py`` is run as Horovod runs it:
one process, no launcher, pytest on the file, with a ``horovod`` package on the path whose
``horovod/torch/__init__.py`` re-exports ``hora.torch`` (the same two-line shim as the
``test_torch.py`` run, :mod:`tests.conformance.test_horovod_suite`). Every test must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_horovod_suite import _outcomes, _shim


def test_horovod_elastic_tests_pass_single_process(horovod_suite: Path, tmp_path: Path) -> None:
    suite = horovod_suite / "test" / "single" / "test_torch_elastic.py"
    shim = _shim(tmp_path / "shim", horovod_suite)
    report = tmp_path / "elastic.xml"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "RANK", "WORLD_SIZE", "MASTER_", "HORA_"))}
    env.update(PYTHONPATH=str(shim), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
            "-c", str(shim / "pytest.ini"), "--rootdir", str(shim), f"--junitxml={report}"]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=shim)
    assert report.is_file(), f"no report:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    outcomes = _outcomes(report)
    assert outcomes == {"test_elastic_state": "passed", "test_elastic_sampler": "passed"}, (
        f"{outcomes}\n{res.stdout[-6000:]}"
    )
