"""JupyterLab itself, driven in headless Chromium: run 01-quickstart.ipynb and read the page.

A real ``jupyter lab`` server on 127.0.0.1 (random port and token, a temporary copy of
notebooks/ as its root), Debian's Chromium driven through Playwright (never a downloaded
browser). The test opens the quickstart notebook, runs every cell from the Run menu, waits for
the kernel to finish and checks the rendered outputs: hello lines from ranks 0 and 1, the
allreduce result, pulled values. Then it shuts the server down through its REST API and checks
that no process it started (server, kernel, controller, engines) is left.

A second test runs a notebook whose ``%dist_start`` goes through a real hora service (2 CPU
slots, both held by a job) and checks that the page shows the queued request live, then the
engines once the job ends.

Skipped only when /usr/bin/chromium is missing (CI installs it).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
from e2e._notebooks_procs import (
    describe,
    free_port,
    kill_tagged,
    new_tag,
    tagged_env,
    wait_gone,
)
from playwright.sync_api import Page, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
SCREENSHOT_DIR_VAR = "HORA_SCREENSHOT_DIR"  # keep the screenshot there (for a human to look at)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]


@dataclass
class LabServer:
    url: str
    token: str
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, method: str = "GET", timeout: float = 5.0) -> int:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def _lab_argv(port: int, token: str, root: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.port_retries=0",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    return argv


def _write_lab_settings(settings_dir: Path) -> None:
    """User settings: no news toast, and every cell rendered (no windowing) for the screenshot."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}',
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
    }
    for rel, text in files.items():
        (settings_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings_dir / rel).write_text(text)


def _wait_ready(server: LabServer, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if server.api("/api/status", timeout=2) == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    pytest.fail(f"jupyter lab did not answer within {timeout:g}s:\n{server.log_tail()}")


def _stop(server: LabServer, tag: str) -> list[int]:
    """Shut the server down the way a user does (File > Shut Down); return leftover pids."""
    try:
        server.api("/api/shutdown", method="POST")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass  # it may close the connection while exiting
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.terminate()
        server.proc.wait(timeout=10)
    return wait_gone(tag, timeout=20)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[LabServer]:
    with run_lab(tmp_path) as server:
        yield server


@contextmanager
def run_lab(tmp_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[LabServer]:
    """A jupyter lab server on a copy of notebooks/; stopped, and checked for leftovers, after."""
    root = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns("*.py", ".ipynb_checkpoints"))
    tag = new_tag()
    env = tagged_env(tag)
    env.update(extra_env or {})
    for var, sub in [
        ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"),
        ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ]:
        env[var] = str(tmp_path / sub)
    # the notebooks open on the "hora" kernel: install it for this server, as `hora up` does
    from hora.engines.kernelspec import install_kernel_spec

    install_kernel_spec(prefix=str(tmp_path / "jupyter"))
    env["JUPYTER_PATH"] = str(tmp_path / "jupyter" / "share" / "jupyter")
    _write_lab_settings(tmp_path / "lab-settings")
    port, token = free_port(), secrets.token_hex(16)
    log = tmp_path / "jupyterlab.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _lab_argv(port, token, root),
            env=env,
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = LabServer(f"http://127.0.0.1:{port}", token, root, proc, log)
    try:
        _wait_ready(server)
        yield server
        left = _stop(server, tag)
        assert proc.returncode is not None, "jupyter lab is still running"
        assert not left, f"processes left after the server shut down:\n{describe(left)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        kill_tagged(tag)


def _outputs_text(page: Page) -> str:
    # textContent, not innerText: cells scrolled out of view are still in the DOM
    return "\n".join(page.locator(".jp-OutputArea-output").all_text_contents())


def _wait_for_run(page: Page, timeout: float) -> list[str]:
    """Wait until no cell is queued or running ``[*]`` and the kernel is idle; return prompts.

    After an error JupyterLab stops "Run All" and leaves the later prompts empty, so this also
    returns early on a failure instead of waiting for cells that will never run.
    """
    deadline = time.monotonic() + timeout
    prompts: list[str] = []
    while time.monotonic() < deadline:
        page.wait_for_timeout(500)
        prompts = [p.strip() for p in page.locator(".jp-InputArea-prompt").all_text_contents()]
        idle = page.locator(".jp-StatusBar-Widget", has_text="| Idle").count() > 0
        started = any(re.fullmatch(r"\[\d+\]:", p) for p in prompts)
        if idle and started and not any("*" in p for p in prompts):
            return prompts
    pytest.fail(
        f"cells still running after {timeout:g}s; prompts: {prompts}\n"
        f"outputs so far:\n{_outputs_text(page)}"
    )


def _wait_kernel_idle(page: Page) -> None:
    """Wait for the status bar to say "<kernel> | Idle" (the kernel is up and connected)."""
    page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for()
    dialog = page.locator(".jp-Dialog")
    if dialog.count():  # "Select Kernel": accept the notebook's own kernel
        dialog.locator(".jp-mod-accept").click()


def _screenshot_path(tmp_path: Path) -> Path:
    keep = os.environ.get(SCREENSHOT_DIR_VAR)
    folder = Path(keep) if keep else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "jupyterlab-01-quickstart.png"


def test_quickstart_runs_in_jupyterlab(lab: LabServer, tmp_path: Path) -> None:

    nb = nbformat.read(lab.root / "01-quickstart.ipynb", as_version=4)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{lab.url}/lab/tree/01-quickstart.ipynb?token={lab.token}")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
            _wait_kernel_idle(page)
            # the notebook opened on its own kernel, without asking
            page.locator(".jp-StatusBar-Widget", has_text="Python 3 (hora) | Idle").first.wait_for()
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            prompts = _wait_for_run(page, timeout=150)
            text = _outputs_text(page)
            page.screenshot(path=str(_screenshot_path(tmp_path)), full_page=True)
        finally:
            browser.close()
    ran = [p for p in prompts if re.fullmatch(r"\[\d+\]:", p)]
    assert len(ran) == n_code, f"not every cell ran (an error stops Run All): {prompts}\n{text}"
    for expected in [
        "[rank 0] hello from rank 0 of 2",
        "[rank 1] hello from rank 1 of 2",
        "[rank 0] rank 0: allreduce sum = 3",
        "[rank 1] rank 1: allreduce sum = 3",
        "[3.0, 3.0]",
        "pulled from every rank: [10.0, 20.0]",
        "pulled from rank 1: 20.0",
        "2 engines ready in",
    ]:
        assert expected in text, f"{expected!r} not rendered; outputs:\n{text}"


QUEUED_CELLS = [
    "%dist_start -n 1 --timeout 30",
    "%%distributed\nprint('after the queue: rank', hvd.rank(), 'of', hvd.size())",
]
GATE = """import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
while not gate.exists():
    time.sleep(0.1)
"""


def test_a_queued_start_shows_live_in_jupyterlab(tmp_path: Path) -> None:
    from helpers.service_server import ServiceServer

    gate, script = tmp_path / "gate", tmp_path / "gate.py"
    script.write_text(GATE)
    env = {"HORA_SESSION_LEASE_S": "10"}
    with ServiceServer(tmp_path / "svc", {"ann": False, "root": True}, 2, env) as srv:
        with srv.client("root") as root:
            job = root.post(
                "/v1/jobs", json={"command": [sys.executable, str(script), str(gate)], "workers": 2}
            ).json()
            try:
                text = _run_queued_notebook(tmp_path, srv, gate)
            finally:
                gate.write_text("go")
    assert f"job {job['id']} (root) holds slots 0,1" in text, text
    assert "slots granted after" in text and "1 engines ready in" in text, text
    assert f"from the hora service at {srv.url}" in text, text
    assert "after the queue: rank 0 of 1" in text, text


def _run_queued_notebook(tmp_path: Path, srv: Any, gate: Path) -> str:
    lab_env = {
        "HORA_URL": srv.url,
        "HORA_TOKEN": srv.tokens["ann"],
        "HORA_CONFIG": str(tmp_path / "no-config"),
    }
    with run_lab(tmp_path, lab_env) as lab:
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "hora", "display_name": "Python 3 (hora)"}
        nb.cells = [nbformat.v4.new_code_cell(c) for c in QUEUED_CELLS]
        nbformat.write(nb, lab.root / "queued.ipynb")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"{lab.url}/lab/tree/queued.ipynb?token={lab.token}")
                page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
                _wait_kernel_idle(page)
                page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
                page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
                # the queued request is shown live in the cell while the job holds the slots
                page.locator(
                    ".jp-OutputArea-output", has_text="queued: position 1"
                ).first.wait_for()
                queued = _outputs_text(page)
                gate.write_text("go")  # the job ends; the session gets its slots
                _wait_for_run(page, timeout=120)
                text = _outputs_text(page)
            finally:
                browser.close()
    return queued + "\n" + text
