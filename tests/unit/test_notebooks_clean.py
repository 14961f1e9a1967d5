"""The example notebooks are committed without outputs and match their generator."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["01-quickstart.ipynb", "02-train-digits.ipynb", "03-from-horovod.ipynb"]


def _generator():
    path = NOTEBOOKS / "build_notebooks.py"
    spec = importlib.util.spec_from_file_location("build_notebooks", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problems(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    problems = [f"cell {i} carries outputs" for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    problems += [f"cell {i} saved execution timings" for i, c in enumerate(nb.cells)
                 if "execution" in c.metadata]
    if nb.metadata.get("widgets"):
        problems.append("widget state saved")
    return problems


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert any(c.cell_type == "code" for c in nb.cells)
    assert _problems(NOTEBOOKS / name) == [], f"{name}: clear the outputs before committing"


@pytest.mark.parametrize("name", NAMES)
def test_loads_the_extension_itself(name: str) -> None:
    # so that the notebook runs in a plain python3 kernel as well as in "Python 3 (hora)"
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source.splitlines()[0] == "%load_ext hora"


@pytest.mark.parametrize("name", NAMES)
def test_opens_on_the_hora_kernel(name: str) -> None:
    from hora.engines.kernelspec import DEFAULT_DISPLAY_NAME, DEFAULT_NAME

    spec = nbformat.read(NOTEBOOKS / name, as_version=4).metadata.kernelspec
    assert (spec.name, spec.display_name) == (DEFAULT_NAME, DEFAULT_DISPLAY_NAME)


def test_files_match_the_generator(tmp_path: Path) -> None:
    gen = _generator()
    assert sorted(gen.NOTEBOOKS) == NAMES
    assert gen.main([str(tmp_path)]) == 0
    stale = [n for n in NAMES if (tmp_path / n).read_text() != (NOTEBOOKS / n).read_text()]
    assert not stale, f"{stale} differ from notebooks/build_notebooks.py; run it to regenerate"


def test_a_notebook_with_outputs_is_detected(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / NAMES[0], as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    cell.execution_count = 1
    nbformat.write(nb, tmp_path / "dirty.ipynb")
    assert _problems(tmp_path / "dirty.ipynb") == [f"cell {nb.cells.index(cell)} carries outputs"]
