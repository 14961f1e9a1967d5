"""Notebook engines: %%distributed round trip, cold start, and training throughput in engines.

Protocol (../shared/BENCH.md), three parts, each hora side by side with a named baseline,
interleaved (A B, then B A, ...), one warm-up pair, then --pairs timed pairs; the median of the
per-pair ratios with min and max:

1. round trip: a trivial ``%%distributed`` cell (``x = 1``) vs raw ipyparallel
   ``view.execute("x = 1", block=True)`` on the SAME 2 engines, both run as notebook cells
   through one IPython shell (``shell.run_cell``). A pair is --iters cells of each side,
   alternating one by one; its sample is the median per side. Correct first: each path must set
   ``x`` on both engines. Target: hora / ipyparallel <= 1.05 (issue 29).
2. cold start: ``hora.engines.Cluster(n=2).start()`` (controller, 2 engines, hora.torch.init:
   a ready process group) vs ``ipyparallel.Cluster(n=2).start_and_connect_sync()`` followed by
   ``torch.distributed.init_process_group("gloo")`` on both engines (a ready process group
   too). Correct first: an allreduce on each side returns 2 (not timed). Targets: hora /
   ipyparallel <= 1.1 (issue 29) and hora <= 5 s (absolute, this machine).
3. training: samples/s of the digits CNN (bench/_digits_train.py: the same function, shard,
   batch, steps and 1 thread per rank) run in the notebook engines vs under
   ``hora run -np 2``. Correct first: both paths end with the same parameter checksum (that
   pair is also the warm-up pair). Target: engines / hora run >= 0.95.

--quick (under a minute): 1 pair of each, no warm-up pair, 10 cells per round-trip sample,
1 training epoch, and the training correctness pair is the timed pair.

Usage: python bench/notebook.py [--quick] [--pairs 5] [--iters 40] [--epochs 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hora.net import free_port

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "_digits_train.py"
# issue 29: round trip <= 1.05x raw ipyparallel; cold start <= 1.1x ipyparallel's own start
# + an init_process_group (and <= 5 s, as before)
TARGETS = {"roundtrip": 1.05, "cold_start": 1.1, "cold_start_s": 5.0, "train": 0.95}
HORA_CELL = "%%distributed\nx = 1\n"
RAW_CELL = "_raw_view.execute('x = 1', block=True)\n"


def summarize(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def interleave(
    pairs: int, a: Callable[[], float], b: Callable[[], float], warmup: bool = True
) -> list[tuple[float, float]]:
    """One warm-up pair, then ``pairs`` timed pairs, alternating which side goes first."""
    if warmup:
        a(), b()
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            ta = a()
            tb = b()
        else:
            tb = b()
            ta = a()
        out.append((ta, tb))
    return out


def table(title: str, head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# --- 1. round trip -----------------------------------------------------------------------------
def start_shell() -> tuple[Any, Any]:
    """An IPython shell with hora loaded and 2 engines started by %dist_start."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    shell.run_line_magic("dist_start", "-n 2")
    cluster = shell.magics_manager.registry["HoraMagics"].cluster
    shell.user_ns["_raw_view"] = cluster.client[[e.engine_id for e in cluster.engines]]
    return shell, cluster


def run_cell(shell: Any, code: str) -> None:
    result = shell.run_cell(code, store_history=False, silent=True)
    if not result.success:
        error = result.error_in_exec or result.error_before_exec
        raise RuntimeError(f"cell failed: {code!r}: {error}")


def check_roundtrip(shell: Any, cluster: Any) -> None:
    for value, cell in [(1, HORA_CELL), (2, RAW_CELL.replace("x = 1", "x = 2"))]:
        run_cell(shell, "%%distributed\nx = 0\n")
        run_cell(shell, cell)
        got = cluster.pull("x")
        if got != [value] * cluster.size:
            raise RuntimeError(f"round trip check: {cell!r} left x = {got} on the engines")


def bench_roundtrip(shell: Any, cluster: Any, pairs: int, iters: int) -> dict[str, Any]:
    check_roundtrip(shell, cluster)

    def cell_s(code: str) -> float:
        t0 = time.perf_counter()
        run_cell(shell, code)
        return time.perf_counter() - t0

    def pair() -> tuple[float, float]:
        # the two cells alternate one by one (A B B A ...) so that both see the same load;
        # the median of each side's cells is robust to the spikes of a shared machine
        hora, raw = [], []
        for i in range(iters):
            if i % 2 == 0:
                hora.append(cell_s(HORA_CELL))
                raw.append(cell_s(RAW_CELL))
            else:
                raw.append(cell_s(RAW_CELL))
                hora.append(cell_s(HORA_CELL))
        return statistics.median(hora), statistics.median(raw)

    pair()  # warm-up
    samples = [pair() for _ in range(pairs)]
    ratios = [h / r for h, r in samples]
    hora = statistics.median(h for h, _ in samples)
    raw = statistics.median(r for _, r in samples)
    rows = [[str(i), f"{h * 1e3:.2f}", f"{r * 1e3:.2f}", f"{h / r:.3f}"]
            for i, (h, r) in enumerate(samples)]
    print(table(f"\n1. cell round trip, 2 engines: median ms per cell of {iters} alternating "
                "cells per pair",
                ["pair", "%%distributed", "view.execute", "ratio"], rows))
    s = summarize(ratios)
    print(f"ratio median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}); "
          f"target <= {TARGETS['roundtrip']}")
    return {"bench": "notebook.roundtrip", "metric": "cell_round_trip_s (%%distributed / "
            "ipyparallel view.execute)", "hora": hora, "baseline": raw, "ratio": s["median"],
            "ratio_min": s["min"], "ratio_max": s["max"], "target": TARGETS["roundtrip"],
            "pass": s["median"] <= TARGETS["roundtrip"]}


# --- 2. cold start -----------------------------------------------------------------------------
def hora_cold_start() -> float:
    from hora.engines import Cluster, ClusterOptions

    cluster = Cluster(ClusterOptions(n=2))
    try:
        t0 = time.perf_counter()
        cluster.start()
        elapsed = time.perf_counter() - t0
        cluster.run("import torch; t = hvd.allreduce(torch.ones(1), op=hvd.Sum)")
        if cluster.pull("t")[0].item() != 2.0:
            raise RuntimeError("cold start check: the process group is not ready")
        return elapsed
    finally:
        cluster.stop()


def ipp_cold_start() -> float:
    import ipyparallel as ipp
    from traitlets.config import Config

    cfg = Config()
    cfg.LocalEngineSetLauncher.environment = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-ipp-") as profile:
        cluster = ipp.Cluster(n=2, profile_dir=profile, log_level=30, config=cfg)
        try:
            t0 = time.perf_counter()
            # start_and_connect_sync() without its progress bar: the same three steps
            cluster.start_cluster_sync()
            client = cluster.connect_client_sync()
            client.wait_for_engines(2, timeout=60, interactive=False)
            port = free_port()
            rs = [client[e].execute(
                "import torch, torch.distributed as dist\n"
                f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', "
                f"rank={i}, world_size=2)\n") for i, e in enumerate(client.ids[:2])]
            for r in rs:
                r.get(timeout=120)
            elapsed = time.perf_counter() - t0
            client[:].execute("t = torch.ones(1); dist.all_reduce(t)", block=True)
            if [t.item() for t in client[:].pull("t", block=True)] != [2.0, 2.0]:
                raise RuntimeError("ipyparallel cold start: the process group is not ready")
            client.close()
            return elapsed
        finally:
            cluster.stop_cluster_sync()


def bench_cold_start(pairs: int, warmup: bool) -> dict[str, Any]:
    samples = interleave(pairs, hora_cold_start, ipp_cold_start, warmup)
    ratios = [h / r for h, r in samples]
    hora = statistics.median(h for h, _ in samples)
    raw = statistics.median(r for _, r in samples)
    rows = [[str(i), f"{h:.2f}", f"{r:.2f}", f"{h / r:.2f}"] for i, (h, r) in enumerate(samples)]
    print(table("\n2. cold start of 2 engines (s)",
                ["pair", "hora (ready process group)",
                 "ipyparallel + init_process_group", "ratio"], rows))
    s = summarize(ratios)
    print(f"hora median {hora:.2f}s (min {min(h for h, _ in samples):.2f}, max "
          f"{max(h for h, _ in samples):.2f}); target <= {TARGETS['cold_start_s']} s; "
          f"ratio median {s['median']:.2f} (min {s['min']:.2f}, max {s['max']:.2f}); "
          f"target <= {TARGETS['cold_start']}")
    return {"bench": "notebook.cold_start", "metric": "cold_start_s (2 engines, hora / "
            "ipyparallel + init_process_group)", "hora": hora, "baseline": raw,
            "ratio": s["median"], "ratio_min": s["min"], "ratio_max": s["max"],
            "target": TARGETS["cold_start"], "target_s": TARGETS["cold_start_s"],
            "pass": s["median"] <= TARGETS["cold_start"] and hora <= TARGETS["cold_start_s"]}


# --- 3. training throughput --------------------------------------------------------------------
def train_in_engines(cluster: Any, epochs: int) -> dict[str, Any]:
    code = (f"import runpy as _runpy\n"
            f"_bench = _runpy.run_path({str(TRAIN)!r})['train'](epochs={epochs})\n")
    cluster.run(code)
    return dict(cluster.pull("_bench", [0])[0])


def train_under_hora_run(epochs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-nb-") as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "hora.cli", "run", "-np", "2", "--", sys.executable,
                str(TRAIN), "--epochs", str(epochs), "--out", str(out)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"hora run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return dict(json.loads(out.read_text()))


def bench_train(cluster: Any, pairs: int, epochs: int, quick: bool) -> dict[str, Any]:
    # the correctness pair is also the warm-up pair (and, under --quick, the only timed one)
    eng, run = train_in_engines(cluster, epochs), train_under_hora_run(epochs)
    if abs(eng["checksum"] - run["checksum"]) > 1e-6 * max(1.0, abs(run["checksum"])):
        raise RuntimeError(f"training check: checksums differ: engines {eng['checksum']}, "
                           f"hora run {run['checksum']}")
    print(f"\n3. training: same parameters after training on both paths (checksum "
          f"{eng['checksum']:.6f}); {eng['size']} ranks, {eng['threads']} thread(s) per rank in "
          f"engines, {run['threads']} under hora run; {eng['samples']} samples per run")
    samples = (
        [(eng["samples_per_s"], run["samples_per_s"])]
        if quick
        else interleave(pairs, lambda: train_in_engines(cluster, epochs)["samples_per_s"],
                        lambda: train_under_hora_run(epochs)["samples_per_s"], warmup=False)
    )
    ratios = [e / r for e, r in samples]
    rows = [[str(i), f"{e:.0f}", f"{r:.0f}", f"{e / r:.3f}"] for i, (e, r) in enumerate(samples)]
    print(table(f"samples/s, digits CNN, {epochs} epochs, batch 32 per rank",
                ["pair", "engines (%%distributed)", "hora run -np 2", "ratio"], rows))
    s = summarize(ratios)
    print(f"ratio median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}); "
          f"target >= {TARGETS['train']}")
    return {"bench": "notebook.train", "metric": "samples_per_s (engines / hora run -np 2)",
            "hora": statistics.median(e for e, _ in samples),
            "baseline": statistics.median(r for _, r in samples), "ratio": s["median"],
            "ratio_min": s["min"], "ratio_max": s["max"], "target": TARGETS["train"],
            "pass": s["median"] >= TARGETS["train"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run, under 60 s")
    p.add_argument("--pairs", type=int, default=5, help="timed pairs per part (after 1 warm-up)")
    p.add_argument("--iters", type=int, default=40, help="cells per round-trip sample")
    p.add_argument("--epochs", type=int, default=30, help="training epochs per throughput sample")
    args = p.parse_args(argv)
    warmup = not args.quick  # --quick: no warm-up pair (the correctness checks warm up)
    if args.quick:
        args.pairs, args.iters, args.epochs = 1, 10, 1
    import torch

    print(f"bench/notebook.py: torch {torch.__version__}, CPU, gloo, 2 engines, 1 thread per "
          f"engine, {os.cpu_count()} cores; pairs={args.pairs} iters={args.iters} "
          f"epochs={args.epochs}")
    shell, cluster = start_shell()
    try:
        results = [bench_roundtrip(shell, cluster, args.pairs, args.iters),
                   bench_train(cluster, args.pairs, args.epochs, args.quick)]
    finally:
        shell.run_line_magic("dist_stop", "")
    results.insert(1, bench_cold_start(args.pairs, warmup))
    print()
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
