"""Rank launcher of the slurm runtime: places one ``srun`` task in the world, then runs the shim.

Control plane helper, run on a node by the batch script's ``srun`` as
``python -I -S slurm_rank.py RUN_DIR`` (standard library only). The service
wrote one launch file per rank into ``RUN_DIR`` before submitting (the rank contract with
what is known before Slurm places the job); this fills in what only the allocation knows
and hands over to the rank shim (:mod:`hora_service.runtimes.shim`), which records the
rank's pid, log and exit code in ``RUN_DIR`` as in the local runtime:

- ``RANK`` = ``SLURM_PROCID``, ``LOCAL_RANK`` = ``SLURM_LOCALID``, ``CROSS_RANK`` =
  ``SLURM_NODEID``, ``CROSS_SIZE`` = the job's nodes;
- ``MASTER_ADDR``: the address of the first node (the batch script's host, which runs rank
  0 with block distribution) as this node resolves it; ``MASTER_PORT`` from the job id;
- ``CUDA_VISIBLE_DEVICES``: the node's GPUs as Slurm bound them; ``HORA_GPU`` /
  ``HORA_SLOTS``: this rank's own share of them; ``HORA_SLURM_JOB_ID`` and ``HORA_NODE``.

A node that cannot see ``RUN_DIR`` (a filesystem it does not share with the service) is
named on stderr, which srun forwards to the batch job's output, and the task exits 3.
"""

import json
import os
import socket
import sys

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim.py")
PORT_BASE = 20000
PORT_SPAN = 20000
NOT_SHARED = 3


def _address(host: str) -> str:
    """``host``'s IPv4 address as this node resolves it (the name itself if it cannot)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def placed(env: dict, task: dict) -> dict:
    """The rank's environment ``env`` with its place in the allocation ``task`` (Slurm's vars)."""
    local = int(task["SLURM_LOCALID"])
    per_node = int(env["LOCAL_SIZE"])
    gpus_per_rank = int(env.get("HORA_GPUS_PER_RANK", "1"))
    out = dict(env)
    out.update(
        RANK=task["SLURM_PROCID"],
        LOCAL_RANK=str(local),
        CROSS_RANK=task["SLURM_NODEID"],
        GROUP_RANK=task["SLURM_NODEID"],
        CROSS_SIZE=task.get("SLURM_JOB_NUM_NODES") or task.get("SLURM_NNODES", "1"),
        MASTER_ADDR=_address(task.get("HORA_MASTER_HOST", "127.0.0.1")),
        MASTER_PORT=str(PORT_BASE + int(task["SLURM_JOB_ID"]) % PORT_SPAN),
        HORA_SLURM_JOB_ID=task["SLURM_JOB_ID"],
        HORA_NODE=socket.gethostname(),
    )
    gpus = [g for g in task.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if gpus and len(gpus) >= per_node * gpus_per_rank:
        own = ",".join(gpus[local * gpus_per_rank : (local + 1) * gpus_per_rank])
        out.update(CUDA_VISIBLE_DEVICES=",".join(gpus), HORA_SLOTS=own, HORA_GPU=own)
    else:
        out.update(CUDA_VISIBLE_DEVICES="", HORA_SLOTS=str(local))
        out.pop("HORA_GPU", None)
    return out


def launch_file(run_dir: str, rank: int) -> str:
    """``RUN_DIR/rank<R>.launch``, the rank's launch file.

    The name of :class:`hora_service.runtimes.paths.JobPaths`, spelled again here (standard
    library only); a unit test checks that they agree.
    """
    return os.path.join(run_dir, f"rank{rank}.launch")


def main(argv: list) -> int:
    """Run ``argv = [RUN_DIR]`` as this task's rank (does not return)."""
    rank = os.environ.get("SLURM_PROCID", "")
    if len(argv) != 1 or not rank.isdigit():
        sys.stderr.write("usage: slurm_rank.py RUN_DIR (in an srun task)\n")
        return 2
    run_dir = argv[0]
    path = launch_file(run_dir, int(rank))
    try:
        with open(path) as f:
            launch = json.load(f)
    except OSError as e:
        sys.stderr.write(
            f"hora: node {socket.gethostname()} cannot read the job's directory {run_dir} "
            f"({e.strerror}): it must be on a filesystem the service and every node share\n"
        )
        return NOT_SHARED
    launch["env"] = placed(launch["env"], dict(os.environ))
    tmp = f"{path}.tmp-{socket.gethostname()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(launch, f)
    os.replace(tmp, path)
    python = sys.executable
    os.execv(python, [python, "-I", "-S", SHIM, run_dir, rank])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
