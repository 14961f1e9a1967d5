"""Execute the example notebooks top to bottom with nbclient (real kernel, real engines, gloo).

Each notebook runs in a plain ``python3`` kernel (it loads the extension itself) whose
environment carries a test tag, so every process it starts (controller, engines) can be found
afterwards: none may be left once the kernel has shut down, whether the notebook ended with
``%dist_stop`` or not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def tag() -> Iterator[str]:
    tag = new_tag()
    try:
        yield tag
    finally:
        kill_tagged(tag)


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
        else:
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def _execute(nb: nbformat.NotebookNode, tag: str, workdir: Path) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel; on a failing cell, fail with all outputs so far."""
    client = NotebookClient(
        nb,
        timeout=150,
        startup_timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute(env=tagged_env(tag))
    except CellExecutionError as exc:
        shown = "\n".join(
            f"--- cell {i}: {c.source.partition(chr(10))[0]}\n{_text(c)}"
            for i, c in enumerate(nb.cells)
            if c.cell_type == "code"
        )
        pytest.fail(f"notebook failed:\n{exc}\n\nall outputs:\n{shown}")
    return nb


def _outputs(nb: nbformat.NotebookNode, starts: str) -> str:
    """Outputs of the code cells whose first line starts with ``starts``."""
    return "\n".join(
        _text(c) for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts)
    )


def _all_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


def _check_quickstart(nb: nbformat.NotebookNode) -> None:
    text = _all_text(nb)
    for expected in [
        "[rank 0] hello from rank 0 of 2",
        "[rank 1] hello from rank 1 of 2",
        "[rank 0] rank 0: allreduce sum = 3",
        "[rank 1] rank 1: allreduce sum = 3",
        "[3.0, 3.0]",
        "pulled from every rank: [10.0, 20.0]",
        "pulled from rank 1: 20.0",
    ]:
        assert expected in text, f"{expected!r} missing from the outputs:\n{text}"
    status = _outputs(nb, "%dist_status")
    assert re.search(r"^0 .*True", status, re.M) and re.search(r"^1 .*True", status, re.M), status


def _check_train_digits(nb: nbformat.NotebookNode) -> None:
    text = _all_text(nb)
    epochs = re.findall(r"^epoch +(\d+): loss ([\d.]+)$", text, re.M)
    assert [int(e) for e, _ in epochs] == list(range(1, 16)), text
    assert float(epochs[-1][1]) < float(epochs[0][1]) / 2, "the loss did not go down"
    match = re.search(r"test accuracy: ([\d.]+)%", text)
    assert match and float(match.group(1)) >= 90.0, text
    plot = next(c for c in nb.cells if "plt.show()" in c.source)
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "no loss plot displayed"


def _check_from_horovod(nb: nbformat.NotebookNode) -> None:
    text = _all_text(nb)
    assert re.findall(r"^epoch (\d+): loss", text, re.M) == ["0", "1", "2", "3", "4"], text
    match = re.search(r"parameter checksum per rank: \[([-\d.e]+), ([-\d.e]+)\]", text)
    assert match and match.group(1) == match.group(2), text


LIST_TAGGED = """
import os
from pathlib import Path

needle = f"HORA_TEST_TAG={os.environ['HORA_TEST_TAG']}".encode()
pids = []
for proc in Path("/proc").iterdir():
    try:
        if proc.name.isdigit() and needle in (proc / "environ").read_bytes().split(b"\\0"):
            pids.append(int(proc.name))
    except OSError:
        pass
print(sorted(pids))
"""

CHECKS = {
    "01-quickstart.ipynb": _check_quickstart,
    "02-train-digits.ipynb": _check_train_digits,
    "03-from-horovod.ipynb": _check_from_horovod,
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_notebook_runs_top_to_bottom(name: str, tag: str, tmp_path: Path) -> None:
    nb = _execute(nbformat.read(NOTEBOOKS / name, as_version=4), tag, tmp_path)
    assert not [c for c in nb.cells if any(o.output_type == "error" for o in c.get("outputs", []))]
    CHECKS[name](nb)
    left = wait_gone(tag)
    assert not left, f"processes left after {name}:\n{describe(left)}"


def test_kernel_shutdown_stops_engines_without_dist_stop(tag: str, tmp_path: Path) -> None:
    """A user who never runs %dist_stop: shutting the kernel down must still stop the engines."""
    nb = nbformat.read(NOTEBOOKS / "01-quickstart.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if c.source.strip() != "%dist_stop"]
    nb.cells.append(nbformat.v4.new_code_cell(LIST_TAGGED))  # what the leak check will look for
    nb = _execute(nb, tag, tmp_path)
    engines = {int(p) for p in re.findall(r"\(pid (\d+)\)", _all_text(nb))}
    tagged = {int(p) for p in re.findall(r"\d+", _text(nb.cells[-1]))}
    assert len(engines) == 2 and engines <= tagged, _all_text(nb)
    left = wait_gone(tag)
    assert not left, f"processes left after the kernel shut down:\n{describe(left)}"
