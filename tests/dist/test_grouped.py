"""grouped_allgather, grouped_reducescatter, sparse_allreduce_async and int16 on 2 real ranks.

gloo has no int16 kernels (a collective of int16 tensors used to hang until the timeout on
every rank; Horovod's suite uses ``torch.ShortTensor``): hora carries them as int32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _grouped(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch

    hvd.init()
    gathered = hvd.grouped_allgather([torch.full((rank + 1,), float(rank)), torch.ones(2, 1)])
    blocks = hvd.grouped_reducescatter([torch.arange(6.0) + rank, torch.ones(5, 2)], op=hvd.Sum)
    dense = torch.zeros(4, 3)
    dense[rank, rank] = rank + 1.0
    wait = hvd.sparse_allreduce_async(dense.to_sparse(), name="emb", op=hvd.Average)
    averaged = wait().to_dense()
    try:
        hvd.grouped_reducescatter([torch.tensor(1.0)])
        scalar = "no error"
    except (ValueError, RuntimeError) as e:
        scalar = type(e).__name__
    short = torch.full((3,), rank + 1, dtype=torch.int16)
    int16 = {
        "allreduce": hvd.allreduce(short, op=hvd.Sum),
        "allgather": hvd.allgather(short),
        "broadcast": hvd.broadcast(short, root_rank=1),
        "reducescatter": hvd.reducescatter(torch.ones(4, dtype=torch.int16), op=hvd.Sum),
    }
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    names = sorted(opt._parameter_names.values())  # Horovod's internal the suite reads
    after = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()  # the world is still in step
    hvd.shutdown()
    return {
        "gathered": [g.tolist() for g in gathered],
        "blocks": [b.tolist() for b in blocks],
        "averaged": averaged.tolist(),
        "scalar": scalar,
        "after": after,
        "names": names,
        "int16": {k: (str(v.dtype), v.tolist()) for k, v in int16.items()},
    }


def test_grouped_forms_and_sparse_allreduce(run_world: Callable[..., list[Any]]) -> None:
    r0, r1 = run_world(__file__, "_grouped", 2)
    for r in (r0, r1):
        assert r["gathered"] == [[0.0, 1.0, 1.0], [[1.0]] * 4]
        assert r["averaged"] == [[0.5, 0, 0], [0, 1.0, 0], [0, 0, 0], [0, 0, 0]]
        assert r["scalar"] == "ValueError"
        assert r["after"] == [2.0, 2.0]
        assert r["names"] == ["allreduce.noname.0.0", "allreduce.noname.0.1"]
        assert r["int16"] == {
            "allreduce": ("torch.int16", [3, 3, 3]),
            "allgather": ("torch.int16", [1, 1, 1, 2, 2, 2]),
            "broadcast": ("torch.int16", [2, 2, 2]),
            "reducescatter": ("torch.int16", [2, 2]),
        }
    # sum of arange(6) + rank over 2 ranks = 2*arange(6) + 1, split 3 / 3 rows
    assert r0["blocks"][0] == [1.0, 3.0, 5.0] and r1["blocks"][0] == [7.0, 9.0, 11.0]
    assert r0["blocks"][1] == [[2.0, 2.0]] * 3 and r1["blocks"][1] == [[2.0, 2.0]] * 2
