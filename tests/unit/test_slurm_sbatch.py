"""The sbatch renderer: golden files (hostile names, paths and env values) and the layout rules.

Golden files live in tests/unit/golden_slurm; regenerate with HORA_UPDATE_GOLDEN=1 and read
the diff: the argument list must never carry the user's command or environment, and the batch
script is the same constant for every job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from hora.errors import SpecError
from hora.spec import JobSpec
from hora_service.runtimes.sbatch import (
    BATCH_SCRIPT,
    Layout,
    SlurmOptions,
    job_name,
    layout_for,
    render_sbatch,
    time_limit,
)

GOLDEN = Path(__file__).parent / "golden_slurm"
HOSTILE = "$(touch /tmp/pwned) `id` ; rm -rf / # 'q' \"d\" %j %x\n"
TOOLS = {"sbatch": "/usr/bin/sbatch", "srun": "/usr/bin/srun", "path": "/usr/bin:/bin",
         "conf": "/etc/slurm/slurm.conf"}  # fmt: skip
LAUNCHER = ["/venv/bin/python", "-I", "-S", "/venv/hora_service/runtimes/slurm_rank.py"]

CASES = {
    "plain": (JobSpec(command=["python", "train.py"], workers=4), SlurmOptions(slots_per_node=2)),
    "hostile": (
        JobSpec(
            name="a b.c-d",
            command=["python", "-c", HOSTILE, HOSTILE],
            env={"EVIL": HOSTILE, "PATH": "/evil:$PATH"},
            working_dir="dir with spaces/$(x)",
            workers=2,
            gpus_per_worker=2,
            timeout_s=90.5,
            priority="low",
        ),
        SlurmOptions(slots_per_node=4, partition="gpu_p13", account="abc@v100", qos="qos_t3",
                     high_qos="qos_t4", low_nice=50, signal_s=120),
    ),
    "high_cpu_only": (
        JobSpec(command=["x"], workers=3, priority="high"),
        SlurmOptions(slots_per_node=3, gpus=False, qos="normal", high_qos="urgent",
                     default_time_min=30),
    ),
}  # fmt: skip


def render(case: str) -> dict[str, object]:
    spec, opts = CASES[case]
    layout = layout_for(spec.workers, spec.gpus_per_worker, opts.slots_per_node, None)
    root = Path("/data/hora %j/logs")
    sub = render_sbatch(
        spec, name=job_name("3f2a9c1d", 7, 2), run_dir=root / "7" / "2",
        workdir=Path("/work") / (spec.working_dir or ""), layout=layout, opts=opts,
        tools=TOOLS, launcher=LAUNCHER, batch_script=root / "7" / "2" / "hora-batch.sh",
    )  # fmt: skip
    return {"argv": sub.argv, "env": sub.env}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sbatch_argv_matches_the_golden_file(case: str) -> None:
    got = json.dumps(render(case), indent=1) + "\n"
    path = GOLDEN / f"{case}.json"
    if os.environ.get("HORA_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_user_value_reaches_sbatch(case: str) -> None:
    spec, _ = CASES[case]
    text = json.dumps(render(case))
    for value in [*spec.command[2:], *spec.env.values()]:  # the command's own words
        assert json.dumps(value)[1:-1] not in text


def test_the_batch_script_is_constant_and_valid_sh(tmp_path: Path) -> None:
    assert (GOLDEN / "batch.sh").read_text() == BATCH_SCRIPT
    script = tmp_path / "b.sh"
    script.write_text(BATCH_SCRIPT)
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0


def test_output_path_escapes_slurm_patterns() -> None:
    argv = render("hostile")["argv"]
    assert "--output=/data/hora %%j/logs/7/2/slurm.out" in argv  # type: ignore[operator]


@pytest.mark.parametrize(
    ("workers", "gpw", "per_node", "want"),
    [(1, 1, 4, Layout(1, 1)), (4, 1, 2, Layout(2, 2)), (8, 2, 8, Layout(2, 4)),
     (2, 1, 1, Layout(2, 1))],
)  # fmt: skip
def test_layout(workers: int, gpw: int, per_node: int, want: Layout) -> None:
    assert layout_for(workers, gpw, per_node, None) == want


@pytest.mark.parametrize(
    ("workers", "gpw", "per_node", "field"), [(3, 1, 2, "workers"), (1, 4, 2, "gpus_per_worker")]
)
def test_layout_refusals_name_the_field(workers: int, gpw: int, per_node: int, field: str) -> None:
    with pytest.raises(SpecError) as e:
        layout_for(workers, gpw, per_node, None)
    assert e.value.field == field


def test_time_limit_adds_grace_and_rounds_up() -> None:
    opts = SlurmOptions(grace_s=10, default_time_min=None)
    assert (
        time_limit(50, opts) == 1
        and time_limit(51, opts) == 2
        and time_limit(None, opts) is None
    )


PARTS = (
    "PartitionName=debug Default=YES MaxNodes=UNLIMITED Nodes=n[1-3] TotalNodes=3\n"
    "PartitionName=small Default=NO MaxNodes=1 Nodes=n[1-2] TotalNodes=2\n"
)
NODES = (
    "NodeName=n1 CPUTot=8 CPUEfctv=6 Gres=gpu:4 Partitions=debug,small\n"
    "NodeName=n2 CPUTot=8 Gres=gpu:a100:2(S:0) Partitions=debug,small\n"
    "NodeName=n3 CPUTot=4 Gres=(null) Partitions=debug\n"
    "NodeName=other CPUTot=64 Gres=gpu:8 Partitions=big\n"
)


def test_a_partition_offers_what_its_smallest_node_reports() -> None:
    from hora_service.runtimes.slurm_facts import Partition, parse_partition

    # the default partition: n3 has no GPU, so no GPU job fits every node; its CPUs do
    assert parse_partition(PARTS, NODES, None) == Partition("debug", 3, 0, 4)
    # MaxNodes caps the nodes one job may span; CPUEfctv wins over CPUTot
    assert parse_partition(PARTS, NODES, "small,debug") == Partition("small", 1, 2, 6)


@pytest.mark.parametrize(
    ("parts", "wanted", "said"),
    [
        (PARTS, "gpu", "Slurm has no partition 'gpu' (its partitions: debug, small)"),
        ("PartitionName=x Default=NO Nodes=n1", None, "Slurm has no default partition"),
        ("PartitionName=x Default=YES Nodes=z[1-2]", None, "partition 'x' has no node"),
    ],
)
def test_a_partition_slurm_does_not_have_says_so(parts: str, wanted: str | None,
                                                   said: str) -> None:
    from hora_service.runtimes.slurm_facts import parse_partition

    with pytest.raises(ValueError, match="^" + re.escape(said)):
        parse_partition(parts, NODES, wanted)
