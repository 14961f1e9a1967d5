"""Park and resume a session holding CUDA tensors, on 1 GPU (issue 28; run where a GPU is).

A real hora service (bench/service.py's ``Server``, its slots the machine's GPUs) and a one-rank
session (``ServiceCluster``, as ``%%distributed -n 1`` makes it) whose engine holds, on its GPU,
a model of --mb MB of parameters, its Adam state after one step, a loose tensor and one that
shares the model's first weight, and the CUDA random generator's state. The session is parked
and resumed: every tensor must come back equal, on the rank's GPU, the shared one still shared,
and the next CUDA random draw must be the one it would have been without the park. Then, side
by side (--pairs interleaved pairs after one warm-up), park + resume against what a user does
by hand (``torch.save`` of the state dicts, ``%dist_stop``, ``%dist_start``, build the model,
``torch.load``, ``load_state_dict``), as bench/park.py does on CPU.

Prints a table, then one JSON line ``{"step": "park_cuda", "pass": bool, ...}`` last (also
written to --report FILE); exits 0 when the checks passed. bench/gpu/check.sh runs it where
``torch.cuda.is_available()``.

Usage: python bench/gpu/park_cuda.py [--mb 256] [--pairs 3] [--report FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(name: str, where: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", where / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


svc = _load("service", HERE.parent)
cpu = _load("park", HERE.parent)

STATE = """\
torch.manual_seed(5)
side = 5000  # 100 MB of float32 a layer
layers = max(1, round({mb} * 1e6 / (side * side * 4)))
linears = [torch.nn.Linear(side, side, bias=False) for _ in range(layers)]
model = torch.nn.Sequential(*linears).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.ones_like(p)
opt.step()
loose = torch.randn(1000, device="cuda")
shared = model[0].weight
torch.cuda.synchronize()
"""
FACTS = """\
_facts = {
    "devices": sorted({str(p.device) for p in model.parameters()} | {str(loose.device)}),
    "shared": shared is model[0].weight,
    "sum": float(sum(p.double().sum() for p in model.parameters()) + loose.double().sum()),
    "adam": float(sum(v.double().sum() for s in opt.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.is_cuda)),
}
"""
DRAW = "_draw = torch.rand(4, device='cuda').tolist()"


def facts(cluster: Any) -> dict[str, Any]:
    cluster.run(FACTS)
    return dict(cluster.pull("_facts")[0])


def draw(cluster: Any) -> list[float]:
    cluster.run(DRAW)
    return list(cluster.pull("_draw")[0])


def correctness(cluster: Any) -> dict[str, Any]:
    """Park and resume once: everything back, on the GPU, shared, the next draw the same."""
    before = facts(cluster)
    cluster.run("_rng = torch.cuda.get_rng_state()")
    expected = draw(cluster)
    cluster.run("torch.cuda.set_rng_state(_rng)")  # as if that draw never happened
    parked = cluster.park()
    resumed = cluster.resume()
    after = facts(cluster)
    again = draw(cluster)
    ok = (after == before and after["devices"] == ["cuda:0"] and after["shared"]
          and again == expected)  # fmt: skip
    return {"ok": ok, "before": before, "after": after, "draw": [expected, again],
            "bytes": parked.bytes, "park_s": parked.seconds, "resume_s": resumed.seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=256, help="the model's parameters, MB")
    p.add_argument("--pairs", type=int, default=3, help="timed pairs after one warm-up")
    p.add_argument("--report", type=Path, default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    import torch

    result: dict[str, Any] = {"step": "park_cuda", "pass": False}
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device"
    else:
        result.update(run(args.mb, args.pairs))
    line = json.dumps(result)
    print(line)
    if args.report is not None:
        args.report.write_text(line + "\n")
    return 0 if result["pass"] else 1


def run(mb: float, pairs: int) -> dict[str, Any]:
    from hora.client import Client
    from hora.engines import ClusterOptions
    from hora.engines.session import ServiceCluster

    with tempfile.TemporaryDirectory(prefix="hora-bench-park-cuda-") as tmp:
        work = Path(tmp)
        settings = {"HORA_GPUS": "auto", "HORA_WORK_ROOT": str(work)}
        server = svc.Server(work / "data", slots=1, settings=settings)
        try:
            options = ClusterOptions(n=1, timeout_s=600, start_timeout_s=600)
            cluster = ServiceCluster(options, service=Client(server.url, server.token))
            cluster.start()
            cluster.run(STATE.format(mb=mb))
            checked = correctness(cluster)
            timed = side_by_side(server, cluster, work, mb, pairs)
            cluster.stop()
        finally:
            server.stop()
    park_r = [h[0] / b[0] for h, b in timed]
    resume_r = [h[1] / b[1] for h, b in timed]
    rows = [f"{i}  park {h[0]:.2f} s  by hand {b[0]:.2f} s  |  resume {h[1]:.2f} s  by hand "
            f"{b[1]:.2f} s" for i, (h, b) in enumerate(timed)]  # fmt: skip
    print(f"park/resume of CUDA tensors, 1 GPU, {checked['bytes'] / 1e6:.0f} MB snapshot:")
    print("\n".join(rows))
    return {
        "pass": bool(checked["ok"]), "checks": checked, "bytes": checked["bytes"],
        "park_ratio": statistics.median(park_r), "resume_ratio": statistics.median(resume_r),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
    }


def side_by_side(
    server: Any, cluster: Any, work: Path, mb: float, pairs: int
) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Park + resume against save + stop + start + load, interleaved, on the same session."""
    import time

    where = work / "handmade"
    where.mkdir()

    def hora() -> tuple[float, float]:
        parked = cluster.park()
        resumed = cluster.resume()
        return parked.seconds, resumed.seconds

    def by_hand() -> tuple[float, float]:
        t0 = time.perf_counter()
        cluster.run(cpu.SAVE.format(where=where) + "torch.cuda.synchronize()")
        cluster.stop()
        cpu.wait_free(server)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cluster.start()
        cluster.run(STATE.format(mb=mb) + cpu.LOAD.format(where=where) + "torch.cuda.synchronize()")
        return save_s, time.perf_counter() - t0

    out: list[tuple[tuple[float, float], tuple[float, float]]] = []
    hora(), by_hand()
    for i in range(pairs):
        if i % 2 == 0:
            out.append((hora(), by_hand()))
        else:
            b = by_hand()
            out.append((hora(), b))
    return out


if __name__ == "__main__":
    sys.exit(main())
