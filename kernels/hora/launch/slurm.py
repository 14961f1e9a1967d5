"""``hora run`` inside a Slurm allocation: one ``srun`` over the allocation's nodes (data plane).

Under ``salloc`` or in an ``sbatch`` script whose allocation spans more than one node,
``hora run -np N python train.py`` hands the ranks to Slurm: it runs ``srun --ntasks=N`` over
the allocation's nodes (block distribution, ranks labelled), and each rank reads its place
from Slurm's variables (:func:`hora.env.detect_world`: ``SLURM_PROCID``, ``SLURM_LOCALID``,
the first node as the rendezvous address). A Jean Zay-style batch script therefore needs no
change but the import line, whether it calls ``srun python train.py`` or ``hora run``.
Inside a step (``SLURM_STEP_ID`` set), or in a one-node allocation, ``hora run`` starts its
ranks itself as everywhere else.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hora.errors import SpecError


def allocation_nodes(environ: Mapping[str, str]) -> int:
    """Nodes of the Slurm allocation this process runs in; 0 outside one or inside a step.

    Example:
        >>> allocation_nodes({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"})
        2
        >>> allocation_nodes({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"})
        0
    """
    if "SLURM_JOB_ID" not in environ or "SLURM_STEP_ID" in environ:
        return 0
    raw = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "0"
    return int(raw) if raw.isdigit() else 0


def srun_argv(np: int, command: Sequence[str], nodes: int) -> list[str]:
    """The ``srun`` that starts ``np`` ranks of ``command`` over ``nodes`` allocated nodes.

    Raises:
        SpecError: fewer ranks than nodes would leave a node without one (field ``-np``).

    Example:
        >>> srun_argv(4, ["python", "train.py"], 2)[:4]
        ['srun', '--ntasks=4', '--nodes=2', '--distribution=block']
    """
    if np < nodes:
        raise SpecError("-np", f"{np} ranks cannot spread over the allocation's {nodes} nodes")
    return [
        "srun", f"--ntasks={np}", f"--nodes={nodes}", "--distribution=block",
        "--kill-on-bad-exit=1", "--label", "--", *command,
    ]  # fmt: skip
