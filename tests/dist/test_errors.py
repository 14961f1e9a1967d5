"""Error paths of hora.torch on real gloo ranks: each fails fast and names who is at fault.

* every operation before ``init()`` raises NotInitializedError naming the operation;
* tensors whose shape or dtype differ across ranks raise TensorMismatchError on every rank,
  naming the tensor and the disagreeing ranks, and the world stays usable afterwards; a
  change after repeated identical calls (which skip the pre-check) is still named;
* a rank that never arrives at a collective or at ``join`` is named in
  CollectiveTimeout.missing_ranks, a rank that dies is named by RankFailedError (rank 0,
  the rendezvous store's host, included), each within the collective timeout
  (``HORA_TIMEOUT``, 3 s here) plus the stall check. A rank missing at the rendezvous is
  tested through ``hora run --start-timeout`` (test_launcher.py).

Processes cost seconds to start, so one world of 3 ranks goes through the phases in order
(before init, mismatches, an absent rank, a dying rank) and a world of 2 covers what needs
rank 0 to die; survivors print their results and leave without ``shutdown()``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SIZE = 3
LAST = SIZE - 1
TIMEOUT_S = 3.0
# The stall diagnosis reads the heartbeats twice, 1.05 s apart; the rest is a slow machine.
SLACK_S = 6.0
# Collectives time out in 3 s; the rendezvous keeps conftest's long HORA_START_TIMEOUT.
FAST_ENV = {"HORA_TIMEOUT": f"{TIMEOUT_S:g}"}


def _err(e: BaseException, t0: float) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "msg": str(e),
        "op": getattr(e, "op", None),
        "name": getattr(e, "name", None),
        "ranks": getattr(e, "ranks", None),
        "rank": getattr(e, "rank", None),
        "missing": getattr(e, "missing_ranks", None),
        "elapsed": time.monotonic() - t0,
    }


def _report(result: dict[str, Any], sync_dir: str, rank: int, wait_for: list[int]) -> None:
    """Print the result, wait until the ranks in ``wait_for`` reported too, and leave at once.

    Leaving at once: a world with a failed collective cannot shut down cleanly. Waiting: rank 0
    hosts the rendezvous store, and a rank still diagnosing after rank 0 exited can only report
    rank 0 as unreachable (that case has its own test, where rank 0 is the one that dies).
    """
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    Path(sync_dir, f"done{rank}").touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
        Path(sync_dir, f"done{r}").exists() for r in wait_for
    ):
        time.sleep(0.05)
    os._exit(0)


def _parse(outputs: list[tuple[int | None, str]], ranks: list[int]) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for r in ranks:
        code, out = outputs[r]
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert code == 0 and len(lines) == 1, f"rank {r} (exit {code}):\n{out[-3000:]}"
        found[r] = json.loads(lines[0].removeprefix("RESULT "))
    return found


# ------------------------------------------------------------------ before init()
def _before_init_calls(hvd: Any, torch: Any) -> dict[str, Any]:
    t = torch.ones(2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "allreduce": lambda: hvd.allreduce(t),
        "allreduce_": lambda: hvd.allreduce_(t),
        "allreduce_async": lambda: hvd.allreduce_async(t),
        "allreduce_async_": lambda: hvd.allreduce_async_(t),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t, t]),
        "grouped_allreduce_async_": lambda: hvd.grouped_allreduce_async_([t]),
        "allgather": lambda: hvd.allgather(t),
        "allgather_async": lambda: hvd.allgather_async(t),
        "broadcast": lambda: hvd.broadcast(t, 0),
        "broadcast_": lambda: hvd.broadcast_(t, 0),
        "broadcast_async_": lambda: hvd.broadcast_async_(t, 0),
        "alltoall": lambda: hvd.alltoall(t),
        "reducescatter": lambda: hvd.reducescatter(t),
        "barrier": hvd.barrier,
        "join": hvd.join,
        "broadcast_object": lambda: hvd.broadcast_object({"a": 1}),
        "allgather_object": lambda: hvd.allgather_object(1),
        "size": hvd.size,
        "rank": hvd.rank,
        "local_rank": hvd.local_rank,
        "local_size": hvd.local_size,
        "cross_rank": hvd.cross_rank,
        "DistributedOptimizer": lambda: hvd.DistributedOptimizer(opt),
        "broadcast_parameters": lambda: hvd.broadcast_parameters(model.state_dict(), 0),
        "broadcast_optimizer_state": lambda: hvd.broadcast_optimizer_state(opt, 0),
        "allreduce_metrics": lambda: hvd.allreduce_metrics({"loss": 1.0}),
        "SyncBatchNorm": lambda: hvd.SyncBatchNorm(2)(torch.ones(3, 2)),
        "start_timeline": lambda: hvd.start_timeline("/nonexistent/never-written.json"),
    }


BEFORE_INIT_OPS = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async_", "alltoall", "reducescatter", "barrier", "join", "broadcast_object",
    "allgather_object", "size", "rank", "local_rank", "local_size", "cross_rank",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "allreduce_metrics", "SyncBatchNorm", "start_timeline",
]  # fmt: skip


# ------------------------------------------------------------------ mismatches
# (case id, op, what differs on the last rank). Every case is followed by a good allreduce.
MISMATCHES = [
    ("allreduce-shape", "allreduce", "shape"),
    ("allreduce-dtype", "allreduce", "dtype"),
    ("allreduce-ndim", "allreduce", "ndim"),
    ("allreduce_-shape", "allreduce_", "shape"),
    ("allreduce_async-dtype", "allreduce_async", "dtype"),
    ("allreduce-op", "allreduce", "op"),
    ("grouped_allreduce-shape", "grouped_allreduce", "shape"),
    ("broadcast-shape", "broadcast", "shape"),
    ("broadcast-dtype", "broadcast", "dtype"),
    ("broadcast_-shape", "broadcast_", "shape"),
    ("broadcast-root", "broadcast", "root"),
    ("allgather-trailing", "allgather", "shape"),
    ("allgather-dtype", "allgather", "dtype"),
    ("alltoall-dtype", "alltoall", "dtype"),
    ("reducescatter-shape", "reducescatter", "shape"),
    ("broadcast_parameters-shape", "broadcast_parameters", "shape"),
]


def _mismatch_call(hvd: Any, torch: Any, op: str, what: str, odd: bool, name: str) -> Any:
    shape = {"shape": (3, 5), "ndim": (12,)}.get(what, (3, 4)) if odd else (3, 4)
    dtype = torch.float64 if odd and what == "dtype" else torch.float32
    t = torch.ones(shape, dtype=dtype)
    if op == "allreduce":
        return hvd.allreduce(t, name=name, op=hvd.Max if odd and what == "op" else hvd.Sum)
    if op == "allreduce_":
        return hvd.allreduce_(t, name=name)
    if op == "allreduce_async":
        return hvd.synchronize(hvd.allreduce_async(t, name=name))
    if op == "grouped_allreduce":
        return hvd.grouped_allreduce([torch.ones(2), t], name=name)
    if op == "broadcast":
        return hvd.broadcast(t, LAST if odd and what == "root" else 0, name=name)
    if op == "broadcast_":
        return hvd.broadcast_(t, 0, name=name)
    if op == "allgather":
        return hvd.allgather(t, name=name)
    if op == "alltoall":
        return hvd.alltoall(torch.ones((SIZE, 2), dtype=dtype), name=name)
    if op == "reducescatter":
        return hvd.reducescatter(t, name=name)
    hvd.broadcast_parameters({name: t}, root_rank=0)
    return None


def _mismatches(hvd: Any, torch: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"mismatch": {}, "after": {}}
    for case, op, what in MISMATCHES:
        t0 = time.monotonic()
        try:
            _mismatch_call(hvd, torch, op, what, rank == LAST, f"t.{case}")
            out["mismatch"][case] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            out["mismatch"][case] = _err(e, t0)
        # the world must still work after every mismatch
        out["after"][case] = float(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="ok"))
    return out


def _absent(hvd: Any, torch: Any) -> dict[str, Any]:
    """Collectives the last rank never enters (it is alive, waiting for a file)."""
    res: dict[str, Any] = {}
    for op, call in (
        ("join", hvd.join),
        ("barrier", hvd.barrier),
        ("allreduce", lambda: hvd.allreduce(torch.ones(2), name="grad.w")),
    ):
        t0 = time.monotonic()
        try:
            call()
            res[op] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            res[op] = _err(e, t0)
    return res


def _wait_files(sync_dir: str, names: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(Path(sync_dir, n).exists() for n in names):
        time.sleep(0.05)


def _rank_body_main(rank: int, size: int, sync_dir: str) -> None:
    import hora.torch as hvd
    import torch

    out: dict[str, Any] = {"before_init": {}}
    for op, call in _before_init_calls(hvd, torch).items():
        t0 = time.monotonic()
        try:
            call()
            out["before_init"][op] = {"type": "no error"}
        except Exception as e:  # noqa: BLE001
            out["before_init"][op] = _err(e, t0)
    hvd.init()
    out.update(_mismatches(hvd, torch, rank))
    survivors = list(range(size - 1))
    if rank == LAST:  # absent from the next collectives, then dead
        _wait_files(sync_dir, [f"absent{r}" for r in survivors])
        Path(sync_dir, "dying").touch()
        os._exit(17)
    out["absent"] = _absent(hvd, torch)
    Path(sync_dir, f"absent{rank}").touch()
    _wait_files(sync_dir, ["dying"])
    time.sleep(0.5)  # the last rank is gone by now
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(3), name="grad.after_death")
        out["dead"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        out["dead"] = _err(e, t0)
    _report(out, sync_dir, rank, survivors)


@pytest.fixture(scope="module")
def main_world(run_world: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    sync_dir = str(tmp_path_factory.mktemp("errors"))
    outputs = run_world(
        __file__,
        "_rank_body_main",
        SIZE,
        args=(sync_dir,),
        env=FAST_ENV,
        timeout=120,
        expect_failure=True,
    )
    assert outputs[LAST][0] == 17, outputs[LAST][1][-3000:]
    found = _parse(outputs, list(range(SIZE - 1)))
    return [found[r] for r in range(SIZE - 1)]


@pytest.mark.parametrize("op", BEFORE_INIT_OPS)
def test_every_op_before_init_raises_not_initialized(main_world: Any, op: str) -> None:
    for r in main_world:
        got = r["before_init"][op]
        assert got["type"] == "NotInitializedError", got
        assert "init()" in got["msg"]
        assert got["op"]  # the error names the operation that was called
        assert got["elapsed"] < 1.0


@pytest.mark.parametrize(("case", "op", "what"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatch_raises_naming_tensor_and_ranks(
    main_world: Any, case: str, op: str, what: str
) -> None:
    for rank, r in enumerate(main_world):  # the last rank's view is checked in the next test
        got = r["mismatch"][case]
        assert got["type"] == "TensorMismatchError", f"rank {rank}: {got}"
        assert got["name"] == f"t.{case}", got
        assert got["ranks"] == [0, LAST], got
        assert f"t.{case}" in got["msg"]
        assert got["elapsed"] < TIMEOUT_S, "found by the pre-check, not by a timeout"
        assert r["after"][case] == float(SIZE), "the world is usable after the error"


@pytest.mark.parametrize("op", ["join", "barrier", "allreduce"])
def test_absent_rank_is_named_in_missing_ranks(main_world: Any, op: str) -> None:
    for rank, r in enumerate(main_world):
        got = r["absent"][op]
        assert got["type"] == "CollectiveTimeout", f"rank {rank}: {got}"
        assert got["missing"] == [LAST], got
        assert got["op"] == op
        assert f"missing ranks: {LAST}" in got["msg"]
        assert got["elapsed"] < TIMEOUT_S + SLACK_S, got
    assert main_world[0]["absent"]["allreduce"]["name"] == "grad.w"


def test_dead_rank_is_named_within_timeout(main_world: Any) -> None:
    for rank, r in enumerate(main_world):
        got = r["dead"]
        assert got["type"] == "PeerFailedError", f"rank {rank}: {got}"
        assert got["rank"] == LAST, got
        assert got["elapsed"] < TIMEOUT_S + SLACK_S, got


def _rank_body_rank0_dies(rank: int, size: int, sync_dir: str) -> None:
    """Two ranks: a mismatch that skips the pre-check, then rank 0 (the store host) dies."""
    import hora.torch as hvd
    import torch

    out: dict[str, Any] = {}
    hvd.init()
    for _ in range(2):  # every rank agrees on this signature: later repeats skip the check
        hvd.allreduce(torch.ones(2), name="t.repeat")
    t0 = time.monotonic()
    try:  # rank 1 changes its shape and checks; rank 0 repeats and goes straight to the data
        hvd.allreduce(torch.ones(3 if rank == 1 else 2), name="t.repeat")
        out["repeat"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        out["repeat"] = _err(e, t0)
    if rank == 0:
        part = Path(sync_dir, "repeat0.part")  # whole or absent: rank 1 reads it once it exists
        part.write_text(json.dumps(out["repeat"]))
        os.replace(part, Path(sync_dir, "repeat0"))
        os._exit(17)
    _wait_files(sync_dir, ["repeat0"])
    out["repeat_rank0"] = json.loads(Path(sync_dir, "repeat0").read_text())
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(3), name="grad.after_death")
        out["dead"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        out["dead"] = _err(e, t0)
    _report(out, sync_dir, rank, [1])


@pytest.fixture(scope="module")
def rank0_world(run_world: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sync_dir = str(tmp_path_factory.mktemp("rank0"))
    outputs = run_world(
        __file__,
        "_rank_body_rank0_dies",
        2,
        args=(sync_dir,),
        env=FAST_ENV,
        timeout=90,
        expect_failure=True,
    )
    assert outputs[0][0] == 17, outputs[0][1][-3000:]
    return _parse(outputs, [1])[1]


def test_mismatch_after_repeated_calls_is_named_at_the_timeout(rank0_world: Any) -> None:
    for got in (rank0_world["repeat"], rank0_world["repeat_rank0"]):
        assert got["type"] == "TensorMismatchError", got
        assert got["name"] == "t.repeat"
        assert got["ranks"] == [0, 1], got
        assert got["elapsed"] < TIMEOUT_S + SLACK_S, got


def test_dead_rank0_store_host_is_named(rank0_world: Any) -> None:
    got = rank0_world["dead"]
    assert got["type"] == "PeerFailedError", got  # a RankFailedError that is Horovod's internal error
    assert got["rank"] == 0, got
    assert "rank 0" in got["msg"] and "grad.after_death" in got["msg"]
    assert got["elapsed"] < TIMEOUT_S + SLACK_S, got
