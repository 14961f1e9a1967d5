"""A 2-rank job whose preflight names rank 1 and whose communication share is known.

Rank 1 slows itself on purpose inside the preflight's timed local copies (a test hook), so the
preflight names it against this host's recorded baseline (:func:`baseline_env`: the preflight
judges nothing without one). After ``hvd.init()`` rank 0 computes (sleeps) 0.2 s and rank 1 1.0
s, then both run four blocking allreduces of 1 MiB: rank 0 waits about 0.8 s for rank 1 in the
first one, rank 1 is the slowest rank because of compute, each rank reduces exactly 4 MiB, and
the scaling efficiency (median compute over the slowest wall time) is about 0.6. The same shape
as the profiled cell of tests/e2e/test_magics_profile.py, as a job script.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

SCRIPT = """\\
import os, time, torch
import hora.torch as hvd
from hora.torch import preflight
torch.set_num_threads(1)
if os.environ["RANK"] == "1":
    preflight.SLOW_HOOKS.append(lambda phase: time.sleep(0.05) if phase == "copy" else None)
hvd.init()
time.sleep(0.2 if hvd.rank() == 0 else 1.0)
for i in range(4):
    hvd.allreduce(torch.ones(262144), name=f"profiled.{i}")
print("rank", hvd.rank(), "trained", flush=True)
hvd.shutdown()
"""
REDUCED = 4 << 20  # bytes each rank reduces


def baseline_env(root: Path) -> dict[str, str]:
    """Record a preflight baseline for this host under ``root``; the service setting naming it.

    Its copy bandwidth, 0.5 GB/s, is one any healthy rank passes, loaded or not (a rank is
    named under half of it); the slowed rank's 50 ms per 4 MiB copy is 0.08 GB/s.
    """
    base = root / "baseline"
    base.mkdir(exist_ok=True)
    node = {"gloo": {"copy_gbps": 0.5}, "shm": {"copy_gbps": 0.5}}
    (base / f"{socket.gethostname()}.json").write_text(json.dumps({"paths": node}))
    return {"HORA_JOB_PREFLIGHT_BASELINE_DIR": str(base)}
