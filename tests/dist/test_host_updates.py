"""``state.commit()``'s host-update check: every rank gives the same answer at the same check.

Real ranks (2 and 3, gloo, one machine). Each rank is pointed at an elastic rendezvous
directory of its own, holding a generation file the rank writes with the driver's own
function (:func:`hora.launch.elastic_rdzv.write_generation`), so that one rank sees a newer
world than the others, as happens when the driver publishes one between their reads:

* through the world's shared memory (the default on one machine) every rank answers True at
  the very check where the last rank saw the new world, and False before it;
* with ``HORA_SHM=off`` (the gloo side group, exchanged in the background) they all answer
  True one check later, and still all at the same check;
* a check that meets another rank's negotiation round in the ring raises
  TensorMismatchError on both ranks, instead of reading the round's table as a view;
* a rank whose process is gone is named by the others' check at once, with an error that
  ``hvd.elastic.run`` treats as a failed world (it goes back to the last commit).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _joined(rank: int, base: str) -> Any:
    """Point this rank's elastic state at a directory of its own, in generation 1."""
    from hora.launch import elastic_rdzv as rdzv
    from hora.torch.elastic import _world

    root = Path(base) / f"rank{rank}"
    root.mkdir()
    _world._Joined.root, _world._Joined.number = root, 1
    publish = rdzv.write_generation
    member = rdzv.Member("w0", "localhost", 0, 1, 0, 1)
    publish(root, rdzv.Generation(1, (member,), "127.0.0.1", 1))
    return lambda n: publish(root, rdzv.Generation(n, (member,), "127.0.0.1", 1))


def _rank_checks(rank: int, size: int, base: str) -> dict[str, Any]:
    import hora.torch as hvd
    import torch
    from hora.torch._process_sets import comm_of
    from hora.torch.elastic import _world

    hvd.init()
    hvd.allreduce(torch.ones(1), name="set-up")  # the world decides on its shared memory
    publish = _joined(rank, base)
    answers = [_world.check_updates()]
    if rank == size - 1:  # only the last rank has seen generation 2 when it checks
        publish(2)
    answers += [_world.check_updates(), _world.check_updates()]
    ring = comm_of(None, "test").shm
    _world.forget_posted()
    hvd.shutdown()
    return {"answers": answers, "ring": ring is not None}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(("shm", "want"), [("", [False, True, True]),
                                           ("off", [False, False, True])])
def test_every_rank_sees_a_new_world_at_the_same_check(
    run_world: Callable[..., list[Any]], tmp_path: Path, size: int, shm: str, want: list[bool]
) -> None:
    res = run_world(__file__, "_rank_checks", size, args=(str(tmp_path),), timeout=90,
                    env={"HORA_SHM": shm})
    assert [r["ring"] for r in res] == [shm != "off"] * size, res
    assert [r["answers"] for r in res] == [want] * size, res


def _rank_check_meets_a_round(rank: int, size: int, base: str) -> str:
    import hora.torch as hvd
    import torch
    from hora.errors import TensorMismatchError
    from hora.torch._process_sets import comm_of
    from hora.torch.elastic import _world

    hvd.init()
    hvd.allreduce(torch.ones(1), name="set-up")
    _joined(rank, base)
    ring = comm_of(None, "test").shm
    try:
        if rank == 0:
            _world.check_updates()
        else:  # what a negotiation round sends: a table of ints
            ring.allgather_ints([3, 1, 4, 1, 5], "allreduce", "grad.w")
    except TensorMismatchError as e:
        return str(e)
    return "no error"


def test_a_check_that_meets_a_negotiation_round_fails_on_both_ranks(
    run_world: Callable[..., list[Any]], tmp_path: Path
) -> None:
    res = run_world(__file__, "_rank_check_meets_a_round", 2, args=(str(tmp_path),),
                    timeout=90)
    assert all("members reached different tensors" in r for r in res), res


def _rank_check_after_a_peer_died(rank: int, size: int, base: str) -> None:
    import hora.torch as hvd
    import torch
    from hora.torch.elastic import _is_world_failure, _world

    hvd.init()
    hvd.allreduce(torch.ones(1), name="set-up")
    _joined(rank, base)
    if rank == size - 1:
        os._exit(0)  # gone without a word, between two commits
    t0 = time.monotonic()
    try:
        _world.check_updates()
        got: dict[str, Any] = {"type": "no error"}
    except Exception as e:  # noqa: BLE001
        got = {"type": type(e).__name__, "msg": str(e), "world": _is_world_failure(e)}
    got["elapsed"] = time.monotonic() - t0
    print("RESULT " + json.dumps(got), flush=True)
    os._exit(0)  # the world is broken: skip the exit handlers' waits


def test_a_check_names_a_rank_that_died_at_once(
    run_world: Callable[..., list[Any]], tmp_path: Path
) -> None:
    outputs = run_world(__file__, "_rank_check_after_a_peer_died", 2, args=(str(tmp_path),),
                        timeout=90, env={"HORA_TIMEOUT": "60"}, expect_failure=True)
    line = [ln for ln in outputs[0][1].splitlines() if ln.startswith("RESULT ")]
    assert line, outputs[0][1][-3000:]
    got = json.loads(line[-1][len("RESULT "):])
    assert got["type"] == "PeerFailedError" and "rank 1" in got["msg"], got
    assert got["world"] is True, got  # hvd.elastic.run restores the last commit
    assert got["elapsed"] < 10, got  # the timeout is 60 s
