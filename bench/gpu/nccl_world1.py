"""GPU check step: hora.torch on NCCL at world size 1 (bench/gpu/check.py runs it).

``hvd.init(backend="nccl")`` in a world of one, then allreduce (Sum, Average, in place),
broadcast, allgather and one DistributedOptimizer step on CUDA tensors: each result must be
the input (one rank), on the rank's GPU. Prints one JSON line. ``--cpu`` rehearses the same
on CPU with gloo (``check.sh --rehearse``).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import hora.torch as hvd
    import torch
    import torch.distributed as dist

    cpu = "--cpu" in sys.argv
    hvd.init(backend="gloo" if cpu else "nccl")
    dev = torch.device("cpu") if cpu else torch.device("cuda", hvd.local_rank())
    t = torch.arange(8.0, device=dev)
    checks = {
        "backend": dist.get_backend() == ("gloo" if cpu else "nccl"),
        "allreduce Sum": torch.equal(hvd.allreduce(t, op=hvd.Sum), t),
        "allreduce Average": torch.equal(hvd.allreduce(t), t),
        "allreduce_ in place": torch.equal(hvd.allreduce_(t.clone(), op=hvd.Sum), t),
        "broadcast": torch.equal(hvd.broadcast(t, 0), t),
        "allgather": torch.equal(hvd.allgather(t), t),
        "result on the GPU": hvd.allreduce(t).device == dev,
    }
    model = torch.nn.Linear(16, 4).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    model(torch.randn(8, 16, device=dev)).square().mean().backward()
    opt.step()
    checks["optimizer step on the GPU"] = bool(model.weight.device == dev
                                               and not torch.equal(model.weight, before))
    hvd.shutdown()
    bad = [k for k, ok in checks.items() if not ok]
    print(json.dumps({"step": "nccl_world1", "pass": not bad, "checks": checks,
                      "summary": "all collectives correct on " + (
                          "cpu" if cpu else torch.cuda.get_device_name(dev))
                      if not bad else "failed: " + ", ".join(bad)}))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
