"""Every tensor collective of hora.torch on 2 and 3 gloo ranks, against a NumPy reference.

Starting a rank (process + torch import) costs seconds, so the shared world of each size
(conftest.py) runs every case of this module (``suite``) and returns the results; each case is
then its own test that recomputes the expected values with NumPy from the same deterministic
inputs. Cases cover
float32, float64, float16, bfloat16, int32 and int64, empty tensors, scalars, every reduce op,
pre/post scale factors, and the in-place ``_``, ``_async`` (synchronize) and ``poll`` forms.
"""

from __future__ import annotations

import itertools
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
FLOATS = ("float32", "float64", "float16", "bfloat16")
OPS = ("Average", "Sum", "Min", "Max", "Product")
# (rtol, atol) for comparing with the float64 reference; integers must match exactly.
TOL = {
    "float32": (1e-6, 1e-6),
    "float64": (1e-12, 1e-12),
    "float16": (2e-3, 2e-3),  # 11-bit mantissa: one rounding of the average
    "bfloat16": (1.6e-2, 1.6e-2),  # 8-bit mantissa: a rounding per partial product
    "int32": (0, 0),
    "int64": (0, 0),
}


@dataclass(frozen=True)
class Case:
    """One collective call; ``pattern`` picks per-rank shapes or splits where they may differ."""

    kind: str
    form: str
    dtype: str
    shape: tuple[int, ...] = (3, 4)
    op: str = "Sum"
    pre: float = 1.0
    post: float = 1.0
    root: int = 0  # -1: the last rank
    pattern: str = ""
    group: tuple[str, ...] = ()  # grouped_allreduce: one dtype per tensor
    compression: str = ""  # hvd.Compression.<name> on the wire

    def __str__(self) -> str:
        dtype = self.dtype or "+".join(self.group)
        parts = [self.form, dtype, self.op, "x".join(map(str, self.shape))]
        if (self.pre, self.post) != (1.0, 1.0):
            parts.append(f"pre{self.pre:g}-post{self.post:g}")
        if self.kind == "broadcast":
            parts.append(f"root{self.root}")
        if self.pattern:
            parts.append(self.pattern)
        if self.compression:
            parts.append(self.compression)
        return "-".join(p for p in parts if p)


def _values(
    case: Case, rank: int, shape: tuple[int, ...], k: int = 0, dtype: str = ""
) -> np.ndarray:
    """Deterministic inputs, exactly representable in every dtype tested (k/4 or small ints)."""
    rng = np.random.default_rng(zlib.crc32(f"{case}/{rank}/{k}".encode()))
    if (dtype or case.dtype).startswith("int"):
        return rng.integers(-5, 6, size=shape).astype(np.int64)
    return rng.integers(-8, 9, size=shape).astype(np.float64) / 4


def _root(case: Case, size: int) -> int:
    return size - 1 if case.root < 0 else case.root


def _gather_rows(case: Case, rank: int) -> int:
    return {"same": 2, "differ": rank, "empty": 0}[case.pattern]


def _splits(case: Case, rank: int, size: int) -> list[int] | None:
    """Rows rank ``rank`` sends to each rank (None: the default equal split of 2 rows each)."""
    if case.pattern == "equal":
        return None
    if case.pattern == "zeros":
        return [0] * size
    return [(rank + dst) % 3 for dst in range(size)]


def _rs_rows(case: Case, size: int) -> int:
    return {"even": 2 * size, "uneven": 2 * size + 1, "fewer": 1}[case.pattern]


# ---------------------------------------------------------------------------------- cases
ALLREDUCE = [
    Case("allreduce", "allreduce", d, s, op)
    for d, op, s in itertools.product(DTYPES, OPS, [(), (0,), (7,), (3, 4)])
]
ALLREDUCE_SCALED = [
    Case("allreduce", "allreduce", d, (5,), op, pre, post)
    for d, op, (pre, post) in itertools.product(
        FLOATS, ("Average", "Sum"), [(0.5, 1.0), (1.0, 3.0), (2.0, 0.25)]
    )
]
ALLREDUCE_FORMS = [
    Case("allreduce", form, d, s, op)
    for form, d, op, s in itertools.product(
        (
            "allreduce_",
            "allreduce_async",
            "allreduce_async_",
            "allreduce_async_poll",
            "allreduce_noncontig_",
        ),
        ("float32", "bfloat16", "int64"),
        ("Average", "Max"),
        [(2, 0), (3, 4)],
    )
]
GROUPED = [
    Case("grouped", form, "", (), op, group=g)
    for form, op, g in itertools.product(
        (
            "grouped_allreduce",
            "grouped_allreduce_",
            "grouped_allreduce_async",
            "grouped_allreduce_async_",
        ),
        ("Average", "Sum"),
        [("float32", "float32", "float32"), ("float32", "float64", "int64", "float32")],
    )
] + [
    Case("grouped", "grouped_allreduce", "", (), "Average", 0.5, 4.0, group=("float16", "float16")),
    Case("grouped", "grouped_allreduce", "", (), "Sum", group=()),
]
GROUP_SHAPES = [(3,), (0,), (2, 2), (), (4, 1)]
ALLGATHER = [
    Case("allgather", "allgather", d, t, "", pattern=p)
    for d, t, p in itertools.product(DTYPES, [(), (3,), (2, 2)], ("same", "differ", "empty"))
] + [
    Case("allgather", "allgather_async", d, (3,), "", pattern=p)
    for d, p in itertools.product(("float32", "int32"), ("same", "differ"))
]
BROADCAST = (
    [
        Case("broadcast", form, d, s, "", root=root)
        for form, d, s, root in itertools.product(
            ("broadcast", "broadcast_", "broadcast_async", "broadcast_async_"),
            DTYPES,
            [(3, 4)],
            (0, -1),
        )
    ]
    + [
        Case("broadcast", form, "float32", s, "", root=-1)
        for form, s in itertools.product(("broadcast", "broadcast_"), [(), (0,), (2, 0, 3)])
    ]
    + [Case("broadcast", "broadcast_noncontig_", "float64", (3, 4), "", root=-1)]
)
ALLTOALL = [
    Case("alltoall", "alltoall", d, t, "", pattern=p)
    for d, t, p in itertools.product(DTYPES, [(2,), ()], ("equal", "uneven", "zeros"))
] + [
    Case("alltoall", "alltoall_async", d, (2,), "", pattern=p)
    for d, p in itertools.product(("float32", "int64"), ("equal", "uneven"))
]
REDUCESCATTER = [
    Case("reducescatter", "reducescatter", d, (3,), op, pattern=p)
    for d, op, p in itertools.product(
        DTYPES, ("Average", "Sum", "Min", "Max"), ("even", "uneven", "fewer")
    )
] + [
    Case("reducescatter", form, "float32", (2,), op, pre, post, pattern="uneven")
    for form, op, (pre, post) in itertools.product(
        ("reducescatter", "reducescatter_async"), ("Average", "Sum"), [(1.0, 1.0), (0.5, 3.0)]
    )
]
COMPRESSED = [
    Case("allreduce", "allreduce", d, (5,), op, compression=c)
    for d, op, c in itertools.product(("float32", "float64"), ("Average", "Sum"), ("fp16", "bf16"))
] + [
    Case("allreduce", "allreduce", "int64", (5,), "Sum", compression="fp16"),  # passes as is
    Case("grouped", "grouped_allreduce", "", (), "Average", group=("float32", "float64", "int64"),
         compression="fp16"),
    Case("reducescatter", "reducescatter", "float32", (3,), "Sum", pattern="uneven",
         compression="bf16"),
]  # fmt: skip
CASES = ALLREDUCE + ALLREDUCE_SCALED + ALLREDUCE_FORMS + GROUPED + ALLGATHER + BROADCAST
CASES += ALLTOALL + REDUCESCATTER + COMPRESSED


# ------------------------------------------------------------------------- rank side
def _torch(arr: np.ndarray, dtype: str) -> Any:
    import torch

    return torch.from_numpy(np.array(arr, order="C")).to(getattr(torch, dtype))


def _np(t: Any) -> tuple[str, np.ndarray]:
    import torch

    wide = torch.int64 if not t.is_floating_point() else torch.float64
    return str(t.dtype).replace("torch.", ""), t.detach().to(wide).numpy().copy()


def _wait_poll(hvd: Any, handle: Any) -> bool:
    deadline = time.monotonic() + 15
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _kwargs(hvd: Any, case: Case) -> dict[str, Any]:
    kw: dict[str, Any] = {"op": getattr(hvd, case.op), "name": str(case)}
    if (case.pre, case.post) != (1.0, 1.0):
        kw.update(prescale_factor=case.pre, postscale_factor=case.post)
    if case.compression:
        kw["compression"] = getattr(hvd.Compression, case.compression)
    return kw


def _run_allreduce(hvd: Any, case: Case, rank: int) -> dict[str, Any]:
    x = _torch(_values(case, rank, case.shape), case.dtype)
    kw = _kwargs(hvd, case)
    before = x.clone()
    form = case.form
    res: dict[str, Any] = {}
    if form == "allreduce":
        out = hvd.allreduce(x, **kw)
        res["input_kept"] = bool((x == before).all())
    elif form == "allreduce_":
        out = hvd.allreduce_(x, **kw)
        res["same_object"] = out is x
    elif form == "allreduce_async":
        out = hvd.synchronize(hvd.allreduce_async(x, **kw))
        res["input_kept"] = bool((x == before).all())
    elif form == "allreduce_async_":
        out = hvd.synchronize(hvd.allreduce_async_(x, **kw))
        res["same_object"] = out is x
    elif form == "allreduce_async_poll":
        h = hvd.allreduce_async_(x, **kw)
        res["polled"] = _wait_poll(hvd, h)
        out = hvd.synchronize(h)
        res["same_object"] = out is x
    else:  # allreduce_noncontig_: in place on a transposed (non-contiguous) view
        base = _torch(_values(case, rank, case.shape[::-1]), case.dtype)
        view = base.t()
        out = hvd.allreduce_(view, **kw)
        res["same_object"] = out is view
        out = base.t()  # the storage must hold the result, not only the returned tensor
    res["out"] = _np(out)
    return res


def _run_grouped(hvd: Any, case: Case, rank: int) -> dict[str, Any]:
    xs = [
        _torch(_values(case, rank, GROUP_SHAPES[k % len(GROUP_SHAPES)], k, d), d)
        for k, d in enumerate(case.group)
    ]
    kw = _kwargs(hvd, case)
    fn = getattr(hvd, case.form)
    out = fn(xs, **kw)
    res: dict[str, Any] = {}
    if case.form.endswith("async_"):
        res["polled"] = _wait_poll(hvd, out)
    if "async" in case.form:
        out = hvd.synchronize(out)
    res["out"] = [_np(t) for t in out]
    if case.form.endswith("_"):
        res["same_object"] = all(a is b for a, b in zip(out, xs, strict=True))
    return res


def _run_allgather(hvd: Any, case: Case, rank: int) -> dict[str, Any]:
    x = _torch(_values(case, rank, (_gather_rows(case, rank), *case.shape)), case.dtype)
    if case.form == "allgather":
        out = hvd.allgather(x, name=str(case))
    else:
        out = hvd.synchronize(hvd.allgather_async(x, name=str(case)))
    return {"out": _np(out)}


def _run_broadcast(hvd: Any, case: Case, rank: int, size: int) -> dict[str, Any]:
    x = _torch(_values(case, rank, case.shape), case.dtype)
    before = x.clone()
    root = _root(case, size)
    res: dict[str, Any] = {}
    if case.form == "broadcast":
        out = hvd.broadcast(x, root, name=str(case))
        res["input_kept"] = bool((x == before).all())
    elif case.form == "broadcast_":
        out = hvd.broadcast_(x, root, name=str(case))
        res["same_object"] = out is x
    elif case.form == "broadcast_async":
        out = hvd.synchronize(hvd.broadcast_async(x, root, name=str(case)))
        res["input_kept"] = bool((x == before).all())
    elif case.form == "broadcast_async_":
        h = hvd.broadcast_async_(x, root, name=str(case))
        res["polled"] = _wait_poll(hvd, h)
        out = hvd.synchronize(h)
        res["same_object"] = out is x
    else:  # broadcast_noncontig_
        base = _torch(_values(case, rank, case.shape[::-1]), case.dtype)
        view = base.t()
        res["same_object"] = hvd.broadcast_(view, root, name=str(case)) is view
        out = base.t()
    res["out"] = _np(out)
    return res


def _run_alltoall(hvd: Any, case: Case, rank: int, size: int) -> dict[str, Any]:
    splits = _splits(case, rank, size)
    rows = 2 * size if splits is None else sum(splits)
    x = _torch(_values(case, rank, (rows, *case.shape)), case.dtype)
    if case.form == "alltoall":
        ret = hvd.alltoall(x, splits=splits, name=str(case))
    else:
        ret = hvd.synchronize(hvd.alltoall_async(x, splits=splits, name=str(case)))
        ret = ret if splits is not None else ret[0]
    if splits is None:
        return {"out": _np(ret), "pair": isinstance(ret, tuple)}
    out, got = ret
    return {"out": _np(out), "received_splits": got.tolist(), "splits_dtype": str(got.dtype)}


def _run_reducescatter(hvd: Any, case: Case, rank: int, size: int) -> dict[str, Any]:
    x = _torch(_values(case, rank, (_rs_rows(case, size), *case.shape)), case.dtype)
    kw = _kwargs(hvd, case)
    if case.form == "reducescatter":
        out = hvd.reducescatter(x, **kw)
    else:
        out = hvd.synchronize(hvd.reducescatter_async(x, **kw))
    return {"out": _np(out)}


def _run(hvd: Any, case: Case, rank: int, size: int) -> dict[str, Any]:
    if case.kind == "allreduce":
        return _run_allreduce(hvd, case, rank)
    if case.kind == "grouped":
        return _run_grouped(hvd, case, rank)
    if case.kind == "allgather":
        return _run_allgather(hvd, case, rank)
    if case.kind == "broadcast":
        return _run_broadcast(hvd, case, rank, size)
    if case.kind == "alltoall":
        return _run_alltoall(hvd, case, rank, size)
    return _run_reducescatter(hvd, case, rank, size)


def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Run every case on this rank (called by the shared world, after ``hvd.init()``)."""
    results: dict[str, Any] = {}
    for case in CASES:  # same order on every rank; an error is recorded, not raised
        try:
            results[str(case)] = _run(hvd, case, rank, size)
        except Exception as e:  # noqa: BLE001  (reported by the case's own test)
            results[str(case)] = {"error": f"{type(e).__name__}: {e}"}
    return results


# ------------------------------------------------------------------------ test side
def _results(world: Any, case: Case) -> list[dict[str, Any]]:
    res = [r[str(case)] for r in world.results(__file__)]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(res) if "error" in r]
    assert not errors, "\n".join(errors)
    return res


WIRE = {"fp16": "float16", "bf16": "bfloat16"}


def _check(
    got: tuple[str, np.ndarray], want: np.ndarray, dtype: str, compression: str = ""
) -> None:
    got_dtype, arr = got
    assert got_dtype == dtype  # compressed results come back in the input's dtype
    assert arr.shape == want.shape
    floats = not dtype.startswith("int")
    rtol, atol = TOL[WIRE[compression] if compression and floats else dtype]
    if rtol == 0:
        np.testing.assert_array_equal(arr, want)
    else:
        np.testing.assert_allclose(arr, want, rtol=rtol, atol=atol)


def _reduce(xs: np.ndarray, op: str, dtype: str, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """NumPy reference of Horovod's reduction over axis 0 (integer Average truncates)."""
    n = xs.shape[0]
    if dtype.startswith("int"):
        xs = xs.astype(np.int64)
    else:
        xs = xs * pre
    out = {"Sum": np.sum, "Average": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}[op](
        xs, axis=0
    )
    if op == "Average":
        out = np.trunc(out / n).astype(np.int64) if dtype.startswith("int") else out / n
    return out if dtype.startswith("int") else out * post


def _assert_flags(res: list[dict[str, Any]]) -> None:
    for r in res:
        for flag in ("input_kept", "same_object", "polled"):
            assert r.get(flag, True) is True, f"{flag} is False"


@pytest.mark.parametrize(
    "case", ALLREDUCE + ALLREDUCE_SCALED + ALLREDUCE_FORMS + COMPRESSED[:9], ids=str
)
def test_allreduce(world: Any, case: Case) -> None:
    n = world.size
    shape = case.shape
    xs = np.stack(
        [_values(case, r, shape[::-1] if "noncontig" in case.form else shape) for r in range(n)]
    )
    if "noncontig" in case.form:
        xs = np.swapaxes(xs, 1, 2)
    want = _reduce(xs, case.op, case.dtype, case.pre, case.post)
    res = _results(world, case)
    _assert_flags(res)
    for r in res:
        _check(r["out"], want, case.dtype, case.compression)


@pytest.mark.parametrize("case", GROUPED + COMPRESSED[9:10], ids=str)
def test_grouped_allreduce(world: Any, case: Case) -> None:
    n = world.size
    res = _results(world, case)
    _assert_flags(res)
    for k, d in enumerate(case.group):
        shape = GROUP_SHAPES[k % len(GROUP_SHAPES)]
        xs = np.stack([_values(case, r, shape, k, d) for r in range(n)])
        want = _reduce(xs, case.op, d, case.pre, case.post)
        for r in res:
            _check(r["out"][k], want, d, case.compression)
    assert all(len(r["out"]) == len(case.group) for r in res)


@pytest.mark.parametrize("case", ALLGATHER, ids=str)
def test_allgather(world: Any, case: Case) -> None:
    n = world.size
    want = np.concatenate(
        [_values(case, r, (_gather_rows(case, r), *case.shape)) for r in range(n)]
    )
    for r in _results(world, case):
        _check(r["out"], want, case.dtype)


@pytest.mark.parametrize("case", BROADCAST, ids=str)
def test_broadcast(world: Any, case: Case) -> None:
    n = world.size
    root = _root(case, n)
    flip = "noncontig" in case.form
    want = _values(case, root, case.shape[::-1] if flip else case.shape)
    want = want.T if flip else want
    res = _results(world, case)
    _assert_flags(res)
    for r in res:
        _check(r["out"], want, case.dtype)


@pytest.mark.parametrize("case", ALLTOALL, ids=str)
def test_alltoall(world: Any, case: Case) -> None:
    n = world.size
    sends = []
    for src in range(n):
        sp = _splits(case, src, n) or [2] * n
        rows = _values(case, src, (sum(sp), *case.shape))
        sends.append(np.split(rows, np.cumsum(sp)[:-1]))
    res = _results(world, case)
    for dst, r in enumerate(res):
        want = np.concatenate([sends[src][dst] for src in range(n)])
        _check(r["out"], want, case.dtype)
        if _splits(case, dst, n) is None:
            assert r["pair"] is False  # without splits=, Horovod returns the tensor alone
        else:
            assert r["received_splits"] == [_splits(case, src, n)[dst] for src in range(n)]
            assert r["splits_dtype"] == "torch.int32"


@pytest.mark.parametrize("case", REDUCESCATTER + COMPRESSED[10:], ids=str)
def test_reducescatter(world: Any, case: Case) -> None:
    n = world.size
    rows = _rs_rows(case, n)
    xs = np.stack([_values(case, r, (rows, *case.shape)) for r in range(n)])
    full = _reduce(xs, case.op, case.dtype, case.pre, case.post)
    # Horovod's split: the first rows % size ranks get one extra row
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    blocks = np.split(full, np.cumsum(counts)[:-1])
    for r, res in enumerate(_results(world, case)):
        _check(res["out"], blocks[r], case.dtype, case.compression)
