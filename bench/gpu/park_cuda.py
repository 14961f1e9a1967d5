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
``torch.cuda.is_available()``. ``--cpu`` rehearses the same cells on CPU (the model on the CPU,
torch's CPU generator; ``check.sh --rehearse`` and tests/e2e/test_park_cuda_rehearsal.py), so
that everything but the device is known to work before a GPU comes.

Usage: python bench/gpu/park_cuda.py [--cpu] [--mb 256] [--pairs 3] [--report FILE]
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
side = min(5000, int(({mb} * 1e6 / 4) ** 0.5))  # up to 100 MB of float32 a layer
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
SAVE_RNG = "_rng = torch.cuda.get_rng_state()"
SET_RNG = "torch.cuda.set_rng_state(_rng)"
SYNC = "\ntorch.cuda.synchronize()"
CPU = {  # the --cpu rehearsal: the same cells, on the CPU
    ".cuda()": "", 'device="cuda"': 'device="cpu"', "device='cuda'": "device='cpu'",
    "torch.cuda.synchronize()": "pass", "torch.cuda.get_rng_state()": "torch.get_rng_state()",
    "torch.cuda.set_rng_state": "torch.set_rng_state", "v.is_cuda": "v.device.type == 'cpu'",
}


class Cells:
    """The cells run on the engine, for the GPU or (``cpu``) rehearsed on the CPU."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.device = "cpu" if cpu else "cuda:0"

    def __call__(self, code: str) -> str:
        if self.cpu:
            for a, b in CPU.items():
                code = code.replace(a, b)
        return code


def facts(cluster: Any, cells: Cells) -> dict[str, Any]:
    cluster.run(cells(FACTS))
    return dict(cluster.pull("_facts")[0])


def draw(cluster: Any, cells: Cells) -> list[float]:
    cluster.run(cells(DRAW))
    return list(cluster.pull("_draw")[0])


def correctness(cluster: Any, cells: Cells) -> dict[str, Any]:
    """Park and resume once: everything back, on the device, shared, the next draw the same."""
    before = facts(cluster, cells)
    cluster.run(cells(SAVE_RNG))
    expected = draw(cluster, cells)
    cluster.run(cells(SET_RNG))  # as if that draw never happened
    parked = cluster.park()
    resumed = cluster.resume()
    after = facts(cluster, cells)
    again = draw(cluster, cells)
    ok = (after == before and after["devices"] == [cells.device] and after["shared"]
          and before["adam"] != 0.0 and again == expected)  # fmt: skip
    return {"ok": ok, "before": before, "after": after, "draw": [expected, again],
            "bytes": parked.bytes, "park_s": parked.seconds, "resume_s": resumed.seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=256, help="the model's parameters, MB")
    p.add_argument("--pairs", type=int, default=3, help="timed pairs after one warm-up")
    p.add_argument("--report", type=Path, default=None, help="also write the JSON line here")
    p.add_argument("--cpu", action="store_true", help="rehearse on the CPU (no GPU needed)")
    args = p.parse_args(argv)
    import torch

    result: dict[str, Any] = {"step": "park_cuda", "pass": False, "device": "cpu" if args.cpu
                              else "cuda"}  # fmt: skip
    if not args.cpu and not torch.cuda.is_available():
        result["error"] = "no CUDA device"
    else:
        result.update(run(Cells(args.cpu), args.mb, args.pairs))
    line = json.dumps(result)
    print(line)
    if args.report is not None:
        args.report.write_text(line + "\n")
    return 0 if result["pass"] else 1


def run(cells: Cells, mb: float, pairs: int) -> dict[str, Any]:
    from hora.client import Client
    from hora.engines import ClusterOptions
    from hora.engines.session import ServiceCluster

    with tempfile.TemporaryDirectory(prefix="hora-bench-park-cuda-") as tmp:
        work = Path(tmp)
        settings = {"HORA_WORK_ROOT": str(work)}
        if not cells.cpu:
            settings["HORA_GPUS"] = "auto"
        server = svc.Server(work / "data", slots=1, settings=settings)
        try:
            options = ClusterOptions(n=1, timeout_s=600, start_timeout_s=600)
            cluster = ServiceCluster(options, service=Client(server.url, server.token))
            cluster.start()
            cluster.run(cells(STATE.format(mb=mb)))
            checked = correctness(cluster, cells)
            timed = side_by_side(server, cluster, work, cells, mb, pairs)
            cluster.stop()
        finally:
            server.stop()
    park_r = [h[0] / b[0] for h, b in timed]
    resume_r = [h[1] / b[1] for h, b in timed]
    rows = [f"{i}  park {h[0]:.2f} s  by hand {b[0]:.2f} s  |  resume {h[1]:.2f} s  by hand "
            f"{b[1]:.2f} s" for i, (h, b) in enumerate(timed)]  # fmt: skip
    where = "CPU (rehearsal)" if cells.cpu else "1 GPU"
    print(f"park/resume of {cells.device} tensors, {where}, {checked['bytes'] / 1e6:.0f} MB "
          "snapshot:")
    print("\n".join(rows))
    return {
        "pass": bool(checked["ok"]), "checks": checked, "bytes": checked["bytes"],
        "park_ratio": statistics.median(park_r), "resume_ratio": statistics.median(resume_r),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
        "summary": (f"{checked['bytes'] / 1e6:.0f} MB back on {cells.device}, shared, same next "
                    f"draw; park {statistics.median(park_r):.2f}x, resume "
                    f"{statistics.median(resume_r):.2f}x of by hand" if checked["ok"] else
                    "not everything came back as it was: see checks"),
    }


def side_by_side(
    server: Any, cluster: Any, work: Path, cells: Cells, mb: float, pairs: int
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
        cluster.run(cells(cpu.SAVE.format(where=where) + SYNC))
        cluster.stop()
        cpu.wait_free(server)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cluster.start()
        cluster.run(cells(STATE.format(mb=mb) + cpu.LOAD.format(where=where) + SYNC))
        return save_s, time.perf_counter() - t0

    return list(cpu.nb.interleave(pairs, hora, by_hand))


if __name__ == "__main__":
    sys.exit(main())
