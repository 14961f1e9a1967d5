"""Training throughput at 2 nodes x 2 ranks on a real Slurm: hora vs DDP, three shapes.

The rows, shapes, correctness check and rounds of ``bench/train_throughput.py`` (same worker,
same table), but its 4 ranks are started by one ``srun -N2 --ntasks-per-node=2`` on the
two-node test cluster of ``scripts/slurm-cluster.sh`` (started here, and stopped at the end,
unless ``SLURM_CONF`` names a running cluster). Each node has its own network namespace,
hostname and ``/dev/shm``: ranks on different nodes meet only over TCP (gloo), as on real
nodes; both nodes share this machine's 2 cores.

Two runs, one per path of hora's CPU buckets: hierarchical (per node through shared memory,
then one leader per node across; the default) and flat (``HORA_HIERARCHICAL_ALLREDUCE=0``),
each with its own DDP rows side by side.

Usage: python bench/slurm_throughput.py [--pairs 10] [--steps 1] [--shapes large,small,cnn]
       [--modes hier,flat]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import train_throughput as tt

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "slurm-cluster.sh"


def run(conf: str, args: argparse.Namespace, out: Path, hier: bool) -> dict[str, object]:
    """Run the worker as 2 x 2 srun tasks; rank 0's JSON result.

    ``hier``: hora's CPU buckets go hierarchically (per node, then across; the default) or
    flat (``HORA_HIERARCHICAL_ALLREDUCE=0``). The DDP rows are the same either way.
    """
    env = dict(os.environ, SLURM_CONF=conf, OMP_NUM_THREADS="1", HORA_BACKEND="gloo",
               HORA_HIERARCHICAL_ALLREDUCE="1" if hier else "0")
    cmd = [
        "srun", "-N2", "--ntasks-per-node=2", "--distribution=block", "--kill-on-bad-exit=1",
        sys.executable, str(Path(tt.__file__).resolve()), "--worker", "--out", str(out),
        "--pairs", str(args.pairs), "--steps", str(args.steps),
        "--check-steps", str(args.check_steps), "--shapes", ",".join(args.shapes),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, timeout=3000)
    return dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    """Start the cluster if needed, run the rows, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--shapes", type=tt._shapes, default=list(tt.SHAPES))
    p.add_argument("--modes", type=lambda v: v.split(","), default=["hier", "flat"],
                   help="hora's bucket path per run: hier (default), flat, or both")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hora-bench-slurm-") as tmp:
        os.chmod(tmp, 0o755)
        conf = os.environ.get("SLURM_CONF")
        where = Path(tmp) / "cluster"
        if not conf:
            subprocess.run([str(CLUSTER), "start", str(where)], check=True, timeout=120)
            conf = str(where / "etc" / "slurm.conf")
        try:
            results = {}
            for mode in args.modes:
                results[mode] = run(conf, args, Path(tmp) / f"{mode}.json", mode == "hier")
        finally:
            if where.exists():
                subprocess.run([str(CLUSTER), "stop", str(where)], check=True, timeout=120)
    summary: dict[str, object] = {"bench": "slurm_throughput", "nodes": 2, "ranks_per_node": 2}
    for mode, data in results.items():
        what = "hierarchical" if mode == "hier" else "flat"
        print(f"2 nodes x 2 ranks (srun on the namespaced test cluster), hora {what}")
        rows = tt.report(data)
        summary[mode] = {
            "ratios": {s: round(r["hora"]["ratio"], 4) for s, r in rows.items()},
            "gloo_ratios": {s: round(r["hora_gloo"]["ratio"], 4) for s, r in rows.items()},
            "sps": {s: {k: round(v["sps"], 1) for k, v in r.items() if "sps" in v}
                    for s, r in rows.items()},
        }  # fmt: skip
    print(f"wall {time.monotonic() - t0:.0f}s")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
