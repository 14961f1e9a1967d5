"""``hora.torch``'s ``>>>`` examples run, in a world of one, and show what they say.

The examples are collectives, so a child process runs them after ``hvd.init()`` on gloo
(tests/helpers/doctests.py gives each docstring a fresh ``model``, ``opt``, ``loss``, ...).
Examples that need several ranks are marked ``# doctest: +SKIP`` in place. The other modules'
examples run in tests/unit/test_doctests.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.world import base_env

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "doctests.py"


def test_hora_torch_examples_in_a_world_of_one() -> None:
    env = {k: v for k, v in base_env().items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_", "HORA_"))}
    out = subprocess.run([sys.executable, str(HELPER), "hora.torch"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.endswith(", 0 failed") and not summary.startswith("doctests: 0 "), summary
