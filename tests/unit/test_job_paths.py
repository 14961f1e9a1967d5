"""One layout of an attempt's files (JobPaths), and the standalone scripts' copies agree with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hora.spec import JobSpec
from hora_service.runtimes import container_init, scratch, shim, slurm_rank
from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.paths import JobPaths

RANKS = [0, 1, 7, 10, 123]
RUN_DIRS = ["/data/logs/7/2", "/srv/with space/logs/12/1"]


def test_paths_are_built_from_the_logs_dir_the_job_and_the_attempt() -> None:
    p = JobPaths.of(Path("/data/logs"), 7, 2)
    assert p == JobPaths(Path("/data/logs/7/2"))
    assert p.job_dir == JobPaths.job_dir_of(Path("/data/logs"), 7) == Path("/data/logs/7")
    assert [p.log(3), p.pid(3), p.exit(3), p.launch(3)] == [
        Path("/data/logs/7/2") / n for n in ("rank3.log", "rank3.pid", "rank3.exit", "rank3.launch")
    ]
    assert [f.name for f in (p.container_json, p.container_hits, p.batch_script, p.slurm_out,
                             p.slurm_jobid, p.elastic_hosts)] == [
        "container.json", "container.hits", "hora-batch.sh", "slurm.out", "slurm.jobid",
        "elastic.hosts"]  # fmt: skip
    assert all(f.parent == p.run_dir for f in (p.container_json, p.elastic_hosts))


def test_an_attempts_plan_names_its_files_with_jobpaths(tmp_path: Path) -> None:
    plan = AttemptPlan(job_id=7, attempt=2, spec=JobSpec(command=["true"]), slots=(0,),
                       slot_kind="cpu", run_dir=tmp_path / "7" / "2", workdir=tmp_path,
                       master_port=29500)  # fmt: skip
    assert plan.paths == JobPaths.of(tmp_path, 7, 2)


@pytest.mark.parametrize("run_dir", RUN_DIRS)
@pytest.mark.parametrize("rank", RANKS)
def test_the_shims_stdlib_names_agree(run_dir: str, rank: int) -> None:
    # shim.py runs with ``python -I -S`` and imports only the standard library
    p = JobPaths(Path(run_dir))
    for kind, path in (("log", p.log), ("pid", p.pid), ("exit", p.exit), ("launch", p.launch)):
        assert shim.rank_file(run_dir, rank, kind) == str(path(rank))
    assert os.path.join(run_dir, shim.FIGURES_FILE) == str(p.preflight)
    assert shim.TMP_VAR == scratch.VAR


def test_the_shims_preflight_names_agree_with_the_contract_and_the_writer() -> None:
    from hora.contract import RankEnv
    from hora.torch import preflight

    assert shim.FIGURES_VAR == RankEnv.var("preflight_fd")
    assert shim.FIGURES_MAX == preflight.FIGURES_MAX


@pytest.mark.parametrize("run_dir", RUN_DIRS)
@pytest.mark.parametrize("rank", RANKS)
def test_the_container_inits_and_slurm_launchers_stdlib_names_agree(run_dir: str,
                                                                     rank: int) -> None:
    p = JobPaths(Path(run_dir))
    assert container_init.rank_log(run_dir, rank) == str(p.log(rank))
    assert os.path.join(run_dir, container_init.CONTAINER_JSON) == str(p.container_json)
    assert os.path.join(run_dir, container_init.CONTAINER_HITS) == str(p.container_hits)
    assert slurm_rank.launch_file(run_dir, rank) == str(p.launch(rank))
