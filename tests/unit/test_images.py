"""The GPU image's build context: what ``hora image build --gpu`` gathers and hands the engine.

The pip steps are replaced by a stand-in that writes the wheels pip would; the real build
(several GB of CUDA wheels) is the opt-in ``tests/e2e/test_image_gpu.py``.
"""

import os
import re
from pathlib import Path

import hora_service.images as images
import pytest
from hora.errors import HoraError
from hora_service.images import gpu_context, gpu_requirements, gpu_wheel_argvs

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_wheels_come_from_the_index_at_the_locks_versions(tmp_path: Path) -> None:
    repo = tmp_path / "a repo $(x)"
    (repo / "constraints").mkdir(parents=True)
    for name in ("cpu.txt", "test.txt"):
        (repo / "constraints" / name).write_text("")
    hora, deps = gpu_wheel_argvs(repo, tmp_path / "w", tmp_path / "h", tmp_path / "r.txt", "py")
    assert hora[-3:] == ["-w", str(tmp_path / "h"), str(repo)] and "--no-deps" in hora
    # --isolated: no find-links or extra index of this machine can offer its CPU torch
    assert deps[:5] == ["py", "-m", "pip", "--isolated", "wheel"]
    assert "--isolated" not in hora
    assert deps[deps.index("-r") + 1] == str(tmp_path / "r.txt")
    constraints = [deps[i + 1] for i, arg in enumerate(deps) if arg == "-c"]
    assert constraints == [str(repo / "constraints" / n) for n in ("cpu.txt", "test.txt")]


def test_the_gpu_image_holds_horas_dependencies_and_the_examples_extra() -> None:
    reqs = gpu_requirements((ROOT / "pyproject.toml").read_text())
    names = {re.split(r"[\[<>=]", r)[0] for r in reqs}
    assert {"torch", "fastapi", "jupyterlab", "ipyparallel", "scikit-learn"} <= names
    assert not names & {"pytest", "sphinx", "ruff"}  # test and docs extras stay out


def _fake_pip(wheels: list[str], seen: list[dict[str, str] | None]):  # type: ignore[no-untyped-def]
    def run(argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
        out = Path(argv[argv.index("-w") + 1])
        out.mkdir(parents=True, exist_ok=True)
        for name in ["hora-0.1.0-py3-none-any.whl"] if "--no-deps" in argv else wheels:
            (out / name).write_bytes(b"")
        seen.append(env)

    return run


CUDA = ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl"]  # fmt: skip
CPU = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


def test_the_context_holds_what_the_dockerfile_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str] | None] = []
    monkeypatch.setattr(images, "_run", _fake_pip(CUDA, seen))
    (tmp_path / "cache" / "wheels-gpu").mkdir(parents=True)
    (tmp_path / "cache" / "wheels-gpu" / CPU).write_bytes(b"")  # left by an earlier gather
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    gpu_context(ROOT, tmp_path / "cache", ctx)
    # the index's wheels are gathered with no pip configuration file (--isolated still reads one)
    assert seen[0] is None and seen[1] and seen[1]["PIP_CONFIG_FILE"] == os.devnull
    dockerfile = (ctx / "Dockerfile").read_text()
    assert dockerfile == (ROOT / "docker" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M)
    sources = [src for line in copied for src in line.split()]
    assert sources and all((ctx / src).exists() for src in sources), sources
    assert "torch==2.13.0" in (ctx / "constraints.txt").read_text().splitlines()
    assert "fastapi>=0.110" in (ctx / "requirements.txt").read_text().splitlines()
    assert sorted(p.name for p in (ctx / "hora").iterdir()) == ["hora-0.1.0-py3-none-any.whl"]
    assert sorted(p.name for p in (ctx / "wheels").iterdir()) == sorted(CUDA)  # no CPU torch


def test_a_cpu_only_torch_is_refused_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images, "_run", _fake_pip([CPU, CUDA[1]], []))
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    with pytest.raises(HoraError, match=r"no CUDA build of torch .*\(it found torch-2.13.0\+cpu"):
        gpu_context(ROOT, tmp_path / "cache", ctx)
