"""Parking a session vs saving and reloading by hand (issue 28), with the disk's own speed.

Protocol (../shared/BENCH.md). A real hora service (bench/service.py's ``Server``: uvicorn on
127.0.0.1, 2 CPU slots, single-user mode) and a 2-rank session (``ServiceCluster``, as
``%dist_start -n 2`` makes it) holding a model of SIZE bytes of parameters and its Adam
optimizer after one step (the optimizer's state doubles the bytes). For each size, one warm-up
pair then --pairs timed pairs, the order alternating:

* **hora**: ``%dist_park`` (scan, every rank writes its part, commit, engines gone, slots free)
  then the resume the next ``%%distributed`` cell does (queue, engines, each rank checks and
  loads its part);
* **by hand**, what a user does today: on every rank ``torch.save`` of ``model.state_dict()``
  and ``opt.state_dict()``, ``%dist_stop`` (slots free); then ``%dist_start`` and a cell that
  builds the model and the optimizer again, ``torch.load`` and ``load_state_dict``.

Correct first: after each path, every rank's parameters and Adam state must equal what they
were before it (a sum over all of them, compared exactly). Ratios: park / (save + stop) and
resume / (start + build + load). Against the limit: the disk's sequential write (2 writers at
once, each its rank's bytes, ``fsync``) and read (``O_DIRECT``, past the page cache) measured in
the same run; the park's write step (ticket to last part on disk) and the resume's restore
must each be within 2 s of snapshot bytes / that bandwidth (reads come from the page cache
when the parts were just written, as in a resume right after a park).

Targets: park <= 1.2x and resume <= 1.2x the hand-made path; each within 2 s of the disk.
--quick (under a minute): the 100 MB model only, 1 pair, no warm-up.

Usage: python bench/park.py [--quick] [--pairs 5] [--sizes 100e6,1e9]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET = 1.2
SLACK_S = 2.0


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nb = _load("notebook")
svc = _load("service")

BUILD = """\
torch.manual_seed(hvd.rank())
side = 5000  # 100 MB of float32 a layer
layers = max(1, round({size} / (side * side * 4)))
model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
"""
STEP = """\
for p in model.parameters():
    p.grad = torch.ones_like(p)
opt.step()
opt.zero_grad()
"""
CHECKSUM = """\
_sum = sum(float(p.double().sum()) for p in model.parameters())
_sum += sum(float(v.double().sum()) for s in opt.state.values() for v in s.values()
            if torch.is_tensor(v))
"""
SAVE = """\
_state = {{"model": model.state_dict(), "opt": opt.state_dict()}}
torch.save(_state, f"{where}/rank{{hvd.rank()}}.pt")
del _state
"""
LOAD = """\
_saved = torch.load(f"{where}/rank{{hvd.rank()}}.pt")
model.load_state_dict(_saved["model"])
opt.load_state_dict(_saved["opt"])
del _saved
"""


def checksum(cluster: Any) -> list[float]:
    cluster.run(CHECKSUM)
    return list(cluster.pull("_sum"))


def wait_free(server: Any, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=10) as c:
        while time.monotonic() < deadline:
            if all(s["job_id"] is None for s in c.get("/v1/gpus").json() if s["index"] is not None):
                return
            time.sleep(0.05)
    raise SystemExit("the session's slots were not freed")


class Paths:
    """One session, parked and resumed (hora) or saved, stopped, started, loaded (by hand)."""

    def __init__(self, server: Any, size: int, where: Path) -> None:
        from hora.client import Client
        from hora.engines import ClusterOptions
        from hora.engines.session import ServiceCluster

        self.server, self.size, self.where = server, size, where
        options = ClusterOptions(n=2, timeout_s=600, start_timeout_s=600)
        self.cluster = ServiceCluster(options, service=Client(server.url, server.token))
        self.cluster.start()
        self.cluster.run(BUILD.format(size=size) + STEP)
        self.expect = checksum(self.cluster)
        self.bytes = 0
        self.steps: list[dict[str, float]] = []

    def _check(self, what: str) -> None:
        got = checksum(self.cluster)
        if got != self.expect:
            raise SystemExit(f"correctness: after {what} the state is {got}, not {self.expect}")

    def hora(self) -> tuple[float, float]:
        parked = self.cluster.park()
        resumed = self.cluster.resume()
        self._check("park and resume")
        self.bytes = parked.bytes
        self.steps.append({"write_s": parked.write_s, "restore_s": resumed.restore_s})
        return parked.seconds, resumed.seconds

    def by_hand(self) -> tuple[float, float]:
        c = self.cluster
        t0 = time.perf_counter()
        c.run(SAVE.format(where=self.where))
        c.stop()
        wait_free(self.server)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        c.start()
        c.run(BUILD.format(size=self.size) + LOAD.format(where=self.where))
        load_s = time.perf_counter() - t0
        self._check("save, stop, start, load")
        for part in self.where.glob("rank*.pt"):
            part.unlink()
        return save_s, load_s


def disk(where: Path, per_rank: int, ranks: int = 2) -> tuple[float, float]:
    """Sequential write (fsync) and O_DIRECT read bandwidth, ``ranks`` files at once, GB/s."""
    chunk = 8 << 20
    block = mmap.mmap(-1, chunk)
    block.write(os.urandom(1 << 20) * 8)
    files = [where / f"disk{r}.bin" for r in range(ranks)]

    def write(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(max(1, per_rank // chunk)):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        buf = mmap.mmap(-1, chunk)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)

    took = []
    for step in (write, read):
        threads = [threading.Thread(target=step, args=(f,)) for f in files]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took.append(time.perf_counter() - t0)
    total = ranks * max(1, per_rank // chunk) * chunk
    for f in files:
        f.unlink()
    return total / took[0] / 1e9, total / took[1] / 1e9


def bench_size(server: Any, size: int, pairs: int, warmup: bool, work: Path) -> dict[str, Any]:
    where = work / f"handmade-{size}"
    where.mkdir()
    paths = Paths(server, size, where)
    try:
        samples = nb.interleave(pairs, paths.hora, paths.by_hand, warmup)
    finally:
        paths.cluster.stop()
    write_bw, read_bw = disk(work, paths.bytes // 2)
    park_r = [h[0] / b[0] for h, b in samples]
    resume_r = [h[1] / b[1] for h, b in samples]
    write_s = statistics.median(s["write_s"] for s in paths.steps[-pairs:])
    restore_s = statistics.median(s["restore_s"] for s in paths.steps[-pairs:])
    limit_w, limit_r = paths.bytes / (write_bw * 1e9), paths.bytes / (read_bw * 1e9)
    rows = [
        [str(i), f"{h[0]:.2f}", f"{b[0]:.2f}", f"{h[0] / b[0]:.2f}", f"{h[1]:.2f}", f"{b[1]:.2f}",
         f"{h[1] / b[1]:.2f}"]
        for i, (h, b) in enumerate(samples)
    ]  # fmt: skip
    title = (f"\n{size / 1e6:.0f} MB model + Adam: snapshot {paths.bytes / 1e9:.2f} GB over 2 "
             "ranks (s)")  # fmt: skip
    print(nb.table(title, ["pair", "park", "save+stop", "ratio", "resume", "start+load",
                           "ratio"], rows))  # fmt: skip
    pk, rs = nb.summarize(park_r), nb.summarize(resume_r)
    print(f"park/by hand median {pk['median']:.2f} (min {pk['min']:.2f}, max {pk['max']:.2f}); "
          f"resume/by hand median {rs['median']:.2f} (min {rs['min']:.2f}, max {rs['max']:.2f})")
    print(f"disk: write {write_bw:.2f} GB/s, read {read_bw:.2f} GB/s (O_DIRECT); park's write "
          f"step {write_s:.2f} s vs bytes/write bw {limit_w:.2f} s; restore {restore_s:.2f} s "
          f"vs bytes/read bw {limit_r:.2f} s")  # fmt: skip
    ok = (pk["median"] <= TARGET and rs["median"] <= TARGET and write_s <= limit_w + SLACK_S
          and restore_s <= limit_r + SLACK_S)  # fmt: skip
    return {
        "bench": f"park.{round(size / 1e6)}MB", "metric": "park and resume s (hora / by hand)",
        "hora": [statistics.median(h[0] for h, _ in samples),
                 statistics.median(h[1] for h, _ in samples)],
        "baseline": [statistics.median(b[0] for _, b in samples),
                     statistics.median(b[1] for _, b in samples)],
        "ratio": [pk["median"], rs["median"]], "target": TARGET,
        "bytes": paths.bytes, "disk_gbps": [write_bw, read_bw],
        "write_s": write_s, "restore_s": restore_s, "pass": ok,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run, under 60 s")
    p.add_argument("--pairs", type=int, default=5, help="timed pairs per size (after 1 warm-up)")
    p.add_argument("--sizes", default="100e6,1e9", help="model sizes in bytes, comma-separated")
    args = p.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    warmup = not args.quick
    if args.quick:
        args.pairs, sizes = 1, sizes[:1]
    import torch

    print(f"bench/park.py: torch {torch.__version__}, CPU, gloo, 2 engines, 1 thread per "
          f"engine, {os.cpu_count()} cores; pairs={args.pairs}")  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="hora-bench-park-") as tmp:
        work = Path(tmp)
        server = svc.Server(work / "data", slots=2, settings={"HORA_WORK_ROOT": str(work)})
        try:
            for size in sizes:
                results.append(bench_size(server, size, args.pairs, warmup, work))
        finally:
            server.stop()
    print()
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
