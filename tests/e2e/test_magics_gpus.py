"""GPU planning and binding of %dist_start on a CPU machine, with a fake nvidia-smi on PATH.

hora learns about GPUs from nvidia-smi (it never initialises CUDA in the notebook kernel), so a
script that answers like nvidia-smi for three GPUs, GPU 2 in use by pid 4242, drives the same
code a GPU node runs: the refusals (more GPUs than free, a busy GPU, CUDA already initialised in
the kernel), and engines launched each seeing all the engines' GPUs, as the local ranks of one
node. Torch in the engines finds no GPU here, so the process group is gloo on
CPU; the NCCL path on real GPUs is tests/e2e/test_magics_cuda.py.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
from _magics_util import children_of, wait_gone
from hora.engines import CudaInitializedError, NotEnoughGpusError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(180)

FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-gpu*) printf '0, GPU-aaaa\\n1, GPU-bbbb\\n2, GPU-cccc\\n' ;;
  *query-compute-apps*) printf 'GPU-cccc, 4242\\n' ;;
  *) exit 2 ;;
esac
"""


@pytest.fixture
def ip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    # the test process plays the notebook kernel: the fake nvidia-smi is on its PATH
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    before = set(children_of(os.getpid()))
    yield shell
    shell.run_line_magic("unload_ext", "hora")
    assert wait_gone(set(children_of(os.getpid())) - before) == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "-n 3",
            "asked for 3 GPUs, 3 visible (0, 1, 2), 2 free (0, 1): "
            "pass -n 2 (GPU 2 used by pid 4242)",
        ),
        ("--gpus 2,0", "GPU 2 used by pid 4242; pick from the free ones"),
        ("--gpus 0,7", "GPU 7 not visible"),
    ],
)
def test_more_gpus_than_free_is_refused_before_anything_starts(ip, line, message):
    before = set(children_of(os.getpid()))
    with pytest.raises(NotEnoughGpusError) as exc:
        ip.run_line_magic("dist_start", line)
    assert message in str(exc.value)
    assert set(children_of(os.getpid())) == before


def test_cuda_initialised_in_the_kernel_is_refused(ip, monkeypatch):
    # what torch looks like in a kernel that already made a CUDA context (none can be made on
    # this machine); hora only reads sys.modules, it never imports torch to check
    cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    before = set(children_of(os.getpid()))
    with pytest.raises(CudaInitializedError, match="restart the kernel and run %dist_start"):
        ip.run_line_magic("dist_start", "-n 2")
    assert set(children_of(os.getpid())) == before


def test_each_engine_is_launched_with_its_own_gpu(ip):
    with capture_output() as cap:
        ip.run_line_magic("dist_start", "--gpus 1,0 --backend gloo")
    table = cap.outputs[0].data["text/plain"].splitlines()
    assert table[1].split() == ["rank", "host", "pid", "device", "gpu", "engine_id"]
    assert [line.split()[4] for line in table[2:]] == ["1", "0"]
    with capture_output() as cap:
        result = ip.run_cell(
            "%%distributed --all\nimport os\n"
            "print(os.environ['CUDA_VISIBLE_DEVICES'], hvd.rank(), hvd.local_rank(), "
            "hvd.local_size(), hvd.cross_rank(), hvd.cross_size())"
        )
    assert result.success, cap.stdout
    # every engine sees all the engines' GPUs in --gpus order; rank r pins cuda:r (GPU --gpus[r])
    assert sorted(cap.stdout.splitlines()) == ["[rank 0] 1,0 0 0 2 0 1", "[rank 1] 1,0 1 1 2 0 1"]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the kernel's own environment is untouched
