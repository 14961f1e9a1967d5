"""``init()`` -> ``shutdown()`` -> ``init()`` in one process, rounds leaving work in flight.

Horovod's Gloo runner runs its test suite this way (``HOROVOD_RANK`` / ``HOROVOD_SIZE`` set:
``tearDown`` calls ``hvd.barrier(); hvd.shutdown()`` and the next test ``hvd.init()``). Every
third round leaves an ``allreduce_async`` handle unsynchronized, and every third another a
``DistributedOptimizer`` whose allreduces started in backward but were never stepped (it
stays referenced until the next such round): ``shutdown()`` must still
release the rendezvous port (the next ``init()`` reopens it on rank 0), the threads and the
file descriptors, and the stale handle then raises NotInitializedError. A port held by
another process is reported as an address in use, not as a timeout.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

ROUNDS = 40


def _counts() -> tuple[int, int]:
    import os

    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _reinit_rounds(rank: int, size: int, rounds: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch
    from hora.errors import NotInitializedError

    hvd.init()
    hvd.shutdown()
    before = _counts()
    sums, stale, kept = [], 0, []
    for i in range(rounds):
        hvd.init()
        sums.append(hvd.allreduce(torch.ones(2) * (hvd.rank() + i), op=hvd.Sum).tolist())
        handle = hvd.allreduce_async(torch.ones(3), name=f"left.{i}") if i % 3 == 1 else None
        if i % 3 == 2:  # the gradients' allreduces start in backward; step() never comes
            model = torch.nn.Linear(4, 2)
            kept[:] = [
                hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    named_parameters=model.named_parameters(),
                )
            ]
            model(torch.ones(2, 4)).sum().backward()
        hvd.barrier()
        hvd.shutdown()
        if handle is not None:
            try:
                hvd.synchronize(handle)
            except NotInitializedError:
                stale += 1
    return {"sums": sums, "before": before, "after": _counts(), "stale": stale}


def test_init_shutdown_init_40_rounds_leaves_nothing_behind(
    run_world: Callable[..., list[Any]],
) -> None:
    results = run_world(__file__, "_reinit_rounds", 2, args=(ROUNDS,), timeout=240)
    for rank, r in enumerate(results):
        expected = [[float(2 * i + 1)] * 2 for i in range(ROUNDS)]
        assert r["sums"] == expected, f"rank {rank}"
        assert r["after"] == r["before"], f"rank {rank}: (fds, threads) leaked"
        assert r["stale"] == len(range(1, ROUNDS, 3)), "a handle from before shutdown() fails"


def _init_on_a_taken_port(rank: int, size: int) -> str:
    import os

    import hora.torch as hvd
    from hora.errors import RendezvousError

    with socket.socket() as s:  # another listener holds the launcher's port
        s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        s.listen()
        try:
            hvd.init()
        except RendezvousError as e:
            return str(e)
    return "init() succeeded"


def test_a_port_in_use_is_reported_as_address_in_use(
    run_world: Callable[..., list[Any]],
) -> None:
    out = run_world(__file__, "_init_on_a_taken_port", 1, timeout=60)
    assert "address in use" in out[0]
    assert "timed out" not in out[0]


def _recover_after_a_skipped_collective(rank: int, size: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    try:
        if rank == 0:  # rank 1 skipped this one (an exception between its collectives)
            hvd.allreduce(torch.ones(2), name="only.rank0")
        hvd.barrier()
        first = "no error"
    except hvd.HoraError as e:
        first = type(e).__name__
    hvd.init()  # the failed world is dropped; every rank that saw the failure starts anew
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
    hvd.barrier()
    hvd.shutdown()
    return {"first": first, "after": total}


def test_init_after_a_failed_collective_starts_a_world_in_step(
    run_world: Callable[..., list[Any]],
) -> None:
    results = run_world(
        __file__, "_recover_after_a_skipped_collective", 2, env={"HORA_TIMEOUT": "4"}
    )
    for r in results:
        assert r["first"] in ("CollectiveTimeout", "RankFailedError", "TensorMismatchError")
        assert r["after"] == [2.0, 2.0]
