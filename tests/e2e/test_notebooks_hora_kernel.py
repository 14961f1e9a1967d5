"""The installed "Python 3 (hora)" kernel really starts with hora's magics loaded.

``hora kernel install --prefix TMP`` (the real console script), then jupyter_client starts that
kernel spec from TMP and runs code in it: the extension is loaded and ``%%distributed`` /
``%dist_status`` exist before any ``%load_ext``; then one ``%%distributed`` cell runs on two
engines, and shutting the kernel down leaves no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    hora = Path(sys.executable).with_name("hora")
    argv = [str(hora)] if hora.exists() else [sys.executable, "-m", "hora.cli"]
    done = subprocess.run(
        [*argv, "kernel", "install", "--prefix", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return tmp_path / "share" / "jupyter" / "kernels"


@pytest.fixture
def kernel(spec_dir: Path) -> Iterator[tuple[Any, str]]:
    tag = new_tag()
    km = KernelManager(
        kernel_name="hora", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir)])
    )
    km.start_kernel(env=tagged_env(tag))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield kc, tag
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        left = wait_gone(tag)
        kill_tagged(tag)
        assert not left, f"processes left after the kernel shut down:\n{describe(left)}"


def _run(kc: Any, code: str, timeout: float = 90) -> tuple[str, dict[str, Any]]:
    """Execute code; return (stdout+stderr+text/plain outputs, the execute_reply content)."""
    chunks: list[str] = []

    def collect(msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            chunks.append(content["text"])
        elif msg["msg_type"] in ("display_data", "execute_result"):
            chunks.append(content["data"].get("text/plain", "") + "\n")
        elif msg["msg_type"] == "error":
            chunks.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=collect)
    return "".join(chunks), reply["content"]


def test_installed_spec_is_the_hora_kernel(spec_dir: Path) -> None:
    spec = json.loads((spec_dir / "hora" / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (hora)"
    assert spec["argv"][0] == sys.executable and spec["argv"][-2:] == ["--ext", "hora"]
    found = KernelSpecManager(kernel_dirs=[str(spec_dir)]).find_kernel_specs()
    assert found["hora"] == str(spec_dir / "hora")


def test_kernel_starts_with_magics_loaded(kernel: tuple[Any, str]) -> None:
    kc, _ = kernel
    out, reply = _run(
        kc,
        "\n".join(
            [
                "import sys",
                "ip = get_ipython()",
                "print('loaded:', 'hora' in ip.extension_manager.loaded)",
                "print('cell:', ip.find_cell_magic('distributed') is not None)",
                "print('lines:', all(ip.find_line_magic(m) for m in ('dist_start', 'dist_status', "
                "'dist_push', 'dist_pull', 'dist_restart', 'dist_stop', 'distributed')))",
                # loading the extension must stay cheap
                "print('heavy:', sorted(m for m in ('torch', 'ipyparallel') if m in sys.modules))",
            ]
        ),
    )
    assert reply["status"] == "ok", out
    assert out.splitlines() == ["loaded: True", "cell: True", "lines: True", "heavy: []"]
    out, reply = _run(kc, "%dist_status")
    assert reply["status"] == "error" and "no engines are running" in out, out


def test_distributed_cell_runs_in_the_hora_kernel(kernel: tuple[Any, str]) -> None:
    kc, _ = kernel
    out, reply = _run(kc, "%%distributed --all\nprint('rank', hvd.rank(), 'of', hvd.size())")
    assert reply["status"] == "ok", out
    assert "[rank 0] rank 0 of 2" in out and "[rank 1] rank 1 of 2" in out, out
