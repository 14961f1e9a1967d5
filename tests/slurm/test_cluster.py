"""The test cluster itself: two real slurmd nodes with their own hostnames and addresses."""

from __future__ import annotations

import pytest
from helpers.slurm_cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def test_two_nodes_with_own_hostnames_addresses_and_gpus(slurm: Cluster) -> None:
    out = slurm.run(
        "srun", "-N2", "--ntasks-per-node=1", "--gres=gpu:2", "-l", "sh", "-c",
        'echo "$(hostname) $(hostname -i) $CUDA_VISIBLE_DEVICES"',
    )  # fmt: skip
    lines = sorted(line.split(": ", 1)[1] for line in out.splitlines())
    assert lines == ["n1 10.250.0.11 0,1", "n2 10.250.0.12 0,1"], out
    nodes = slurm.run("sinfo", "-h", "-N", "-o", "%N %T %G").split("\n")
    assert sorted(n.split()[0] for n in nodes if n) == ["n1", "n1", "n2", "n2"]  # 2 partitions
