"""What goes through the shared-memory ring besides its own operations (hora.torch._shm).

In one healthy world per size (2 and 3 ranks):

* plain ``hvd.allreduce`` calls of CPU tensors move their data through the set's lane (its
  second ring, run by a thread: its barriers move) and end equal to
  gloo's ``all_reduce`` of the same tensors, with the same bits on every rank: dtypes
  float32/float64/float16/bfloat16/int64/int32/int16/uint8, ops Sum/Average/Min/Max/Product,
  a tensor larger than a slot (summed and averaged), out of place (the input is left as it
  was), a non-contiguous tensor in place, and a grouped allreduce;
* a blocking ``hvd.allreduce`` runs the lane's operations in the calling thread (its own and
  any queued before it, in launch order) instead of waking the lane's thread and sleeping;
* a rank that joined serves the others' allreduce through the lane with zeros;
* an ``allreduce_async`` progresses in the background: rank 0 submits it and then waits,
  without any hora call, for rank 1 to have its result (which needs rank 0's data);
* the DistributedOptimizer's buckets move into shared memory after the first step (the
  arena) and are reduced there: a gradient larger than ``SOLO_BYTES``, small ones, fp16
  compression; every rank ends with the same bits as DDP trained beside it (exactly at 2
  ranks), also when ``clip_grad_norm_`` changes the gradients in place after
  ``synchronize()`` (no rank reads another's bucket by then).

In a world of its own: when one member cannot map the arena, every member keeps the ring's
chunked path, the results are the same, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "uint8"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]


def _data(torch: Any, dtype: Any, numel: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(300 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 5, (numel,), generator=g).to(dtype)


def _gloo(torch: Any, dist: Any, hvd: Any, x: Any, op: str) -> Any:
    ref = x.clone() if x.dtype != torch.int16 else x.to(torch.int32)
    red = {"Min": dist.ReduceOp.MIN, "Max": dist.ReduceOp.MAX,
           "Product": dist.ReduceOp.PRODUCT}.get(op, dist.ReduceOp.SUM)
    dist.all_reduce(ref, op=red)
    ref = ref.to(x.dtype)
    if op == "Average":
        ref = ref / hvd.size() if ref.is_floating_point() else ref // hvd.size()
    return ref


def _compare(torch: Any, dist: Any, hvd: Any, got: Any, ref: Any) -> dict[str, Any]:
    raw = got.contiguous().reshape(-1).view(torch.uint8)  # bits, in a dtype gloo gathers
    every = [torch.empty_like(raw) for _ in range(hvd.size())]
    dist.all_gather(every, raw)
    diff = float((got.double() - ref.double()).abs().max()) if got.numel() else 0.0
    return {"same_bits": all(torch.equal(e, raw) for e in every), "diff": diff,
            "exact": bool(torch.equal(got, ref))}


def _plain(hvd: Any, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from hora.torch import _shm
    from hora.torch._process_sets import comm_of

    hvd.allreduce(torch.ones(1), name="first.round")  # the members decide on the ring here
    comm = comm_of(None, "test")
    ring = comm.shm_lane.ring
    out: dict[str, Any] = {"ring": isinstance(comm.shm, _shm.Ring), "cases": {}}
    for dname in DTYPES:
        dtype = getattr(torch, dname)
        for op in OPS:
            if op == "Average" and not dtype.is_floating_point:
                continue
            x = _data(torch, dtype, 37, rank)
            before = ring.epoch
            got = hvd.allreduce(x, op=getattr(hvd, op), name=f"{dname}.{op}")
            moved = ring.epoch - before
            out["cases"][f"{dname}/{op}"] = dict(
                _compare(torch, dist, hvd, got, _gloo(torch, dist, hvd, x, op)), moved=moved)
    big = _data(torch, torch.float32, ring.slot // 4 * 2 + 11, rank)
    keep = big.clone()
    got = hvd.allreduce(big, op=hvd.Sum, name="big")
    out["big"] = dict(_compare(torch, dist, hvd, got, _gloo(torch, dist, hvd, big, "Sum")),
                      input_kept=bool(torch.equal(big, keep)))
    got = hvd.allreduce(big, op=hvd.Average, name="big.average")
    out["big_average"] = _compare(torch, dist, hvd, got, _gloo(torch, dist, hvd, big, "Average"))
    grid = _data(torch, torch.float32, 48, rank).view(6, 8)
    ref = _gloo(torch, dist, hvd, grid[:, ::2].contiguous(), "Sum")
    hvd.allreduce_(grid[:, ::2], op=hvd.Sum, name="strided")
    out["strided"] = _compare(torch, dist, hvd, grid[:, ::2].contiguous(), ref)
    parts = [_data(torch, torch.float32, n, rank) for n in (3, 1000, 17)]
    got = hvd.grouped_allreduce(parts, op=hvd.Sum, name="grouped")
    refs = [_gloo(torch, dist, hvd, p, "Sum") for p in parts]
    out["grouped"] = [_compare(torch, dist, hvd, g, r) for g, r in zip(got, refs, strict=True)]
    return out


def _in_caller(hvd: Any, rank: int) -> dict[str, Any]:
    """Who runs the lane's operations of blocking calls, and their order after queued ones."""
    import threading

    import torch
    from hora.torch._process_sets import comm_of

    ring = comm_of(None, "test").shm_lane.ring
    ran_in: list[int] = []
    real = ring.allreduce_

    def probe(*args: Any, **kwargs: Any) -> Any:  # the real operation, its thread noted
        ran_in.append(threading.get_ident())
        return real(*args, **kwargs)

    ring.allreduce_ = probe
    try:
        blocking = [hvd.allreduce(torch.full((3,), rank + 1.0), op=hvd.Sum, name=f"blocking.{i}")
                    for i in range(10)]
        queued = [hvd.allreduce_async(torch.full((4,), float(rank + i)), op=hvd.Sum,
                                      name=f"queued.{i}") for i in range(3)]
        after = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, name="after.queued")
        queued_got = [hvd.synchronize(h).tolist() for h in queued]
    finally:
        del ring.allreduce_
    return {"in_caller": sum(t == threading.get_ident() for t in ran_in[:10]),
            "ran": len(ran_in), "blocking": [b.tolist() for b in blocking],
            "queued": queued_got, "after": after.tolist()}


def _served(hvd: Any, rank: int, size: int) -> list[float]:
    import torch

    if rank == size - 1:
        hvd.join()
        return []
    got = hvd.allreduce(torch.full((5,), rank + 1.0), op=hvd.Sum, name="served.by.joined")
    hvd.join()
    return got.tolist()  # type: ignore[no-any-return]


def _background(hvd: Any, rank: int) -> dict[str, Any]:
    import tempfile
    import time

    import torch

    token = hvd.broadcast_object(os.urandom(8).hex())
    flag = Path(tempfile.gettempdir()) / f"hora-test-lane-{token}"
    h = hvd.allreduce_async(torch.full((1000,), rank + 1.0), op=hvd.Sum, name="background")
    seen = ""
    if rank == 0:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:  # no hora call meanwhile
            time.sleep(0.01)
        seen = flag.read_text() if flag.exists() else ""
    got = hvd.synchronize(h)
    if rank == 1:
        flag.write_text(str(float(got[0])))
    hvd.barrier()
    if rank == 0:
        flag.unlink(missing_ok=True)
    return {"value": float(got[0]), "rank1_saw": seen}


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    # the first weight (600 x 2000 floats, 4.8 MB) is over SOLO_BYTES: reduced alone before
    return torch.nn.Sequential(torch.nn.Linear(600, 2000), torch.nn.ReLU(),
                               torch.nn.Linear(2000, 10))


def _train(hvd: Any, rank: int, compression: Any, clip: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    model, ref = _model(torch), _model(torch)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(40 + rank)
    x, y = torch.randn(8, 600, generator=g), torch.randint(0, 10, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy
    for _ in range(3):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.synchronize()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        loss(ddp(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    every = [torch.empty_like(mine) for _ in range(hvd.size())]
    dist.all_gather(every, mine)
    red = opt._hora  # noqa: SLF001  (the reducer: which path its buckets took)
    return {"arena": red.arena is not None, "passes": red.arena.passes if red.arena else 0,
            "shared": [b.shared for b in red.buckets],
            "same_bits": all(torch.equal(e, mine) for e in every),
            "rel_diff": float((mine - want).abs().max() / want.abs().max())}


def _rank_body(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    out = {
        "plain": _plain(hvd, rank),
        "in_caller": _in_caller(hvd, rank),
        "served": _served(hvd, rank, size),
        "background": _background(hvd, rank),
        "arena": _train(hvd, rank, hvd.Compression.none, clip=False),
        "arena_clip": _train(hvd, rank, hvd.Compression.none, clip=True),
        "arena_fp16": _train(hvd, rank, hvd.Compression.fp16, clip=False),
    }
    hvd.shutdown()
    return out


class _World:
    def __init__(self, by_rank: list[dict[str, Any]]) -> None:
        self.by_rank, self.size = by_rank, len(by_rank)

    def results(self, _file: str) -> list[dict[str, Any]]:
        return self.by_rank


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest, run_world: Any) -> _World:
    return _World(run_world(__file__, "_rank_body", request.param, timeout=240))


# ------------------------------------------------------------------------ test side
def test_plain_allreduce_goes_through_the_ring_and_sums_like_gloo(world: Any) -> None:
    n = world.size
    for rank, r in enumerate(world.results(__file__)):
        p = r["plain"]
        assert p["ring"], "the members did not set up a ring"
        assert len(p["cases"]) == len(DTYPES) * len(OPS) - 4  # no Average of integers
        for key, c in p["cases"].items():
            assert c["moved"] >= 1, (rank, key, c)  # the lane's barrier: the data's
            assert c["same_bits"], (rank, key)
            if n == 2 or not key.startswith(("float", "bfloat")):
                assert c["exact"], (rank, key, c)
            else:  # 3 floats summed in another order than gloo's: rounding only
                tol = {"float16": 5e-2, "bfloat16": 2e-1}.get(key.split("/")[0], 1e-5)
                assert c["diff"] <= tol, (rank, key, c)
        assert p["big"]["same_bits"] and p["big"]["input_kept"]
        assert p["big"]["exact"] or (n > 2 and p["big"]["diff"] < 1e-4), p["big"]
        avg = p["big_average"]  # each slice divided as it is summed, gloo's bits at 2 ranks
        assert avg["same_bits"] and (avg["exact"] or (n > 2 and avg["diff"] < 1e-5)), avg
        for c in [p["strided"], *p["grouped"]]:
            assert c["same_bits"] and (c["exact"] or (n > 2 and c["diff"] < 1e-4)), c


def test_a_blocking_allreduce_runs_the_lane_in_the_calling_thread_in_launch_order(
        world: Any) -> None:
    n = world.size
    tri = float(sum(range(n)))  # the ranks' own numbers summed
    for rank, r in enumerate(world.results(__file__)):
        c = r["in_caller"]
        assert c["ran"] == 14, c  # 10 blocking, 3 queued, 1 after them: each ran once
        # the worker is woken too and may take an operation first on a busy machine; the
        # calling thread takes the turn when it is free, so most of ten run there
        assert c["in_caller"] >= 5, c
        assert c["blocking"] == [[float(n * (n + 1) // 2)] * 3] * 10
        assert c["queued"] == [[tri + n * i] * 4 for i in range(3)], (rank, c)
        assert c["after"] == [tri] * 2


def test_a_joined_rank_serves_allreduce_through_the_ring(world: Any) -> None:
    n, by_rank = world.size, world.results(__file__)
    want = [float(sum(range(1, n)))] * 5  # ranks 0..n-2 give rank+1; the joined one zeros
    assert [r["served"] for r in by_rank] == [want] * (n - 1) + [[]]


def test_an_async_allreduce_progresses_without_hora_calls(world: Any) -> None:
    n, by_rank = world.size, world.results(__file__)
    want = float(sum(range(1, n + 1)))
    assert all(r["background"]["value"] == want for r in by_rank), by_rank
    assert by_rank[0]["background"]["rank1_saw"] == str(want)


def test_optimizer_buckets_are_reduced_in_shared_memory_like_ddp(world: Any) -> None:
    n = world.size
    for rank, r in enumerate(world.results(__file__)):
        for part in ("arena", "arena_clip", "arena_fp16"):
            got = r[part]
            assert got["arena"] and all(got["shared"]), (rank, part, got)
            assert got["passes"] == 2, (rank, part, got)  # step 1 went through the ring
            assert got["same_bits"], (rank, part)
            limit = 2e-3 if part == "arena_fp16" else (0.0 if n == 2 else 1e-5)
            assert got["rel_diff"] <= limit, (rank, part, got)


# -- the arena cannot be mapped by one member ---------------------------------------------------
def _no_arena_on_last_rank(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch
    from hora.torch import _shm

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="decide")  # the ring exists from here
    if rank == size - 1:
        _shm.open_segment = lambda *_a, **_k: None  # as in another IPC namespace
    out = _train(hvd, rank, hvd.Compression.none, clip=False)
    out["left"] = sorted(p.name for p in Path("/dev/shm").glob(f"hora-{os.getpid()}-*"))
    hvd.shutdown()
    return out


def test_without_an_arena_every_member_keeps_the_chunked_path(run_world: Any) -> None:
    results = run_world(__file__, "_no_arena_on_last_rank", 2, timeout=180)
    for got in results:
        assert not got["arena"] and not any(got["shared"]), got
        assert got["same_bits"] and got["rel_diff"] == 0.0, got
        assert got["left"] == [], got
