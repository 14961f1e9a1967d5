"""`hora kernel install`: the kernel spec contents and the command line (files in tmp only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hora.cli import main as hora_main
from hora.engines.kernelspec import (
    DEFAULT_DISPLAY_NAME,
    KernelSpecError,
    install_kernel_spec,
    kernel_spec,
    main,
    uninstall_kernel_spec,
)


def _kernel_json(prefix: Path, name: str = "hora") -> dict:
    return json.loads((prefix / "share/jupyter/kernels" / name / "kernel.json").read_text())


def test_spec_runs_ipykernel_with_the_extension() -> None:
    spec = kernel_spec("/opt/py/bin/python")
    assert spec == {
        "argv": ["/opt/py/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--ext", "hora"],
        "display_name": "Python 3 (hora)",
        "language": "python",
        "metadata": {"debugger": True},
    }
    assert kernel_spec()["argv"][0] == sys.executable


@pytest.mark.parametrize("name", ["hora", "hora-dev", "team.b_2"])
def test_install_into_prefix_writes_kernel_json(tmp_path: Path, name: str) -> None:
    path = install_kernel_spec(prefix=str(tmp_path), name=name)
    assert Path(path) == tmp_path / "share/jupyter/kernels" / name
    assert _kernel_json(tmp_path, name) == kernel_spec()
    assert (Path(path) / "logo-64x64.png").is_file()


def test_cli_install_then_uninstall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["kernel", "install", "--prefix", str(tmp_path), "--display-name", "My hora"]
    assert hora_main(argv) == 0
    out = capsys.readouterr().out
    assert "Installed kernel spec 'hora' (My hora)" in out and str(tmp_path) in out
    assert _kernel_json(tmp_path)["display_name"] == "My hora"
    # uninstall searches the Jupyter path, which this test process may point at tmp
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share/jupyter"))
    assert main(["kernel", "uninstall", "--name", "hora"]) == 0
    assert not (tmp_path / "share/jupyter/kernels/hora").exists()
    assert "Removed kernel spec 'hora'" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["", "two words", "a/b", "$(rm -rf x)", "ü"])
def test_bad_name_is_refused_naming_the_field(tmp_path: Path, bad: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernel", "install", "--prefix", str(tmp_path), "--name", bad]) == 1
    assert "hora kernel: name:" in capsys.readouterr().err
    assert not (tmp_path / "share").exists()
    with pytest.raises(KernelSpecError, match="name"):
        install_kernel_spec(prefix=str(tmp_path), name=bad)


def test_cli_install_user_writes_to_the_user_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --user means jupyter's per-user data dir (~/.local/share/jupyter), redirected to tmp here
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    assert hora_main(["kernel", "install", "--user"]) == 0
    spec = tmp_path / "data" / "kernels" / "hora" / "kernel.json"
    assert json.loads(spec.read_text()) == kernel_spec()
    assert json.loads(spec.read_text())["display_name"] == "Python 3 (hora)"
    assert str(spec.parent) in capsys.readouterr().out


def test_user_and_prefix_are_exclusive(tmp_path: Path) -> None:
    assert main(["kernel", "install", "--user", "--prefix", str(tmp_path)]) == 2
    with pytest.raises(KernelSpecError, match="prefix"):
        install_kernel_spec(user=True, prefix=str(tmp_path))


@pytest.mark.parametrize("argv", [["kernel"], ["kernel", "frobnicate"]])
def test_usage_errors_exit_2(argv: list[str]) -> None:
    assert main(argv) == 2


def test_uninstall_unknown_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    assert main(["kernel", "uninstall", "--name", "no-such-hora"]) == 1
    assert "no kernel spec named 'no-such-hora'" in capsys.readouterr().err
    with pytest.raises(KernelSpecError):
        uninstall_kernel_spec("no-such-hora")


def test_default_display_name() -> None:
    assert DEFAULT_DISPLAY_NAME == "Python 3 (hora)"
