"""The GPU image built for real: torch's CUDA build and hora on the debootstrap base.

Opt-in: the build gathers several GB of CUDA wheels from the package index, too much for every
CI run, so it runs only with ``HORA_TEST_GPU_IMAGE=1`` and is reported as skipped (with that
reason) otherwise. The engine comes from :mod:`helpers.docker_engine` (the one in
``DOCKER_HOST``, else a private one, removed with its images at the end). Without a GPU,
``torch.cuda.is_available()`` is False; the CUDA libraries must load all the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.docker_engine import EngineUnavailable, engine, image

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("HORA_TEST_GPU_IMAGE") != "1",
        reason="builds the GPU image (several GB of CUDA wheels): set HORA_TEST_GPU_IMAGE=1",
    ),
    pytest.mark.timeout(4200),
]

ROOT = Path(__file__).resolve().parents[2]
# What the image holds, printed as JSON by its own Python (the image's entry point).
PROBE = (
    "import json, torch, hora, hora.torch, hora_service.api.app;"
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,"
    " 'available': torch.cuda.is_available(), 'nccl': list(torch.cuda.nccl.version()),"
    " 'cudnn': torch.backends.cudnn.version(), 'hora': hora.__version__}))"
)


def test_the_gpu_image_holds_torchs_cuda_build_and_hora() -> None:
    try:
        with engine() as eng:
            tag = image(eng, "gpu")
            out = eng.client().containers.run(
                tag, ["-c", PROBE], network_mode="none", remove=True, stderr=True
            )
    except EngineUnavailable as e:
        pytest.fail(f"cannot build the GPU image: {e}")
    found = json.loads(out.decode().strip().splitlines()[-1])
    locked = re.search(r"^torch==(\S+)$", (ROOT / "constraints" / "cpu.txt").read_text(), re.M)
    assert locked, "constraints/cpu.txt pins no torch"
    # the lock's torch, as the index's CUDA build ("+cu130"), never the local "+cpu" wheel
    assert found["torch"].startswith(f"{locked.group(1)}+cu"), found
    assert found["cuda"] and found["nccl"][0] == 2 and found["cudnn"] > 0, found
    assert found["hora"] and found["available"] in (True, False)
