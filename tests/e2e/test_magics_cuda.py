"""GPU binding of the engines (needs CUDA GPUs and nvidia-smi; skipped on CPU machines)."""

from __future__ import annotations

import shutil

import pytest
from _magics_util import wait_gone
from hora.engines import Cluster, ClusterOptions

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
        reason="needs a CUDA GPU and nvidia-smi",
    ),
]


def test_each_engine_owns_one_gpu_and_nccl_works():
    n = min(2, torch.cuda.device_count())
    c = Cluster(ClusterOptions(n=n, backend="nccl"))
    c.start()
    try:
        rows = c.table()
        # every engine sees the n GPUs and pins cuda:LOCAL_RANK, its own
        assert [r["device"] for r in rows] == [f"cuda:{r}" for r in range(n)]
        assert len({r["gpu"] for r in rows}) == n  # distinct HORA_GPU per engine
        res = c.run(
            "import os\n"
            "t = hvd.allreduce(torch.ones(2, device='cuda'), op=hvd.Sum)\n"
            "print(torch.cuda.device_count(), hvd.local_rank(), t.device, t.sum().item())",
            shown=list(range(n)),
        )
        assert res.stdout == {
            r: f"{n} {r} cuda:{r} {2.0 * n}\n" for r in range(n)
        }, res.stdout
        c.push({"w": torch.zeros(3)})
        c.run("assert w.device.type == 'cuda'; w += 1")
        pulled = c.pull("w")
        assert all(v.device.type == "cpu" and v.tolist() == [1.0] * 3 for v in pulled)
        assert all(isinstance(r["cuda_mb"], float) for r in c.status())
    finally:
        pids = c.pids
        c.stop()
    assert wait_gone(pids) == []
