"""``init()`` -> ``shutdown()`` -> ``init()`` many times: the rank program of test_reinit.py.

``python _reinit_rounds.py OUT ROUNDS`` runs under any launcher (``hora run``, a
torchrun-style environment, an Open MPI one): ``hvd.init()`` finds the world as a script's
would. After two warm-up rounds (first-use imports and caches) it notes the process's open
file descriptors, threads and ``sys.excepthook``, then runs ROUNDS rounds of ``init()``, a
checked allreduce, ``barrier()`` and ``shutdown()``. Round ``i`` leaves work in flight as
``KINDS[i % 3]`` says:

* ``clean``: nothing;
* ``handle``: an ``allreduce_async`` handle never synchronized before ``shutdown()`` (it is
  synchronized after it, and must raise NotInitializedError);
* ``optimizer``: a ``DistributedOptimizer`` whose gradient allreduces started in backward but
  were never stepped; it stays referenced until the next such round.

Each rank writes ``OUT/rank<R>.json``: the allreduce sums, the stale-handle errors, the
resident set size after every round, the baseline and final fd / thread counts, the TCP
ports this process still listens on, whether ``sys.excepthook`` is back, and per-round times.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hora.torch as hvd
from hora.errors import NotInitializedError

KINDS = ("clean", "handle", "optimizer")
WARMUP = 2
WORLD: dict[str, int] = {}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _listening_ports() -> list[int]:
    """TCP ports on which a socket of this process listens (/proc/net/tcp{,6}, state 0A)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listdir itself used, closed since
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _round(i: int, kept: list[Any]) -> tuple[list[float], Any]:
    """One init/shutdown round; returns the allreduce result and the handle left in flight."""
    hvd.init()
    WORLD.update(rank=hvd.rank(), size=hvd.size())
    total = hvd.allreduce(torch.ones(2) * (hvd.rank() + i), op=hvd.Sum, name=f"r{i}")
    kind = KINDS[i % len(KINDS)]
    handle = hvd.allreduce_async(torch.ones(3), name=f"left.{i}") if kind == "handle" else None
    if kind == "optimizer":  # the gradients' allreduces start in backward; step() never comes
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
    return total.tolist(), handle


def main(out: Path, rounds: int) -> None:
    kept: list[Any] = []
    for i in range(WARMUP):
        _round(-1 - i, kept)
    kept.clear()
    hook = sys.excepthook
    before = {"fds": _fds(), "threads": _threads()}
    sums, rss, times, stale = [], [], [], 0
    for i in range(rounds):
        t0 = time.perf_counter()
        total, handle = _round(i, kept)
        times.append(time.perf_counter() - t0)
        sums.append(total)
        if handle is not None:
            try:
                hvd.synchronize(handle)
            except NotInitializedError:
                stale += 1
        del handle
        rss.append(_rss_kb())
    kept.clear()
    result = {
        **WORLD,
        "sums": sums,
        "stale": stale,
        "rss_kb": rss,
        "times_s": times,
        "before": before,
        "after": {"fds": _fds(), "threads": _threads()},
        "listening": _listening_ports(),
        "excepthook_restored": sys.excepthook is hook,
    }
    Path(out, f"rank{WORLD['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
