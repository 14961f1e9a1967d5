"""`hora up` for real: the service and JupyterLab start, answer, and both stop on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers.http_tls import tls
from helpers.service_server import free_port

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _wait_for(
    pattern: str, path: Path, proc: subprocess.Popen[bytes], timeout: float
) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not printed by hora up:\n{path.read_text(errors='replace')}")


def _answers(url: str, timeout: float, **kw: object) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, timeout=5, verify=tls(), **kw)  # type: ignore[arg-type]
            if r.status_code < 500:
                return r
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer in {timeout}s")
        time.sleep(0.3)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_hora_up_starts_and_stops_both(tmp_path: Path, stop_signal: signal.Signals) -> None:
    port, lab_port = free_port(), free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "JUPYTER"))}
    env["HORA_LEASE_DIR"] = os.environ["HORA_LEASE_DIR"]  # the test's own (tests/conftest.py)
    env.update({"HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    out = tmp_path / "up.log"
    argv = [
        PY,
        "-m",
        "hora.cli",
        "up",
        "--port",
        str(port),
        "--lab-port",
        str(lab_port),
        "--data-dir",
        str(tmp_path / "data"),
        "--cpu-slots",
        "2",
    ]
    with out.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        token = _wait_for(r"token: (\S+)", out, proc, 180).group(1)
        lab_token = _wait_for(r"JupyterLab: +\S+/lab\?token=(\S+)", out, proc, 30).group(1)
        # a few lines: JupyterLab's own log is kept in a file, the service logs only warnings
        printed = out.read_text()
        lab_log = tmp_path / "data" / "jupyterlab.log"
        assert "is running at" in lab_log.read_text() and "is running at" not in printed
        assert oct(lab_log.stat().st_mode & 0o777) == "0o600"  # it holds the lab's token
        assert f"dashboard:    http://127.0.0.1:{port}/ui" in printed
        assert f"its log:    {lab_log}" in printed
        assert "INFO" not in printed, printed
        again = subprocess.run(
            [PY, "-m", "hora.cli", "up", "--print-urls", "--data-dir", str(tmp_path / "data")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 0, again.stderr
        assert f"token: {token}" in again.stdout and f"/lab?token={lab_token}" in again.stdout
        # JupyterLab serves ~/hora-work with copies of the examples, not the repository
        notebooks = home / "hora-work" / "notebooks"
        assert (notebooks / "01-quickstart.ipynb").read_bytes() == (
            REPO / "notebooks" / "01-quickstart.ipynb"
        ).read_bytes()
        url = f"http://127.0.0.1:{port}"
        assert _answers(url + "/healthz", 90).status_code == 200
        jobs = httpx.get(url + "/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert jobs.status_code == 200
        saved = json.loads((home / ".hora" / "config").read_text())
        assert saved == {"url": url, "token": token}
        lab = _answers(
            f"http://127.0.0.1:{lab_port}/api/kernelspecs", 150, params={"token": lab_token}
        )
        assert lab.status_code == 200 and "hora" in lab.json()["kernelspecs"]
        listed = httpx.get(
            f"http://127.0.0.1:{lab_port}/api/contents/notebooks",
            params={"token": lab_token},
            timeout=10,
        ).json()
        assert "01-quickstart.ipynb" in {c["name"] for c in listed["content"]}
        family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 2  # hora up and JupyterLab
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=60) == 0, out.read_text()
        assert "stopped" in out.read_text()
        left = [
            p
            for p in family
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        assert not left, f"left running after hora up stopped: {left}"
        for u in (url + "/healthz", f"http://127.0.0.1:{lab_port}/api"):
            with pytest.raises(httpx.TransportError):
                httpx.get(u, timeout=3)
        gone = subprocess.run(
            [PY, "-m", "hora.cli", "up", "--print-urls", "--data-dir", str(tmp_path / "data")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gone.returncode == 1 and "not running" in gone.stderr
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait(timeout=10)


def test_hora_up_token_is_printed_once(tmp_path: Path) -> None:
    """First start: new admin, token printed. Same HOME again: reused. Other HOME: none made."""
    port = free_port()
    argv = [
        PY,
        "-m",
        "hora.cli",
        "up",
        "--no-lab",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "d"),
    ]
    lines = []
    for round_, home in enumerate(["home", "home", "other-home"]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
        env.update({"HOME": str(tmp_path / home), "PYTHONUNBUFFERED": "1"})
        env["HORA_LEASE_DIR"] = os.environ["HORA_LEASE_DIR"]  # the test's own
        out = tmp_path / f"up{round_}.log"
        with out.open("wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            lines.append(_wait_for(r"token: (.+)", out, proc, 90).group(1))
            _answers(f"http://127.0.0.1:{port}/healthz", 60)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert re.fullmatch(r"[\w-]{20,}", lines[0])
    assert lines[1] == "saved in ~/.hora/config"
    assert lines[2].startswith("none saved") and "hora user add" in lines[2]
    assert not (tmp_path / "other-home" / ".hora" / "config").exists()


def test_examples_are_copied_once_and_user_copies_kept(tmp_path: Path) -> None:
    from hora_service.up import seed_notebooks

    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "a.ipynb").write_text("example a")
    (examples / "b.ipynb").write_text("example b")
    root = tmp_path / "work"
    assert seed_notebooks(root, examples) == [
        root / "notebooks/a.ipynb",
        root / "notebooks/b.ipynb",
    ]
    (root / "notebooks/a.ipynb").write_text("the user's edits and outputs")
    (root / "notebooks/b.ipynb").unlink()
    assert seed_notebooks(root, examples) == [root / "notebooks/b.ipynb"]
    assert (root / "notebooks/a.ipynb").read_text() == "the user's edits and outputs"
    assert (examples / "a.ipynb").read_text() == "example a"
