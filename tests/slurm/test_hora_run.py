"""``hora run`` inside a two-node Slurm allocation spans both nodes (one srun), and a plain
``srun python train.py`` works as well: hora.torch reads Slurm's variables."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers.slurm_cluster import Cluster

PY = sys.executable
HORA = str(Path(PY).with_name("hora"))
pytestmark = pytest.mark.timeout(120)

ALLREDUCE = """\
import os, socket
import torch
import hora.torch as hvd
torch.set_num_threads(1)
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
print(f"rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()} on {socket.gethostname()} "
      f"sum {total:g}", flush=True)
hvd.shutdown()
"""


def batch(slurm: Cluster, tmp_path: Path, line: str) -> str:
    out = tmp_path / "out.txt"
    job = slurm.run(
        "sbatch", "--parsable", "-N2", "--ntasks-per-node=2", "-o", str(out),
        "--export=ALL,OMP_NUM_THREADS=1,HORA_BACKEND=gloo", "--wrap", line,
    ).strip()  # fmt: skip
    deadline = time.monotonic() + 100
    while job in slurm.queue():
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    return out.read_text()


def ranks(text: str, mark: str) -> list[str]:
    return sorted(ln.split(": ", 1)[-1] for ln in text.splitlines() if mark in ln)


WORLD = """\
import os, socket
from hora.env import detect_world
w = detect_world(dict(os.environ))
print(f"rank {w.rank}/{w.size} local {w.local_rank} on {socket.gethostname()} "
      f"via {w.launcher} master {w.master_addr}", flush=True)
"""


def test_hora_run_in_a_two_node_batch_script_spans_both_nodes(
    slurm: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    text = batch(slurm, tmp_path, f"{HORA} run -np 4 -- {PY} {script}")
    assert ranks(text, "sum ") == [
        "rank 0/4 local 0 on n1 sum 10", "rank 1/4 local 1 on n1 sum 10",
        "rank 2/4 local 0 on n2 sum 10", "rank 3/4 local 1 on n2 sum 10",
    ], text  # fmt: skip


def test_a_plain_srun_gives_hora_the_same_world(slurm: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "world.py"
    script.write_text(WORLD)
    text = batch(slurm, tmp_path, f"srun {PY} {script}")
    assert ranks(text, "via ") == [
        f"rank {r}/4 local {r % 2} on n{r // 2 + 1} via slurm master n1" for r in range(4)
    ], text
