"""Large results of collectives come in memory advised for huge pages (hora.torch._pages).

In the shared world (2 and 3 ranks, conftest.py): ``hvd.allreduce`` out of place (a contiguous
tensor through the lane, a non-contiguous one through a copy), ``hvd.grouped_allreduce``,
``hvd.allgather`` (the same row count on every rank, and different counts) and
``hvd.broadcast`` of tensors past 32 MiB return the right values, leave their input as it
was, and return memory the kernel was asked to back with huge pages (``hg`` in its mapping's
VmFlags); an 8 MiB result is not advised.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BIG = (33 << 20) // 4  # float32 elements: past _pages.MIN_BYTES (32 MiB)
PAGEMAPS = Path(__file__).resolve().parents[1] / "helpers" / "pagemaps.py"


def _pagemaps() -> Any:  # rank processes cannot import the helpers package
    spec = importlib.util.spec_from_file_location("_hora_pagemaps", PAGEMAPS)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    import torch

    pm = _pagemaps()
    x = torch.full((BIG,), float(rank + 1))
    keep = x.clone()
    total = float(size * (size + 1) // 2)
    out: dict[str, Any] = {}
    got = hvd.allreduce(x, op=hvd.Sum, name="large.allreduce")
    out["allreduce"] = (bool((got == total).all()), pm.advised(got), torch.equal(x, keep))
    parts = hvd.grouped_allreduce([x, torch.ones(3)], op=hvd.Sum, name="large.grouped")
    out["grouped"] = (bool((parts[0] == total).all()) and parts[1].tolist() == [size] * 3,
                      pm.advised(parts[0]), torch.equal(x, keep))
    strided = torch.full((2, BIG), float(rank + 1)).t()  # (BIG, 2), not contiguous
    got = hvd.allreduce(strided, op=hvd.Sum, name="large.strided")
    out["strided"] = (bool((got == total).all()) and got.shape == strided.shape,
                      pm.advised(got), bool((strided == rank + 1).all()))
    rows = torch.full((BIG // size + 1, 1), float(rank))
    got = hvd.allgather(rows, name="large.allgather")
    want = torch.arange(size, dtype=torch.float32).repeat_interleave(rows.shape[0])
    out["allgather"] = (torch.equal(got.view(-1), want), pm.advised(got),
                        bool((rows == rank).all()))
    rows = torch.full((BIG // size + rank, 1), float(rank))  # a different count on each rank
    got = hvd.allgather(rows, name="large.allgather.uneven")
    want = torch.cat([torch.full((BIG // size + r,), float(r)) for r in range(size)])
    out["uneven"] = (torch.equal(got.view(-1), want), pm.advised(got),
                     bool((rows == rank).all()))
    got = hvd.broadcast(x, root_rank=size - 1, name="large.broadcast")
    out["broadcast"] = (bool((got == float(size)).all()), pm.advised(got), torch.equal(x, keep))
    small = hvd.allreduce(torch.ones(2 << 20), op=hvd.Sum, name="small.allreduce")  # 8 MiB
    out["small_advised"] = pm.advised(small)
    del got, x, keep, strided, rows
    return out


def test_large_results_are_right_and_advised_for_huge_pages(world: Any) -> None:
    for rank, r in enumerate(world.results(__file__)):
        for case in ("allreduce", "grouped", "strided", "allgather", "uneven", "broadcast"):
            right, advised, input_kept = r[case]
            assert right, f"rank {rank}: {case} returned wrong values"
            assert advised, f"rank {rank}: {case}'s result was not advised for huge pages"
            assert input_kept, f"rank {rank}: {case} changed its input"
        assert not r["small_advised"], f"rank {rank}: an 8 MiB result was advised"
