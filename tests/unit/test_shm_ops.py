"""The ring's slice operations (hora.torch._shm_ops), on plain tensors in one process.

An allreduce copies into its slot only the slices the other members sum, and sums its own
slice from its own data: these check that nothing else is written and that the sums have the
bits they had when the whole chunk was copied in first. tests/dist/test_shm.py and
tests/dist/test_shm_paths.py check the whole allreduce against gloo across processes.
"""

from __future__ import annotations

import pytest
import torch
from hora.torch import _shm_ops

SENTINEL = -7.0


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel", [2, 7, 10])
def test_a_member_copies_in_only_the_slices_the_others_sum(n: int, numel: int) -> None:
    src = torch.arange(numel, dtype=torch.float32)
    for me in range(n):
        slot = torch.full((numel,), SENTINEL)
        _shm_ops.copy_others(slot, src, n, me)
        for j in range(n):
            lo, hi = _shm_ops.bounds(numel, n, j)
            want = torch.full((hi - lo,), SENTINEL) if j == me else src[lo:hi]
            assert torch.equal(slot[lo:hi], want), (me, j)


@pytest.mark.parametrize("reduce", sorted(_shm_ops.REDUCERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("n", [2, 3])
def test_summing_from_the_members_own_data_gives_the_bits_of_its_slot(
        reduce: str, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    data = [(torch.randn(11, generator=g) * 100).to(dtype) for _ in range(n)]
    kept = [d.clone() for d in data]
    for me in range(n):
        whole = [d.clone() for d in data]  # every slice copied in, as before
        _shm_ops.reduce_slice(whole, me, reduce)
        part = [d.clone() for d in data]
        part[me].fill_(SENTINEL)  # its own slice was never copied in
        _shm_ops.reduce_slice(part, me, reduce, data[me])
        lo, hi = _shm_ops.bounds(11, n, me)
        assert torch.equal(part[me][lo:hi], whole[me][lo:hi]), me
        assert torch.equal(data[me], kept[me]), "its own data is only read"


@pytest.mark.parametrize("dtype", sorted(_shm_ops.DTYPES, key=str))
@pytest.mark.parametrize("n", [2, 3])
def test_an_average_divides_each_summed_slice_with_the_bits_of_dividing_the_result(
        dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(10 + n)
    raw = [torch.randn(13, generator=g) * 50 for _ in range(n)]
    data = [(r.abs() if dtype == torch.uint8 else r).to(dtype) for r in raw]
    for me in range(n):  # the chunked path: each member's summed slice
        summed, averaged = [d.clone() for d in data], [d.clone() for d in data]
        _shm_ops.reduce_slice(summed, me, "sum", data[me])
        _shm_ops.reduce_slice(averaged, me, "average", data[me])
        lo, hi = _shm_ops.bounds(13, n, me)
        want = _divided(summed[me][lo:hi], n)
        assert torch.equal(averaged[me][lo:hi], want), me


def _divided(t: torch.Tensor, n: int) -> torch.Tensor:
    """Horovod's Average of a sum, out of place: a true division, integers truncated."""
    if t.is_floating_point():
        return torch.div(t, n)
    return torch.div(t, n, rounding_mode="trunc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int16])
@pytest.mark.parametrize("post", [1.0, 0.5])
def test_an_average_off_the_ring_divides_then_scales_like_horovod(
        dtype: torch.dtype, post: float) -> None:
    from hora.torch._ops import _average

    summed = (torch.arange(-20, 21) * 7).to(dtype)
    got = summed.clone()
    _average(got, 3, post)
    if dtype.is_floating_point:  # one rounding: postscale / size, as Horovod scales
        want = summed * (post / 3) if post != 1.0 else torch.div(summed, 3)
    else:  # truncated division, then the scale, truncated too
        want = torch.trunc(_divided(summed, 3).double() * post).to(dtype)
    assert torch.equal(got, want)
