"""barrier, join, the object collectives and the metric helpers (autograd: test_autograd.py).

Part of the shared world of 2 and 3 ranks (conftest.py): ``suite`` runs on every rank and
each test checks one aspect of the returned results. Timing matters for barrier and join:
one rank arrives 0.5 s late on purpose, and the others must have waited for it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch


# ------------------------------------------------------------------------- rank side
def _run_objects(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """barrier, join, broadcast_object and allgather_object, with timing where it matters."""
    last = size - 1
    res: dict[str, Any] = {}
    res["bcast_obj_0"] = hvd.broadcast_object({"from": rank, "lr": [0.1, rank]}, root_rank=0)
    res["bcast_obj_last"] = hvd.broadcast_object(("r", rank) if rank == last else None, last)
    res["gather_obj"] = hvd.allgather_object({"rank": rank, "sq": rank * rank})
    res["gather_obj_named"] = hvd.allgather_object(list(range(rank)), name="ranges")
    if rank == 0:
        time.sleep(0.5)
    t0 = time.monotonic()
    res["barrier_ret"] = hvd.barrier()
    res["barrier_wait"] = time.monotonic() - t0
    if rank == 0:
        time.sleep(0.5)
    res["join_first"] = hvd.join()
    if rank == last:
        time.sleep(0.5)
    res["join_second"] = hvd.join()
    # the world still works after join: one more allreduce
    res["after_join"] = float(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum))
    return res


def _run_metrics(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """The hora extensions in __all__: allreduce_metrics and Metric."""
    values = {"loss": float(rank), "acc": torch.tensor([rank, 2.0 * rank])}
    m = hvd.Metric("val_loss")
    m.update(float(rank + 1), n=rank + 1)  # uneven sample counts: a weighted average
    m.update(torch.tensor([0.0, 2.0]), n=1)
    return {
        "avg": hvd.allreduce_metrics(values),
        "max": hvd.allreduce_metrics(values, op=hvd.Max),
        "scalar": hvd.allreduce_metrics(3.5 * rank, op=hvd.Sum),
        "metric": m.avg,
    }


def suite(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """Run every part on this rank (called by the shared world, after ``hvd.init()``)."""
    return {
        "objects": _run_objects(hvd, rank, size),
        "metrics": _run_metrics(hvd, rank, size),
    }


# ------------------------------------------------------------------------ test side
def test_broadcast_object_and_allgather_object(world: Any) -> None:
    n, by_rank = world.size, world.results(__file__)
    for r in by_rank:
        o = r["objects"]
        assert o["bcast_obj_0"] == {"from": 0, "lr": [0.1, 0]}
        assert o["bcast_obj_last"] == ("r", n - 1)
        assert o["gather_obj"] == [{"rank": i, "sq": i * i} for i in range(n)]
        assert o["gather_obj_named"] == [list(range(i)) for i in range(n)]


def test_barrier_blocks_until_every_rank_arrives(world: Any) -> None:
    for rank, r in enumerate(world.results(__file__)[1:], start=1):
        assert r["objects"]["barrier_ret"] is None
        # rank 0 arrived 0.5 s late: everyone else waited for it
        assert r["objects"]["barrier_wait"] > 0.25, f"rank {rank} left the barrier early"


def test_join_returns_the_last_rank_to_join(world: Any) -> None:
    n, by_rank = world.size, world.results(__file__)
    assert [r["objects"]["join_first"] for r in by_rank] == [0] * n
    assert [r["objects"]["join_second"] for r in by_rank] == [n - 1] * n
    assert [r["objects"]["after_join"] for r in by_rank] == [float(sum(range(n)))] * n


def test_allreduce_metrics_and_metric(world: Any) -> None:
    n = world.size
    for r in world.results(__file__):
        m = r["metrics"]
        assert m["avg"]["loss"] == pytest.approx(sum(range(n)) / n)
        assert m["avg"]["acc"].tolist() == pytest.approx([sum(range(n)) / n, 2 * sum(range(n)) / n])
        assert str(m["avg"]["acc"].dtype) == "torch.float32"
        assert m["max"]["loss"] == float(n - 1)
        assert m["scalar"] == pytest.approx(3.5 * sum(range(n)))
        total = sum((k + 1) * (k + 1) + 1.0 for k in range(n))  # value x count, plus 1 x 1
        assert m["metric"] == pytest.approx(total / sum(k + 2 for k in range(n)))
