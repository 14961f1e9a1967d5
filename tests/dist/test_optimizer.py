"""DistributedOptimizer on 2 and 3 gloo ranks ends where one process on the whole batch ends.

Every rank trains the same small model on its slice of a fixed global batch; averaging the
gradients over ranks must reproduce single-process training on the concatenated batch. The
shared world of each size (conftest.py) runs every case (``suite``); each case is one test
that trains the reference in the test process and compares the final parameters (and the
optimizer state).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

GLOBAL_BATCH = 12  # divisible by every world size tested
STEPS = 3
LR = {"sgd": 0.1, "adam": 0.01}
EXACT = 1e-5  # float32 sums in another order
# fp16 keeps 11 significant bits: each reduced gradient is off by <= 2**-11 relative, so after
# 3 momentum-SGD steps at lr 0.1 the parameters move < 1e-3 away; bf16 keeps 8 bits: < 1e-2.
COMPRESSED = {"fp16": 1e-3, "bf16": 1e-2}


@dataclass(frozen=True)
class TrainCase:
    """One training run; the fields switch on the DistributedOptimizer feature under test."""

    name: str
    opt: str = "sgd"
    passes: int = 1
    compression: str = "none"
    clip: bool = False
    unused: bool = False
    sched: bool = False
    resume: bool = False
    predivide: float = 1.0
    fusion: int | None = None  # bytes per fusion bucket; 0: one bucket per gradient
    embed: bool = False  # add an nn.Embedding with sparse gradients
    momentum: float = 0.9

    def __str__(self) -> str:
        return self.name


CASES = [
    TrainCase("sgd-momentum"),
    TrainCase("adam", opt="adam"),
    TrainCase("sgd-accumulate2", passes=2),
    TrainCase("adam-accumulate2", opt="adam", passes=2),
    TrainCase("sgd-fp16", compression="fp16"),
    TrainCase("sgd-bf16", compression="bf16"),
    TrainCase("adam-fp16", opt="adam", compression="fp16"),
    TrainCase("sgd-clip-skip-synchronize", clip=True),
    TrainCase("sgd-unused-param-on-some-ranks", unused=True),
    TrainCase("sgd-steplr", sched=True),
    TrainCase("sgd-resume-state-dict", resume=True),
    TrainCase("sgd-predivide", predivide=2.0),
    TrainCase("sgd-unused-bucket-per-grad", unused=True, fusion=0),
    TrainCase("adam-accumulate2-bucket-per-grad", opt="adam", passes=2, fusion=0),
    TrainCase("sgd-fp16-small-buckets", compression="fp16", fusion=64),
    TrainCase("sgd-fp16-predivide", compression="fp16", predivide=2.0),
    TrainCase("sgd-bf16-predivide-bucket-per-grad", compression="bf16", predivide=2.0, fusion=0),
    TrainCase("sgd-sparse-embedding", embed=True, momentum=0.0),
]


class Net(nn.Module):
    """A small MLP; for ``case.unused`` a head only odd ranks use and one that no rank uses;
    for ``case.embed`` an embedding with sparse gradients added to the input.
    """

    def __init__(self, case: TrainCase) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        if case.unused:
            self.extra = nn.Linear(4, 2)
            self.never = nn.Linear(4, 2)
        if case.embed:
            self.emb = nn.Embedding(10, 4, sparse=True)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _loss(model: Net, case: TrainCase, rank: int, x: torch.Tensor, y: torch.Tensor) -> Any:
    if case.embed:
        x = x + model.emb((x[:, 0].abs() * 3).long() % 10)
    out = model.body(x)
    if case.unused and rank % 2 == 1:
        out = out + model.extra(x)
    return F.mse_loss(out, y)


def _optimizer(case: TrainCase, params: Any) -> torch.optim.Optimizer:
    if case.opt == "adam":
        return torch.optim.Adam(params, lr=LR["adam"])
    return torch.optim.SGD(params, lr=LR["sgd"], momentum=case.momentum)


def _params(model: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _opt_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    sd = opt.state_dict()
    return {"state": copy.deepcopy(sd["state"]), "lrs": [g["lr"] for g in sd["param_groups"]]}


# ------------------------------------------------------------------------- rank side
def _rank_step(
    hvd: Any, model: Net, opt: Any, case: TrainCase, rank: int, size: int, step: int
) -> dict[str, Any]:
    x, y = _batch(step)
    per = GLOBAL_BATCH // size
    xr, yr = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    opt.zero_grad()
    info: dict[str, Any] = {}
    for xm, ym in zip(xr.chunk(case.passes), yr.chunk(case.passes), strict=True):
        (_loss(model, case, rank, xm, ym) / case.passes).backward()
    if case.clip:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        seq = hvd._state.current().seq
        with opt.skip_synchronize():
            opt.step()
        info["collectives_in_step"] = hvd._state.current().seq - seq
    else:
        opt.step()
    return info


def _wrap(hvd: Any, case: TrainCase, model: Net) -> Any:
    comp = getattr(hvd.Compression, case.compression)
    return hvd.DistributedOptimizer(
        _optimizer(case, model.parameters()),
        named_parameters=model.named_parameters(),
        compression=comp,
        backward_passes_per_step=case.passes,
        gradient_predivide_factor=case.predivide,
        fusion_threshold=case.fusion,
    )


def _train_case(hvd: Any, case: TrainCase, rank: int, size: int) -> dict[str, Any]:
    model = Net(case)
    opt = _wrap(hvd, case, model)
    base = torch.optim.Adam if case.opt == "adam" else torch.optim.SGD
    res: dict[str, Any] = {"isinstance": isinstance(opt, base)}
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.sched else None
    infos = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if case.resume and step == STEPS - 1:  # a new process would rebuild both
                fresh = Net(case)
                fresh.load_state_dict(model.state_dict())
                saved = opt.state_dict()
                model, opt = fresh, _wrap(hvd, case, fresh)
                opt.load_state_dict(saved)
            infos.append(_rank_step(hvd, model, opt, case, rank, size, step))
            if sched is not None:
                sched.step()
    res["warnings"] = [str(w.message) for w in caught]
    res["infos"] = infos
    res["params"] = _params(model)
    res["opt"] = _opt_state(opt)
    return res


def _misuse(hvd: Any) -> dict[str, Any]:
    """zero_grad() between backward() and step(), and one backward() too many."""
    model = Net(CASES[0])
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = _batch(0)
    res: dict[str, Any] = {}
    F.mse_loss(model.body(x), y).backward()
    try:
        opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        res["zero_grad"] = (type(e).__name__, str(e))
    opt.step()  # the reduction that was under way completes normally
    opt.zero_grad()
    F.mse_loss(model.body(x), y).backward()
    try:
        F.mse_loss(model.body(x), y).backward()
    except Exception as e:  # noqa: BLE001
        res["second_backward"] = (type(e).__name__, str(e))
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    res["params"] = _params(model)
    return res


def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Train every case on this rank (called by the shared world, after ``hvd.init()``)."""
    results: dict[str, Any] = {}
    for case in CASES:
        try:
            results[case.name] = _train_case(hvd, case, rank, size)
        except Exception as e:  # noqa: BLE001  (reported by the case's own test)
            results[case.name] = {"error": f"{type(e).__name__}: {e}"}
    results["misuse"] = _misuse(hvd)
    return results


# ------------------------------------------------------------------------ test side
def _reference(case: TrainCase, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One process, the concatenated batch, the plain optimizer."""
    model = Net(case)
    opt = _optimizer(case, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.sched else None
    per = GLOBAL_BATCH // size
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        if case.unused:  # ranks use different heads: the average of their losses
            losses = [
                _loss(model, case, r, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
                for r in range(size)
            ]
            loss = torch.stack(losses).mean()
        else:
            loss = _loss(model, case, 0, x, y)  # the whole batch at once
        loss.backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        if sched is not None:
            sched.step()
    return _params(model), _opt_state(opt)


def _case_results(world: Any, case: TrainCase) -> list[Any]:
    res = [r[case.name] for r in world.results(__file__)]
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(res) if "error" in r]
    assert not errors, "\n".join(errors)
    return res


def _assert_close(got: dict[str, Any], want: dict[str, Any], atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}"
        )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_single_process_on_concatenated_batch(world: Any, case: TrainCase) -> None:
    n = world.size
    want, want_opt = _reference(case, n)
    atol = COMPRESSED.get(case.compression, EXACT)
    res = _case_results(world, case)
    for r in res:
        _assert_close(r["params"], want, atol)
        assert r["opt"]["lrs"] == pytest.approx(want_opt["lrs"])
    # every rank holds exactly the same parameters, whatever the tolerance to the reference
    for r in res[1:]:
        _assert_close(r["params"], res[0]["params"], 0.0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrapped_optimizer_is_the_original_class_and_warns_nothing(
    world: Any, case: TrainCase
) -> None:
    for r in _case_results(world, case):
        assert r["isinstance"] is True
        assert r["warnings"] == []


def test_optimizer_state_matches_reference(world: Any) -> None:
    """Momentum buffers (SGD) and moments (Adam) equal the single-process ones."""
    n = world.size
    for case in (CASES[0], CASES[1], CASES[10]):
        _, want = _reference(case, n)
        for r in _case_results(world, case):
            got = r["opt"]["state"]
            assert sorted(got) == sorted(want["state"])
            for idx in want["state"]:
                _assert_close(got[idx], want["state"][idx], EXACT)


def test_step_inside_skip_synchronize_starts_no_collective(world: Any) -> None:
    case = next(c for c in CASES if c.clip)
    for r in _case_results(world, case):
        assert [i["collectives_in_step"] for i in r["infos"]] == [0] * STEPS


def test_misuse_raises_clear_errors_and_the_step_still_completes(world: Any) -> None:
    res = world.results(__file__)
    for r in res:
        name, msg = r["misuse"]["zero_grad"]
        assert name == "HoraError" and "before optimizer.step()" in msg
        name, msg = r["misuse"]["second_backward"]
        assert name == "GradientCountError" and "backward_passes_per_step=1" in msg
    for r in res[1:]:  # after the errors, every rank still applied the same update
        _assert_close(r["misuse"]["params"], res[0]["misuse"]["params"], 0.0)
