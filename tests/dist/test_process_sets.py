"""Process sets, join and name matching: Horovod's semantics on 2 and 3 real gloo ranks.

One world per size runs the cases in order and records values (or errors) per rank:

* dynamic process sets: every rank adds an "evens" and an "odds" set; each rank runs
  allreduce, allgather, broadcast (root = the set's last global rank), alltoall,
  reducescatter, grouped allreduce, broadcast_object and barrier on its own set; a rank
  outside a set that calls a collective on it gets ValueError; removing the sets frees them;
* ``hvd.init(process_sets=[ps])`` after a shutdown registers ``ps`` (the suite never calls it);
* join: the last rank joins first; the others' allreduces complete with its zeros (an average
  divides by the world size) and ``join`` returns the same last joiner on every rank; an
  allgather while a rank has joined fails on the caller (as in Horovod);
* duplicate names: a second in-flight collective with the same name raises ValueError on the
  rank that submitted it, without disturbing the others.
"""

from __future__ import annotations

from typing import Any

import pytest

FAST_ENV = {"HORA_TIMEOUT": "5"}


def _err(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "msg": str(e)}


def _sets(hvd: Any, torch: Any, rank: int, size: int) -> dict[str, Any]:
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(list(range(1, size, 2)))
    mine = evens if rank % 2 == 0 else odds
    other = odds if mine is evens else evens
    ranks = mine.ranks
    out: dict[str, Any] = {
        "ids": [evens.process_set_id, odds.process_set_id],
        "set_rank": mine.rank(),
        "set_size": mine.size(),
        "included": [evens.included(), odds.included()],
        "ranks": ranks,
    }
    x = torch.tensor([float(rank + 1)])
    out["allreduce"] = hvd.allreduce(x, op=hvd.Sum, process_set=mine).item()
    out["average"] = hvd.allreduce(x, process_set=mine).item()
    out["allgather"] = hvd.allgather(torch.full((rank + 1,), rank), process_set=mine).tolist()
    out["broadcast"] = hvd.broadcast(torch.tensor([rank]), ranks[-1], process_set=mine).item()
    rows = torch.arange(len(ranks) * 2, dtype=torch.float32) + 100 * rank
    got, splits = hvd.alltoall(rows, splits=[2] * len(ranks), process_set=mine)
    out["alltoall"] = (got.tolist(), splits.tolist())
    block = hvd.reducescatter(torch.ones(len(ranks) * 2), op=hvd.Sum, process_set=mine)
    out["reducescatter"] = block.tolist()
    a, b = hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], op=hvd.Sum, process_set=mine)
    out["grouped"] = [a.tolist(), b.tolist()]
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=ranks[0], process_set=mine)
    hvd.barrier(process_set=mine)
    try:
        hvd.allreduce(x, process_set=other)
        out["outsider"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        out["outsider"] = _err(e)
    out["removed"] = [hvd.remove_process_set(odds), hvd.remove_process_set(evens)]
    out["removed_again"] = hvd.remove_process_set(evens)
    return out


def _join(hvd: Any, torch: Any, rank: int, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    last = size - 1
    if rank == last:
        out["join"] = hvd.join()
    else:
        h = hvd.allreduce_async(torch.full((4,), float(rank + 1)), name="join.a")
        out["served"] = hvd.synchronize(h).tolist()
        try:
            hvd.allgather(torch.ones(1), name="join.gather")
            out["gather"] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            out["gather"] = _err(e)
        try:  # a joined rank cannot rebuild a 7-d shape from the 6 dimensions a signature keeps
            hvd.allreduce(torch.ones([1] * 7), name="join.7d")
            out["seven_d"] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            out["seven_d"] = _err(e)
        out["join"] = hvd.join()
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.after").item()
    return out


def _duplicate(hvd: Any, torch: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t = torch.ones(3)
    if rank == 0:
        first = hvd.allreduce_async(t, op=hvd.Sum, name="dup")
        try:
            hvd.allreduce_async(t, op=hvd.Sum, name="dup")
            out["second"] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            out["second"] = _err(e)
        hvd.barrier()
    else:  # submitted after rank 0's barrier started: matched by name, not by order
        hvd.barrier()
        first = hvd.allreduce_async(t, op=hvd.Sum, name="dup")
    out["first"] = hvd.synchronize(first).tolist()
    return out


def _rank_body(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch

    hvd.init()
    res = {"sets": _sets(hvd, torch, rank, size), "join": _join(hvd, torch, rank, size)}
    res["duplicate"] = _duplicate(hvd, torch, rank)
    hvd.shutdown()
    static = hvd.ProcessSet([size - 1])
    hvd.init(process_sets=[static])
    try:
        hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=hvd.ProcessSet([0]))
        res["unregistered"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        res["unregistered"] = _err(e)
    res["static"] = [static.process_set_id, static.included()]
    if static.included():
        res["static"].append(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=static).item())
    hvd.barrier()
    hvd.shutdown()
    return res


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest, run_world: Any) -> list[dict[str, Any]]:
    return run_world(__file__, "_rank_body", request.param, env=FAST_ENV, timeout=120)  # type: ignore[no-any-return]


def test_collectives_run_on_the_callers_process_set(world: list[dict[str, Any]]) -> None:
    size = len(world)
    for rank, r in enumerate(world):
        s = r["sets"]
        ranks = list(range(rank % 2, size, 2))
        assert s["ids"] == [1, 2]
        assert s["ranks"] == ranks and s["set_size"] == len(ranks)
        assert s["set_rank"] == ranks.index(rank)
        assert s["included"] == [rank % 2 == 0, rank % 2 == 1]
        total = float(sum(m + 1 for m in ranks))
        assert s["allreduce"] == total
        assert s["average"] == pytest.approx(total / len(ranks))
        assert s["allgather"] == [m for m in ranks for _ in range(m + 1)]
        assert s["broadcast"] == ranks[-1]
        me = ranks.index(rank)
        expect = [float(100 * m + 2 * me + k) for m in ranks for k in range(2)]
        assert s["alltoall"] == (expect, [2] * len(ranks))
        assert s["reducescatter"] == [float(len(ranks))] * 2
        assert s["grouped"] == [[float(len(ranks))] * 2, [float(len(ranks))] * 3]
        assert s["object"] == {"from": ranks[0]}


def test_a_rank_outside_a_set_is_refused_and_sets_are_removed(
    world: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(world):
        s = r["sets"]
        assert s["outsider"]["type"] == "ValueError", f"rank {rank}: {s['outsider']}"
        assert f"rank {rank} is not in the process set" in s["outsider"]["msg"]
        assert s["removed"] == [True, True] and s["removed_again"] is False
        assert r["unregistered"]["type"] == "ValueError", r["unregistered"]
        assert "add_process_set" in r["unregistered"]["msg"]
        last = len(world) - 1
        assert r["static"] == ([1, True, 1.0] if rank == last else [1, False])


def test_a_joined_rank_serves_allreduce_with_zeros(world: list[dict[str, Any]]) -> None:
    size = len(world)
    last = size - 1
    for rank, r in enumerate(world):
        j = r["join"]
        assert j["join"] != last, "join() returns the last rank to join, not the first"
        assert j["join"] == world[0]["join"]["join"], "every rank gets the same last joiner"
        assert j["after"] == float(size), "the world works after join"
        if rank != last:
            expected = sum(m + 1 for m in range(size - 1)) / size
            assert j["served"] == [pytest.approx(expected)] * 4
            assert j["gather"]["type"] == "UnsupportedError", j["gather"]
            assert "joined" in j["gather"]["msg"]
            assert j["seven_d"]["type"] == "UnsupportedError", j["seven_d"]
            assert "7-d" in j["seven_d"]["msg"]


def test_a_duplicate_in_flight_name_raises_on_its_rank_only(world: list[dict[str, Any]]) -> None:
    size = len(world)
    for rank, r in enumerate(world):
        d = r["duplicate"]
        assert d["first"] == [float(size)] * 3
        if rank == 0:
            assert d["second"]["type"] == "ValueError", d["second"]
            assert "'dup' is already in flight" in d["second"]["msg"]


def _unnegotiated(rank: int, size: int) -> dict[str, Any]:
    import time

    import hora.torch as hvd
    import torch

    hvd.init()
    if rank == 0:
        time.sleep(0.3)
    last = hvd.join()
    total = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum).tolist()
    hvd.shutdown()
    return {"last": last, "total": total}


def test_without_negotiation_calls_run_in_order_and_join_waits(run_world: Any) -> None:
    """``HORA_CHECK_TENSORS=off``: no rounds; join still waits and names the last rank."""
    out = run_world(__file__, "_unnegotiated", 2, env={**FAST_ENV, "HORA_CHECK_TENSORS": "off"})
    for r in out:
        assert r["last"] == 0, "rank 0 arrived 0.3 s late: it is the last to join"
        assert r["total"] == [1.0, 1.0]
