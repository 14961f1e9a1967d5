"""broadcast_parameters, broadcast_optimizer_state and SyncBatchNorm on 2 and 3 gloo ranks.

The shared world of each size (conftest.py) runs every case (``suite``). Broadcasts must
leave every rank with root's values (buffers, integer counters and optimizer step counts
included) whichever rank is root, also when only root has optimizer state. SyncBatchNorm on
each rank's slice must match ``torch.nn.BatchNorm*d`` on the concatenated batch: outputs,
input gradients, the sum of the ranks' weight/bias gradients and the running statistics,
also with a different batch size on every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

ROOTS = ("first", "last")  # rank 0 and rank size - 1


def _root(which: str, size: int) -> int:
    return 0 if which == "first" else size - 1


class Model(nn.Module):
    """Parameters, float buffers and an int64 buffer (BatchNorm's num_batches_tracked)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2, bias=False)
        self.train()
        self.bn(torch.randn(8, 4))  # running stats and the counter differ by seed


def _tensors(obj: Any) -> Any:
    """Deep-copy a state_dict-like structure with detached tensor copies."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_tensors(v) for v in obj)
    return obj


# ------------------------------------------------------------------ broadcast cases
def _bcast_params(hvd: Any, rank: int, root: int, form: str) -> dict[str, Any]:
    model = Model(seed=10 + rank)
    before = _tensors(model.state_dict())
    if form == "state_dict":
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    else:
        hvd.broadcast_parameters(model.named_parameters(), root_rank=root)
    return {"before": before, "after": _tensors(model.state_dict())}


def _local_steps(model: Model, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(i))
        model.out(model.fc(x)).square().mean().backward()
        opt.step()


def _bcast_opt(hvd: Any, rank: int, root: int, kind: str) -> dict[str, Any]:
    """Optimizer state and hyper-parameters differ by rank; only root has stepped."""
    model = Model(seed=1)
    params = list(model.fc.parameters()) + list(model.out.parameters())
    lr = 0.01 * (rank + 1)
    if kind == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, betas=(0.8, 0.9))
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.5 + 0.1 * rank)
    if rank == root:
        _local_steps(model, opt, 2)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    # the received state must be usable: one more local step works on every rank
    sd = _tensors(opt.state_dict())
    _local_steps(model, opt, 1)
    return {"state_dict": sd}


def _bcast_wrapped_opt(hvd: Any, rank: int, root: int) -> dict[str, Any]:
    """The Horovod recipe on a DistributedOptimizer after a distributed step."""
    model = Model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt.zero_grad()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    model.out(model.bn(model.fc(x))).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    return {"state_dict": _tensors(opt.state_dict())}


# ------------------------------------------------------------------ SyncBatchNorm cases
@dataclass(frozen=True)
class BNCase:
    """One SyncBatchNorm configuration, compared with BatchNorm on the whole batch."""

    dims: int  # 2: (N, C), 3: (N, C, L), 4: (N, C, H, W)
    dtype: str
    uneven: bool
    affine: bool = True
    momentum: float | None = 0.1
    track: bool = True

    def __str__(self) -> str:
        parts = [f"{self.dims}d", self.dtype, "uneven" if self.uneven else "even"]
        parts += [] if self.affine else ["no-affine"]
        parts += [] if self.momentum is not None else ["cumulative"]
        parts += [] if self.track else ["no-running-stats"]
        return "-".join(parts)


BN_CASES = [
    BNCase(d, dt, u)
    for d, dt, u in itertools.product((2, 4), ("float32", "float64"), (False, True))
] + [
    BNCase(3, "float64", True, affine=False),
    BNCase(2, "float64", True, momentum=None),
    BNCase(4, "float64", True, track=False),
]
C = 3
ITERS = 2  # two training steps: running statistics are updated twice


def _rows(case: BNCase, rank: int) -> int:
    return rank + 2 if case.uneven else 4


def _bn_data(case: BNCase, it: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(_rows(case, r) for r in range(size))
    tail = {2: (), 3: (5,), 4: (2, 3)}[case.dims]
    g = torch.Generator().manual_seed(7 + it)
    dtype = getattr(torch, case.dtype)
    x = (torch.randn(n, C, *tail, generator=g, dtype=torch.float64) * 2 + 1).to(dtype)
    return x, torch.randn(n, C, *tail, generator=g, dtype=torch.float64).to(dtype)


def _bn_module(cls: Any, case: BNCase) -> Any:
    torch.manual_seed(3)
    bn = cls(C, momentum=case.momentum, affine=case.affine, track_running_stats=case.track)
    bn = bn.to(getattr(torch, case.dtype))
    if case.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn


def _bn_run(bn: Any, x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    """Train ITERS steps on (x, w) pairs; return the last output, grads and the buffers."""
    out: dict[str, Any] = {}
    bn.train()
    for it in range(ITERS):
        xi = x[it].clone().requires_grad_(True)
        if bn.weight is not None:
            bn.weight.grad = None
            bn.bias.grad = None
        y = bn(xi)
        (y * w[it]).sum().backward()
        out = {"y": y.detach(), "dx": xi.grad}
        if bn.weight is not None:
            out.update(dw=bn.weight.grad.clone(), db=bn.bias.grad.clone())
    bn.eval()
    out["eval_y"] = bn(x[0]).detach()
    out["buffers"] = {k: v.clone() for k, v in bn.named_buffers()}
    return out


def _syncbn(hvd: Any, case: BNCase, rank: int, size: int) -> dict[str, Any]:
    lo = sum(_rows(case, r) for r in range(rank))
    hi = lo + _rows(case, rank)
    data = [_bn_data(case, it, size) for it in range(ITERS)]
    bn = _bn_module(hvd.SyncBatchNorm, case)
    return _bn_run(bn, [x[lo:hi] for x, _ in data], [w[lo:hi] for _, w in data])


# ------------------------------------------------------------------------ rank body
def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Run every case on this rank (called by the shared world, after ``hvd.init()``)."""
    jobs: dict[str, Any] = {}
    for which in ROOTS:
        root = _root(which, size)
        for form in ("state_dict", "named_parameters"):
            jobs[f"params-{form}-{which}"] = lambda r=root, f=form: _bcast_params(hvd, rank, r, f)
        for kind in ("adam", "sgd"):
            jobs[f"opt-{kind}-{which}"] = lambda r=root, k=kind: _bcast_opt(hvd, rank, r, k)
        jobs[f"wrapped-{which}"] = lambda r=root: _bcast_wrapped_opt(hvd, rank, r)
    for case in BN_CASES:
        jobs[f"bn-{case}"] = lambda c=case: _syncbn(hvd, c, rank, size)
    results: dict[str, Any] = {}
    for key, job in jobs.items():  # same order on every rank; errors are reported per case
        try:
            results[key] = job()
        except Exception as e:  # noqa: BLE001
            results[key] = {"error": f"{type(e).__name__}: {e}"}
    return results


# ------------------------------------------------------------------------ test side
def _get(world: Any, key: str) -> list[Any]:
    res = [r[key] for r in world.results(__file__)]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(res) if "error" in r]
    assert not errors, "\n".join(errors)
    return res


def _equal(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, path
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("form", ["state_dict", "named_parameters"])
@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_parameters_makes_every_rank_equal_root(
    world: Any, which: str, form: str
) -> None:
    res = _get(world, f"params-{form}-{which}")
    root = _root(which, world.size)
    want = res[root]["before"]
    names = (
        set(want)
        if form == "state_dict"
        else {n for n in want if "running" not in n and "num_batches" not in n}
    )
    for r, got in enumerate(res):
        if r != root:  # the test means something only when the ranks started different
            assert not torch.equal(got["before"]["fc.weight"], want["fc.weight"])
        for name in names:
            _equal(got["after"][name], want[name], f"rank {r} {name}")
    if form == "named_parameters":  # buffers were not passed: they keep each rank's value
        assert not torch.equal(
            res[0]["after"]["bn.running_mean"], res[1]["after"]["bn.running_mean"]
        )


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_optimizer_state_when_only_root_has_state(
    world: Any, which: str, kind: str
) -> None:
    res = _get(world, f"opt-{kind}-{which}")
    root = _root(which, world.size)
    want = res[root]["state_dict"]
    assert len(want["state"]) == 3  # root stepped: all 3 parameters have state
    for r, got in enumerate(res):
        _equal(got["state_dict"], want, f"rank {r}")


@pytest.mark.parametrize("which", ROOTS)
def test_broadcast_optimizer_state_of_a_distributed_optimizer(world: Any, which: str) -> None:
    res = _get(world, f"wrapped-{which}")
    root = _root(which, world.size)
    want = res[root]["state_dict"]
    assert want["param_groups"][0]["lr"] == pytest.approx(0.001 * (root + 1))
    for r, got in enumerate(res):
        _equal(got["state_dict"], want, f"rank {r}")


@pytest.mark.parametrize("case", BN_CASES, ids=str)
def test_sync_batch_norm_matches_batch_norm_on_concatenated_batch(world: Any, case: BNCase) -> None:
    res = _get(world, f"bn-{case}")
    data = [_bn_data(case, it, world.size) for it in range(ITERS)]
    want = _bn_run(
        _bn_module(nn.BatchNorm1d if case.dims < 4 else nn.BatchNorm2d, case),
        [x for x, _ in data],
        [w for _, w in data],
    )
    tol = {"float32": 1e-5, "float64": 1e-10}[case.dtype]

    def close(got: torch.Tensor, exp: torch.Tensor, what: str) -> None:
        assert got.dtype == exp.dtype, what
        torch.testing.assert_close(got, exp, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")

    bounds = list(itertools.accumulate([_rows(case, r) for r in range(world.size)], initial=0))
    for r, got in enumerate(res):
        lo, hi = bounds[r], bounds[r + 1]
        close(got["y"], want["y"][lo:hi], f"rank {r} output")
        close(got["dx"], want["dx"][lo:hi], f"rank {r} input grad")
        close(got["eval_y"], want["eval_y"][lo:hi], f"rank {r} eval output")
        assert got["buffers"].keys() == want["buffers"].keys()
        for k, v in want["buffers"].items():
            close(got["buffers"][k], v, f"rank {r} {k}")
    if case.affine:  # weight/bias grads stay local (the optimizer averages them): sum them
        close(sum(g["dw"] for g in res), want["dw"], "weight grad")
        close(sum(g["db"] for g in res), want["db"], "bias grad")
