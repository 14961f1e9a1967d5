"""Pure parts of hora.torch's training side: compressors, fusion threshold, bucket planning."""

from __future__ import annotations

import pytest
import torch
from hora.errors import NotInitializedError
from hora.torch._reducer import FIRST_BUCKET_BYTES, SOLO_BYTES, _plan
from hora.torch.compression import Compression, FP16Compressor, cast_dtype
from hora.torch.optimizer import DistributedOptimizer, fusion_threshold_bytes


@pytest.mark.parametrize(("comp", "wire"), [(Compression.fp16, torch.float16),
                                            (Compression.bf16, torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cast_compressors_round_trip(comp: type, wire: torch.dtype, dtype: torch.dtype) -> None:
    t = torch.linspace(-3, 3, 11, dtype=dtype)
    c, ctx = comp.compress(t)
    assert c.dtype == wire
    back = comp.decompress(c, ctx)
    assert back.dtype == dtype
    assert torch.allclose(back, t, atol=2e-2)


@pytest.mark.parametrize("comp", [Compression.none, Compression.fp16, Compression.bf16])
@pytest.mark.parametrize("t", [torch.arange(4), torch.ones(2, dtype=torch.float16)],
                         ids=["int64", "float16"])
def test_compressors_leave_ints_and_narrow_floats_alone(comp: type, t: torch.Tensor) -> None:
    c, ctx = comp.compress(t)
    assert c is t and comp.decompress(c, ctx) is t


@pytest.mark.parametrize(("env", "expected"), [
    ({}, 25 * 1024 * 1024),
    ({"HOROVOD_FUSION_THRESHOLD": "1000"}, 1000),
    ({"HORA_FUSION_THRESHOLD": "0", "HOROVOD_FUSION_THRESHOLD": "1000"}, 0),
])
def test_fusion_threshold_from_env(env: dict[str, str], expected: int) -> None:
    assert fusion_threshold_bytes(env) == expected


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5"])
def test_fusion_threshold_rejects_bad_values(raw: str) -> None:
    with pytest.raises(ValueError, match="HORA_FUSION_THRESHOLD"):
        fusion_threshold_bytes({"HORA_FUSION_THRESHOLD": raw})


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in numels]


def test_plan_reverse_order_with_small_first_bucket() -> None:
    mb = 1024 * 1024 // 4  # float32 elements per MiB
    params = _params(mb, mb, mb, mb, mb)
    assert FIRST_BUCKET_BYTES == 1024 * 1024
    # first bucket closes at 1 MiB, the others at the 2 MiB threshold; backward order
    assert _plan(params, 2 * 1024 * 1024, 0) == [[4], [3, 2], [1, 0]]


@pytest.mark.parametrize(("threshold", "expected"), [
    (0, [[3], [2], [1], [0]]),
    (10**9, [[3], [2, 1, 0]]),
])
def test_plan_threshold_extremes(threshold: int, expected: list[list[int]]) -> None:
    assert _plan(_params(300_000, 10, 10, 300_000), threshold, 0) == expected


def test_plan_splits_by_dtype() -> None:
    params = _params(10, 10) + _params(10, dtype=torch.float64) + _params(10)
    buckets = _plan(params, 10**9, 0)
    assert sorted(map(sorted, buckets)) == [[0, 1, 3], [2]]


def test_plan_num_groups() -> None:
    assert _plan(_params(*[10] * 6), 10**9, 3) == [[5, 4], [3, 2], [1, 0]]


def test_plan_gives_a_large_gradient_its_own_bucket_and_closes_the_open_one() -> None:
    solo = SOLO_BYTES // 4  # float32 elements
    params = _params(10, solo, 10, 10)
    # backward order 3, 2, 1, 0: the bucket holding 3 and 2 closes before 1 goes alone, so it
    # is launched without waiting for 0, which comes after
    assert _plan(params, 25 * 1024 * 1024, 0) == [[3, 2], [1], [0]]
    assert _plan(params, 0, 0) == [[3], [2], [1], [0]]


@pytest.mark.parametrize(("comp", "wire"), [
    (Compression.fp16, torch.float16), (Compression.bf16, torch.bfloat16),
    (FP16Compressor(), torch.float16), (Compression.none, None),
])
def test_cast_dtype_names_the_wire_dtype_of_plain_casts(comp: object, wire: object) -> None:
    assert cast_dtype(comp) == wire


def test_cast_dtype_is_none_for_a_subclass_with_its_own_compress() -> None:
    class Scaled(FP16Compressor):
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
            return (tensor * 2).half(), tensor.dtype

    assert cast_dtype(Scaled) is None


def test_duplicate_names_are_refused_before_init() -> None:
    """Horovod's test_duplicate_names builds the optimizer without hvd.init()."""
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="duplicates: bias, weight"):
        DistributedOptimizer(opt, named_parameters=[*a.named_parameters(), *b.named_parameters()])
    one = torch.optim.SGD(a.parameters(), lr=0.1)
    with pytest.raises(NotInitializedError):
        DistributedOptimizer(one, named_parameters=a.named_parameters())
