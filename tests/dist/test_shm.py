"""The same-host shared-memory allreduce (hora.torch._shm) on 2 and 3 real gloo ranks.

One healthy world per size checks, in order:

* the ring against gloo's own allreduce of the same tensors: dtypes float32/float64/float16/
  bfloat16/int64/int32, sizes 0, 1, 7, the last size of the one-barrier path (64 KiB) and one
  element more, a slot plus a few elements and 2.5 slots (chunked, odd counts that do not
  split evenly): every rank ends with the same bits, equal to gloo's sum
  (exactly for integers and for 2 ranks; within rounding for 3 floats, summed in another order);
* ``allgather_ints`` returns every member's list, and None on every member when one list is
  longer than a slot (the engine then falls back to gloo);
* members that reach different tensors (another size and name on the last rank) all raise
  TensorMismatchError naming the sizes, and the next reduction works on every rank;
* the DistributedOptimizer reduces its CPU buckets through the ring (its op counter moves),
  and three SGD steps end where one process training on every rank's batch ends;
* a plain ``hvd.allreduce`` negotiates through the ring (its round moves the counter);
* after ``shutdown()`` no segment file is left in /dev/shm;
* after ``init()`` again, with ``HORA_SHM=off`` on the last rank only: no member uses the ring
  (they decide together), and the optimizer's result is the same over gloo.

Failures, each in a world of its own:

* a member that never arrives: the others' reduction fails at the group timeout with
  CollectiveTimeout naming it;
* a member whose process exits: the others fail at once (well before the timeout) with
  RankFailedError naming it;
* a SIGINT while a member waits is held until the reduction ends (like a collective in C++),
  then raised; the members stay in step; the same while a blocking ``hvd.allreduce_`` runs
  the lane's operation in the main thread;
* a member that aborts its process group (as the notebook engines do to release a blocked
  peer): the others, waiting for it, fail at once with RankFailedError naming it;
* a member that passed a barrier and then left the ring (as after a deadlock both ranks
  found in the same round) still counts as arrived for a member that had not looked yet.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32"]


def _data(torch: Any, dtype: Any, numel: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def _ring_vs_gloo(hvd: Any, torch: Any, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from hora.torch import _shm, _shm_ops
    from hora.torch._process_sets import comm_of

    comm = comm_of(None, "test")
    ring = _shm.ring_of(comm, "test")
    assert ring is not None, "the ring is not available on this machine"
    out: dict[str, Any] = {"slot": ring.slot}
    for name in DTYPES:
        dtype = getattr(torch, name)
        per_slot = ring.slot // dtype.itemsize
        small = _shm_ops.SMALL_BYTES // dtype.itemsize  # the one-barrier path's last size
        for numel in (0, 1, 7, small, small + 1, per_slot + 5, per_slot * 5 // 2):
            mine = _data(torch, dtype, numel, rank)
            ref = mine.clone()
            dist.all_reduce(ref, group=comm.group)
            ring.allreduce_(mine, "allreduce", f"{name}.{numel}")
            # every rank's result, to compare bits across ranks
            every = [torch.empty_like(mine) for _ in range(hvd.size())]
            dist.all_gather(every, mine, group=comm.group)
            key = f"{name}/{numel}"
            out[key] = {
                "same_on_every_rank": all(torch.equal(e, mine) for e in every),
                "equal_to_gloo": bool(torch.equal(mine, ref)),
                "max_diff": float((mine.double() - ref.double()).abs().max()) if numel else 0.0,
            }
    out["ops"] = ring.ops
    # one member's table longer than a slot: every member gets None (the engine then uses gloo)
    cap = ring.slot // 8 - 1
    big = list(range(cap + 1)) if rank == 0 else [rank]
    out["too_long"] = ring.allgather_ints(big, "test", "too long")
    out["tables"] = ring.allgather_ints([rank, 7], "test", "tables")
    # members reaching different tensors: every member raises, and they stay in step
    odd = rank == hvd.size() - 1
    try:
        ring.allreduce_(torch.ones(12 if odd else 10), "allreduce", "b" if odd else "a")
        out["mismatch"] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = {"type": type(e).__name__, "msg": str(e)}
    after = torch.full((5,), float(rank))
    ring.allreduce_(after, "allreduce", "after")
    out["after_mismatch"] = after.tolist()
    return out


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def _batch(torch: Any, rank: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train(hvd: Any, torch: Any, rank: int) -> list[list[float]]:
    model = _model(torch)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = _batch(torch, rank)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _leftovers(pid: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"hora-{pid}-*"))


def _rank_body(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch
    from hora.torch._process_sets import comm_of

    torch.set_num_threads(1)
    hvd.init()
    res: dict[str, Any] = {"pid": os.getpid(), "ring": _ring_vs_gloo(hvd, torch, rank)}
    ring = comm_of(None, "test").shm
    before = ring.ops
    res["params"] = _train(hvd, torch, rank)
    res["optimizer_ring_ops"] = ring.ops - before
    before = ring.ops
    res["allreduce"] = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="through.a.round").tolist()
    res["round_ring_ops"] = ring.ops - before  # its negotiation round went through the ring
    res["files_in_use"] = len(_leftovers(os.getpid())) if rank == 0 else 0
    hvd.shutdown()
    res["files_after"] = _leftovers(os.getpid())
    if rank == size - 1:
        os.environ["HORA_SHM"] = "off"
    hvd.init()
    res["off_params"] = _train(hvd, torch, rank)
    res["off_ring"] = comm_of(None, "test").shm is not None
    hvd.shutdown()
    return res


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest, run_world: Any) -> list[dict[str, Any]]:
    return run_world(__file__, "_rank_body", request.param, timeout=180)  # type: ignore[no-any-return]


def test_ring_sums_like_gloo_with_the_same_bits_on_every_rank(
    world: list[dict[str, Any]],
) -> None:
    size = len(world)
    for rank, r in enumerate(world):
        cases = {k: v for k, v in r["ring"].items() if "/" in k}
        assert len(cases) == len(DTYPES) * 7
        mismatch = r["ring"]["mismatch"]
        assert mismatch["type"] == "TensorMismatchError", mismatch
        assert "reached different tensors" in mismatch["msg"], mismatch
        assert f"rank {size - 1}: 12 elements" in mismatch["msg"], mismatch
        assert r["ring"]["after_mismatch"] == [float(sum(range(size)))] * 5
        assert r["ring"]["too_long"] is None
        assert r["ring"]["tables"] == [[m, 7] for m in range(size)]
        for key, c in cases.items():
            assert c["same_on_every_rank"], (rank, key)
            exact = size == 2 or key.startswith("int")
            if exact:
                assert c["equal_to_gloo"], (rank, key, c["max_diff"])
            else:  # 3 floats summed in another order: rounding only
                tol = {"float16": 1e-2, "bfloat16": 1e-1}.get(key.split("/")[0], 1e-5)
                assert c["max_diff"] <= tol, (rank, key, c["max_diff"])
        # two chunked sizes per dtype ran more than one chunk each
        assert r["ring"]["ops"] > len(DTYPES) * 5


def test_optimizer_reduces_cpu_buckets_through_the_ring(world: list[dict[str, Any]]) -> None:
    import torch

    size = len(world)
    assert all(r["optimizer_ring_ops"] >= 3 for r in world)  # at least a bucket per step
    # reference: one process, every rank's batch, the mean of the per-rank losses
    model = _model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [_batch(torch, r) for r in range(size)]
    for _ in range(3):
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(model(x), y) for x, y in batches) / size
        loss.backward()
        opt.step()
    ref = [p.detach().reshape(-1) for p in model.parameters()]
    for r in world:
        assert r["params"] == world[0]["params"]  # the same bits on every rank
        for got, want in zip(r["params"], ref, strict=True):
            assert torch.allclose(torch.tensor(got), want, atol=1e-5), "diverged from reference"


def test_negotiation_rounds_go_through_the_ring(world: list[dict[str, Any]]) -> None:
    size = len(world)
    for r in world:
        assert r["allreduce"] == [float(size)] * 3
        assert r["round_ring_ops"] >= 1


def test_segment_file_is_gone_while_in_use_and_after_shutdown(
    world: list[dict[str, Any]],
) -> None:
    assert world[0]["files_in_use"] == 0  # unlinked once every member mapped it
    assert all(r["files_after"] == [] for r in world)
    assert not any(list(Path("/dev/shm").glob(f"hora-{r['pid']}-*")) for r in world)


def test_one_member_without_shm_makes_every_member_use_gloo(world: list[dict[str, Any]]) -> None:
    assert [r["off_ring"] for r in world] == [False] * len(world)
    for r in world:
        for a, b in zip(r["off_params"], world[0]["params"], strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6


# -- failures -----------------------------------------------------------------------------------
TIMEOUT_S = 3.0


def _rank_absent(rank: int, size: int, mode: str) -> None:
    import hora.torch as hvd
    import torch
    from hora.torch import _shm
    from hora.torch._process_sets import comm_of

    hvd.init()
    ring = _shm.ring_of(comm_of(None, "test"), "test")
    assert ring is not None
    if rank == size - 1:
        if mode == "exit":
            os._exit(0)  # noqa: SLF001  (the process dies without a word)
        if mode == "abort":  # what the notebook engines do to release a blocked peer
            time.sleep(1.0)
            from hora.torch import _state

            _state.abort()
            time.sleep(3)
            os._exit(0)
        time.sleep(TIMEOUT_S + 6)
        return
    t0 = time.monotonic()
    try:
        ring.allreduce_(torch.ones(10), "allreduce", "absent")
        got = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        got = {"type": type(e).__name__, "msg": str(e)}
    got["elapsed"] = time.monotonic() - t0
    print("RESULT " + json.dumps(got), flush=True)
    time.sleep(2)  # the other survivors see the absent rank first, not this one leaving
    os._exit(0)  # the world is broken: skip the exit handlers' waits


def _results(outputs: list[tuple[int | None, str]]) -> list[dict[str, Any]]:
    found = []
    for _code, out in outputs[:-1]:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-3000:]
        found.append(json.loads(lines[-1][len("RESULT "):]))
    return found


@pytest.mark.parametrize("size", [2, 3])
def test_a_member_that_never_arrives_is_named_at_the_timeout(run_world: Any, size: int) -> None:
    outputs = run_world(__file__, "_rank_absent", size, args=("late",), timeout=60,
                        env={"HORA_TIMEOUT": f"{TIMEOUT_S:g}"}, expect_failure=True)
    for got in _results(outputs):
        assert got["type"] == "CollectiveTimeout", got
        assert f"missing ranks: {size - 1}" in got["msg"], got
        assert TIMEOUT_S * 0.9 <= got["elapsed"] < TIMEOUT_S + 5, got


# how the last member goes away -> what the others' error says after "rank {last}"
GONE = {"exit": "", "abort": " failed: it left allreduce 'absent' early"}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("how", list(GONE))
def test_a_member_that_exits_or_aborts_its_group_is_named_at_once(
    run_world: Any, size: int, how: str
) -> None:
    outputs = run_world(__file__, "_rank_absent", size, args=(how,), timeout=90,
                        env={"HORA_TIMEOUT": "60"}, expect_failure=True)
    for got in _results(outputs):
        assert got["type"] == "PeerFailedError", got  # a RankFailedError that is Horovod's internal error
        assert f"rank {size - 1}{GONE[how]}" in got["msg"], got
        assert got["elapsed"] < 10, got  # the timeout is 60 s


def _interrupt_once_held(ring: Any, flag: Path) -> dict[str, float]:
    """From a thread: SIGINT this process once ``ring`` holds SIGINT, then touch ``flag``.

    Returns the dict where the thread notes when it sent it (``"at"``).
    """
    import signal
    import threading

    sent: dict[str, float] = {}

    def interrupt() -> None:
        while signal.getsignal(signal.SIGINT) != ring._note_sigint:
            time.sleep(0.005)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        flag.touch()

    threading.Thread(target=interrupt, daemon=True).start()
    return sent


def _rank_interrupted(rank: int, size: int) -> dict[str, Any]:
    import signal

    import hora.torch as hvd
    import torch
    from hora.torch import _shm
    from hora.torch._process_sets import comm_of

    # Python's own SIGINT handler, as in a terminal: a rank started from a background job
    # (a CI script's `cmd &`) inherits SIGINT ignored, and then no handler turns it into
    # KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hvd.init()
    ring = _shm.ring_of(comm_of(None, "test"), "test")
    assert ring is not None
    out: dict[str, Any] = {}
    t = torch.ones(4)
    # rank 0 is interrupted once its operation holds SIGINT (from a thread that watches for
    # it), and only then does rank 1 come (0.5 s later): the SIGINT always arrives during
    # the wait, however late a loaded machine runs the thread
    token = hvd.broadcast_object(uuid.uuid4().hex)
    flag = Path(tempfile.gettempdir()) / f"hora-test-sigint-{token}"
    if rank == 0:
        sent = _interrupt_once_held(ring, flag)
        try:
            ring.allreduce_(t, "allreduce", "held")
            out["first"] = {"type": "no error"}
        except KeyboardInterrupt:
            out["first"] = {"type": "KeyboardInterrupt"}
        out["waited"] = time.monotonic() - sent["at"]
    else:
        deadline = time.monotonic() + 30
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        flag.unlink()
        time.sleep(0.5)
        ring.allreduce_(t, "allreduce", "held")
        out["first"] = {"type": "no error"}
    out["value"] = t.tolist()  # completed before the interrupt was raised
    after = torch.ones(2)
    ring.allreduce_(after, "allreduce", "after")  # still in step
    out["after"] = after.tolist()
    hvd.shutdown()
    return out


def test_an_interrupt_during_a_wait_is_raised_after_the_operation_ends(run_world: Any) -> None:
    size = 2
    res = run_world(__file__, "_rank_interrupted", size, timeout=60, env={"HORA_TIMEOUT": "20"})
    assert res[0]["first"] == {"type": "KeyboardInterrupt"}, res[0]
    assert res[0]["waited"] >= 0.4  # it went on waiting after the SIGINT (rank 1 came 0.5 s later)
    for r in res:
        assert r["value"] == [float(size)] * 4
        assert r["after"] == [float(size)] * 2



def _rank_interrupted_in_lane(rank: int, size: int) -> dict[str, Any]:
    import signal

    import hora.torch as hvd
    import torch
    from hora.torch._process_sets import comm_of

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see above)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="first.round")  # the members decide on the ring here
    lane = comm_of(None, "test").shm_lane
    out: dict[str, Any] = {}
    t = torch.ones(4)
    token = hvd.broadcast_object(uuid.uuid4().hex)
    flag = Path(tempfile.gettempdir()) / f"hora-test-sigint-lane-{token}"
    if rank == 0:
        # a blocking allreduce: this (main) thread runs the lane's operation itself, holding
        # SIGINT; the interrupt comes once it holds it, and rank 1's part 0.5 s later
        sent = _interrupt_once_held(lane.ring, flag)
        try:
            hvd.allreduce_(t, op=hvd.Sum, name="held.in.lane")
            out["first"] = {"type": "no error"}
        except KeyboardInterrupt:
            out["first"] = {"type": "KeyboardInterrupt"}
        out["waited"] = time.monotonic() - sent["at"]
    else:
        with lane.turn:  # rank 1's lane holds back until rank 0 was interrupted, then 0.5 s
            h = hvd.allreduce_async_(t, op=hvd.Sum, name="held.in.lane")
            deadline = time.monotonic() + 30
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            flag.unlink()
            time.sleep(0.5)
        hvd.synchronize(h)
        out["first"] = {"type": "no error"}
    out["value"] = t.tolist()  # the operation completed before the interrupt was raised
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()  # in step
    hvd.shutdown()
    return out


def test_an_interrupt_while_a_blocking_allreduce_runs_the_lane_comes_after_it(
        run_world: Any) -> None:
    size = 2
    res = run_world(__file__, "_rank_interrupted_in_lane", size, timeout=60,
                    env={"HORA_TIMEOUT": "20"})
    assert res[0]["first"] == {"type": "KeyboardInterrupt"}, res[0]
    assert res[0]["waited"] >= 0.4  # it went on with the operation after the SIGINT
    assert res[1]["first"] == {"type": "no error"}
    for r in res:
        assert r["value"] == [float(size)] * 4
        assert r["after"] == [float(size)] * 2


def _rank_leaves_after_passing(rank: int, size: int) -> None:
    import signal

    import hora.torch as hvd
    import torch
    from hora.torch import _shm
    from hora.torch._process_sets import comm_of

    hvd.init()
    hvd.allreduce(torch.ones(1), name="first.round")  # the members decide on the ring here
    ring = _shm.ring_of(comm_of(None, "test"), "test")
    assert ring is not None
    pid0 = hvd.broadcast_object(os.getpid())
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            out["tables"] = ring.allgather_ints([10], "allgather", "race")
        except Exception as e:  # noqa: BLE001
            out["error"] = type(e).__name__
    else:
        # rank 0 waits at the next barrier; it is stopped before it can see this rank
        # arrive, this rank passes the barrier and leaves the ring at once (as init() does
        # after a deadlock that both found in the same round), then rank 0 goes on
        e = ring.epoch + 1
        deadline = time.monotonic() + 30
        while ring.ctl[ring.counter[0]] < e and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid0, signal.SIGSTOP)
        try:
            out["tables"] = ring.allgather_ints([11], "allgather", "race")
            ring.abort("left after the barrier")
        finally:
            os.kill(pid0, signal.SIGCONT)
    print("RESULT " + json.dumps(out), flush=True)
    time.sleep(1)  # rank 0 is done with the barrier before rank 1's process goes
    os._exit(0)  # rank 1 left the ring: skip the exit handlers' goodbyes


def test_a_member_that_passed_a_barrier_and_left_still_counts_as_arrived(
        run_world: Any) -> None:
    # a failed collective's ranks both decide in the same round, and one of them may leave
    # the ring (init() again) before the other has looked at its counter: that one must
    # see the barrier passed, not a member that left early
    outputs = run_world(__file__, "_rank_leaves_after_passing", 2, timeout=60,
                        env={"HORA_TIMEOUT": "20"}, expect_failure=True)
    got = _results([*outputs, (None, "")])  # every rank's RESULT line
    assert got[1] == {"tables": [[10], [11]]}, outputs[1]
    assert got[0] == {"tables": [[10], [11]]}, outputs[0]  # not PeerFailedError
