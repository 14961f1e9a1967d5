"""Hierarchical allreduce (hora.torch._hier) on 4 and 3 real gloo ranks posing as 2 hosts.

Each rank names its host with ``HORA_HOST_KEY`` (``node0`` for ranks 0-1, ``node1`` for the
rest), so the world spans two "hosts" on one machine: every host's ranks share a segment
and the leaders (ranks 0 and 2, or 0 and 2 alone on its host) reduce over gloo. Checked:

* the DistributedOptimizer reduces its CPU buckets through the hierarchical path (the
  comm's ring is a ``Hier``; the leaders' flag is right) and three SGD steps end, on every
  rank with the same bits, where the flat gloo path ends (within rounding: another order
  of summation);
* bucket tensors of two dtypes and sizes (chunked beyond a slot) sum like gloo does;
* ``HORA_HIERARCHICAL_ALLREDUCE=0`` on one rank only: no member uses it (they decide
  together) and the flat result is the same;
* a rank whose process exits mid-training: every survivor fails well within the group
  timeout; its host's leader names it, the other host's ranks name that leader, then it.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(400)


def _pose(rank: int, hosts: list[str]) -> None:
    os.environ["HORA_HOST_KEY"] = hosts[rank]


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _train(hvd: Any, torch: Any, rank: int, steps: int = 3) -> tuple[Any, Any]:
    model = _model(torch)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _train_body(rank: int, size: int, hosts: list[str], off_rank: int) -> dict[str, Any]:
    _pose(rank, hosts)
    if rank == off_rank:
        os.environ["HORA_HIERARCHICAL_ALLREDUCE"] = "0"
    import hora.torch as hvd
    import torch
    import torch.distributed as dist
    from hora.torch._process_sets import comm_of

    hvd.init()
    model, _ = _train(hvd, torch, rank)
    ring = comm_of(None, "test").shm
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat)
    out: dict[str, Any] = {
        "kind": type(ring).__name__,
        "leader": getattr(ring, "leader", None),
        "same_on_every_rank": all(torch.equal(e, flat) for e in every),
        "weights": flat.tolist(),
    }
    if type(ring).__name__ == "Hier":
        out["sums"] = _sums(hvd, torch, dist, ring, rank)
    hvd.shutdown()
    return out


def _sums(hvd: Any, torch: Any, dist: Any, ring: Any, rank: int) -> dict[str, Any]:
    """Tensors of several dtypes and sizes through the path, against gloo's allreduce."""
    res = {}
    from hora.torch import _shm

    slot = _shm.slot_bytes(2)  # every host here has at most 2 ranks: chunked past one slot
    for dtype in (torch.float32, torch.int64):
        for numel in (7, slot // dtype.itemsize * 5 // 2):
            g = torch.Generator().manual_seed(100 + rank)
            mine = (torch.randn(numel, generator=g) * 100).to(dtype)
            ref = mine.clone()
            dist.all_reduce(ref)
            ring.allreduce_(mine, "allreduce", f"{dtype}.{numel}")
            every = [torch.empty_like(mine) for _ in range(hvd.size())]
            dist.all_gather(every, mine)
            res[f"{dtype}/{numel}"] = (
                all(torch.equal(e, mine) for e in every),
                float((mine.double() - ref.double()).abs().max()),
            )
    return res


@pytest.mark.parametrize(
    "hosts", [["node0", "node0", "node1", "node1"], ["node0", "node0", "node1"]],
    ids=["2x2", "2+1"],
)
def test_buckets_go_through_each_host_then_across_and_match_the_flat_path(
    hosts: list[str], run_world: Any
) -> None:
    n = len(hosts)
    hier = run_world(__file__, "_train_body", n, args=(hosts, -1), timeout=180)
    assert [r["kind"] for r in hier] == ["Hier"] * n
    assert [r["leader"] for r in hier] == [True, False, True, False][:n]
    assert all(r["same_on_every_rank"] for r in hier)
    if n == 4:  # the flat path once: one rank says no, nobody uses it, the weights agree
        flat = run_world(__file__, "_train_body", n, args=(hosts, n - 1), timeout=180)
        assert [r["kind"] for r in flat] == ["NoneType"] * n
        assert all(r["same_on_every_rank"] for r in flat)
        for a, b in zip(hier[0]["weights"], flat[0]["weights"], strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    for key, (same, diff) in hier[0]["sums"].items():
        assert same, key
        assert diff <= (0 if "int" in key else 1e-3), (key, diff)


def _dies_body(rank: int, size: int, hosts: list[str]) -> dict[str, Any]:
    _pose(rank, hosts)
    import hora.torch as hvd
    import torch

    hvd.init()
    _train(hvd, torch, rank, steps=1)
    if rank == 3:
        os._exit(3)
    t0 = time.monotonic()
    try:
        _train(hvd, torch, rank, steps=5)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "msg": str(e), "after_s": time.monotonic() - t0}


def test_a_rank_that_exits_is_named_on_every_survivor_without_waiting_the_timeout() -> None:
    codes, survivors = _world_with_a_death(["node0", "node0", "node1", "node1"])
    assert codes == [0, 0, 0, 3], codes
    for r in survivors:
        assert r["error"] is not None and r["after_s"] < 30, r  # the group timeout is 60 s
    # rank 2 shares a host with rank 3: it names it; node0's ranks name node1's leader
    # first, and rank 3 after it
    assert survivors[2]["msg"].startswith("rank 3 failed"), survivors[2]
    for r in survivors[:2]:
        assert re.match(r"rank [23] failed", r["msg"]) and "3" in r["msg"], r


def _world_with_a_death(hosts: list[str]) -> tuple[list[int], list[dict[str, Any]]]:
    """Run ``_dies_body`` on 4 ranks; their exit codes and the survivors' results."""
    import pickle
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from helpers.world import CHILD, base_env, free_port
    from hora.env import rank_env

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hora-hier-") as tmp:
        args = Path(tmp, "args.pkl")
        args.write_bytes(pickle.dumps((hosts,)))
        procs = []
        for r in range(4):
            env = base_env({"HORA_TIMEOUT": "60"})
            env.update(rank_env(r, 4, master_port=port))
            cmd = [sys.executable, str(CHILD), __file__, "_dies_body", str(args),
                   str(Path(tmp, f"out{r}.pkl"))]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
        try:
            codes = [p.wait(timeout=90) for p in procs]
        finally:
            for p in procs:
                p.kill()
        return codes, [pickle.loads(Path(tmp, f"out{r}.pkl").read_bytes()) for r in range(3)]
