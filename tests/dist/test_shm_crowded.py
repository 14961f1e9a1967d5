"""Ranks that outnumber their CPUs take bigger shared-memory slots (hora.torch._cpus, _shm).

Two real gloo ranks, each setting its own CPU affinity before ``hvd.init()``:

* both pinned to the same CPU (two ranks, one CPU: crowded): the set's ring and its lane have
  the crowded slot (8 MiB), whether the ring is set up through the engine's first round
  (``hora.torch._hier.ring_of``, the CPUs told with the hosts) or directly
  (``hora.torch._shm.ring_of``, the members asking each other); a tensor of 2.5 slots and a
  DistributedOptimizer bucket reduce to gloo's sum exactly, with the same bits on every rank;
* each pinned to a CPU of its own (needs 2 CPUs; CI has 2): every rank alone has one CPU, but
  together they have two, so the set is not crowded and keeps the usual 4 MiB slot;
* four ranks posing as two hosts (``HORA_HOST_KEY``, the hierarchical path): the two ranks of
  the first host pinned to one CPU, those of the second to a CPU each; each host decides for
  itself (8 MiB slots on the first, 4 MiB on the second), and a gradient bucket of 2.5 of the
  bigger slots through both hosts averages like gloo.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


def _pin(rank: int, spread: bool) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)] if spread else cpus[0]})


def _rank_body(rank: int, size: int, spread: bool, direct: bool) -> dict[str, Any]:
    _pin(rank, spread)
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch import _shm
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    comm = comm_of(None, "test")
    if direct:
        ring = _shm.ring_of(comm, "test")
    else:
        hvd.allreduce(torch.ones(1), name="set-up")  # the engine's first round sets it up
        ring = comm.shm
    assert ring is not None, "the ring is not available on this machine"
    out: dict[str, Any] = {"slot": ring.slot, "lane_slot": comm.shm_lane.ring.slot}
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(ring.slot // 4 * 5 // 2, generator=g)
    ref = mine.clone()
    dist.all_reduce(ref)
    before = ring.ops
    ring.allreduce_(mine, "allreduce", "big")
    out["chunks_barriers"] = ring.ops - before
    out["equal_to_gloo"] = bool(torch.equal(mine, ref))
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine)
    out["same_on_every_rank"] = all(torch.equal(e, mine) for e in every)
    p = torch.nn.Parameter(torch.zeros(3_000_000))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)])
    p.grad = torch.full_like(p, float(rank + 1))
    opt.synchronize()
    out["bucket_mean"] = sorted(set(p.grad.tolist()))
    hvd.shutdown()
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["engine-round", "direct"])
def test_ranks_on_one_cpu_take_the_crowded_slot(run_world: Any, direct: bool) -> None:
    from hora.torch import _shm

    res = run_world(__file__, "_rank_body", 2, args=(False, direct), timeout=120)
    want = _shm.slot_bytes(2, crowded=True)
    assert want == 8 * 1024 * 1024 > _shm.slot_bytes(2)
    for r in res:
        assert (r["slot"], r["lane_slot"]) == (want, want), r
        assert r["chunks_barriers"] == 4  # 3 chunks of one slot: 4 barriers
        assert r["equal_to_gloo"] and r["same_on_every_rank"], r
        assert r["bucket_mean"] == [1.5], r


def test_ranks_on_cpus_of_their_own_keep_the_usual_slot(run_world: Any) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs 2 CPUs (CI's machine has 2)")
    from hora.torch import _shm

    res = run_world(__file__, "_rank_body", 2, args=(True, False), timeout=120)
    for r in res:
        assert (r["slot"], r["lane_slot"]) == (_shm.slot_bytes(2),) * 2, r
        assert r["equal_to_gloo"] and r["same_on_every_rank"], r


def _hier_body(rank: int, size: int) -> dict[str, Any]:
    os.environ["HORA_HOST_KEY"] = f"node{rank // 2}"
    _pin(rank, spread=rank >= 2)
    import hora.torch as hvd
    import torch
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    numel = 8 * 1024 * 1024 // 4 * 5 // 2
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)])
    p.grad = torch.full_like(p, float(rank + 1))
    opt.synchronize()
    ring = comm_of(None, "test").shm
    out = {"kind": type(ring).__name__, "mean": sorted(set(p.grad.tolist()))}
    out["slot"] = ring.local.slot if ring.local is not None else 0
    hvd.shutdown()
    return out


def test_each_host_of_a_hierarchical_world_decides_for_itself(run_world: Any) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs 2 CPUs (CI's machine has 2)")
    from hora.torch import _shm

    res = run_world(__file__, "_hier_body", 4, timeout=180)
    assert [r["kind"] for r in res] == ["Hier"] * 4
    big, usual = _shm.slot_bytes(2, crowded=True), _shm.slot_bytes(2)
    assert [r["slot"] for r in res] == [big, big, usual, usual]
    assert all(r["mean"] == [2.5] for r in res), res
