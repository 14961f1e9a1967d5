"""Start the ranks of a two-sided benchmark on this machine and collect rank 0's result.

Each rank runs ``python SCRIPT --worker --out FILE ARGS...`` with the hora rank environment,
gloo and one OpenMP thread; rank 0 writes its JSON result to FILE.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RANK_TIMEOUT_S = 3000


def run_ranks(script: str, np: int, worker_args: list[str]) -> dict[str, Any]:
    """Run ``np`` ranks of ``script`` and return rank 0's JSON result."""
    from hora.env import rank_env
    from hora.net import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hora-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for r in range(np):
            env = dict(os.environ, OMP_NUM_THREADS="1", HORA_BACKEND="gloo")
            env.update(rank_env(r, np, master_port=port))
            cmd = [sys.executable, script, "--worker", "--out", out, *worker_args]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"bench ranks failed: exit codes {codes}")
        return dict(json.loads(Path(out).read_text()))


def load_module(path: str | Path, module: str) -> Any:
    """The Python file at ``path`` (another commit's copy of a module), as module ``module``."""
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec is not None and spec.loader is not None  # noqa: S101  (a file we chose)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ring_from_file(path: str | Path, comm: Any, module: str, **settings: Any) -> Any:
    """A shared-memory ring of the ``_shm`` module in ``path`` (another commit's, or this
    checkout's with ``settings`` such as ``SLOT_MAX`` changed, or ``_shm_ops`` another
    commit's), set up on ``comm``'s ranks in a segment of its own. Every rank must call it at
    the same point."""
    mod = load_module(path, module)
    for name, value in settings.items():
        setattr(mod, name, value)

    class _Comm:  # what ring_of reads of a process set
        shm, shm_decided = None, False
        size, index, ranks, side = comm.size, comm.index, comm.ranks, comm.side

    ring = mod.ring_of(_Comm(), "bench")
    assert ring is not None, f"the ring of {path} is not usable here"  # noqa: S101
    return ring


def slowest_rounds(dist: Any, rounds: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every rank's block times of ``rounds`` gathered; each block at its slowest rank's time.

    A collective is done when its last rank is, and ``n`` copies "at once" take until the last
    one ends. Every rank must call it at the same point.
    """
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rounds)
    return [{row: max(e[i][row] for e in every) for row in mine} for i, mine in enumerate(rounds)]


def timed_rounds(dist: Any, rows: dict[str, Callable[[], Any]], rounds: int,
                 calls: int) -> dict[str, list[float]]:
    """Seconds a call of each row, per round: blocks of ``calls`` calls after a barrier each.

    The rows run in their order in even rounds and reversed in odd ones, so a slow spell of
    the machine hits them alike; round 0 warms up and is not kept.
    """
    names = list(rows)
    per: dict[str, list[float]] = {r: [] for r in names}
    for r in range(rounds + 1):
        for row in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                rows[row]()
            if r:
                per[row].append((time.perf_counter() - t0) / calls)
    return per
