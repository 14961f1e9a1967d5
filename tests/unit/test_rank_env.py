"""hora.contract's rank contract (re-exported by hora.env): RankEnv round-trips, LAUNCHER_VARS
is the one strip list, and the writers and readers of its variables use its names."""

from __future__ import annotations

import dataclasses

import pytest
from hora.engines import plan
from hora.env import LAUNCHER_VARS, RankEnv, detect_world, rank_env
from hora.errors import LauncherEnvError
from hora.launch.config import LaunchConfig, build_rank_envs

FULL = RankEnv(
    rank=3, world_size=4, local_rank=1, local_world_size=2, cross_rank=1, cross_size=2,
    master_addr="node0", master_port=29500, launcher="hora", backend="nccl", timeout=60.0,
    start_timeout=2.5, gpu="6,7", slots="6,7", gpus_per_rank=2, job_id=17, restart_count=1,
    attempt="inst/17/2", rdzv_secret="s" * 64, engine_world="/run/w.json",
    master_host="gpu01", slurm_job_id="123", node="gpu02", engine_connection='{"key": "k"}',
    preflight="1", preflight_warn_below=0.5, preflight_fail_below=0.3,
    preflight_baseline="/srv/base", preflight_fd="5:14:2201", elastic_dir="/tmp/el",
    elastic_worker="w3", elastic_timeout=600.0,
    restore_dir="/w/.hora-parked/session-3-0123456789abcdef", restore_size=2,
)  # fmt: skip


def test_every_field_is_set_in_the_full_example() -> None:
    assert all(getattr(FULL, f.name) is not None for f in dataclasses.fields(RankEnv))


@pytest.mark.parametrize("value", [RankEnv(), FULL, RankEnv(rank=0, world_size=1)])
def test_round_trip(value: RankEnv) -> None:
    assert RankEnv.from_environ(value.to_environ()) == value


def test_to_environ_writes_only_set_fields_and_the_aliases() -> None:
    assert RankEnv().to_environ() == {}
    env = RankEnv(local_world_size=2, cross_rank=1, timeout=60.0).to_environ()
    assert env == {"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
                   "GROUP_RANK": "1", "HORA_TIMEOUT": "60"}  # fmt: skip


def test_from_environ_ignores_blank_and_unrelated_variables() -> None:
    got = RankEnv.from_environ({"RANK": " ", "PATH": "/bin", "HORA_GPU": "3"})
    assert got == RankEnv(gpu="3")


def test_first_name_set_wins() -> None:
    env = {"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2", "GROUP_RANK": "1", "CROSS_RANK": "0"}
    got = RankEnv.from_environ(env)
    assert (got.local_world_size, got.cross_rank) == (4, 0)
    assert RankEnv.from_environ({"LOCAL_SIZE": "2", "GROUP_RANK": "1"}) == RankEnv(
        local_world_size=2, cross_rank=1
    )


@pytest.mark.parametrize(
    ("var", "value", "what"),
    [("RANK", "one", "an integer"), ("MASTER_PORT", "80a", "an integer"),
     ("HORA_JOB_ID", "7.5", "an integer"), ("HORA_TIMEOUT", "soon", "a number")],
)  # fmt: skip
def test_a_value_that_does_not_parse_names_the_variable(var: str, value: str, what: str) -> None:
    with pytest.raises(LauncherEnvError, match=f"{var}='{value}' is not {what}"):
        RankEnv.from_environ({var: value})


def test_rank_env_is_the_contract_s_world() -> None:
    env = rank_env(1, 2, master_port=1234)
    assert RankEnv.from_environ(env) == RankEnv(
        rank=1, world_size=2, local_rank=1, local_world_size=2, cross_rank=0, cross_size=1,
        master_addr="127.0.0.1", master_port=1234, launcher="hora",
    )  # fmt: skip


def test_launcher_vars_hold_every_world_variable_hora_writes() -> None:
    assert set(rank_env(0, 1)) <= set(LAUNCHER_VARS)
    assert len(set(LAUNCHER_VARS)) == len(LAUNCHER_VARS)


PARENT = {name: "9" for name in LAUNCHER_VARS} | {"HOME": "/h", "HORA_RDZV_SECRET": "old"}


def test_hora_run_strips_every_launcher_variable() -> None:
    (env,) = build_rank_envs(LaunchConfig(np=1, command=("true",)), PARENT, 1234)
    assert {k for k in LAUNCHER_VARS if k in env and env[k] == "9"} == set()
    assert env["HOME"] == "/h" and env["HORA_RDZV_SECRET"] != "old"


def test_engines_strip_the_launcher_variables_and_the_kernel_s_ties() -> None:
    parent = PARENT | {"JPY_PARENT_PID": "1", "IPP_CONNECTION_INFO": "{}", "HORA_GPU": "5"}
    env = plan.engine_env(parent, rank=0, size=1, device=None, master_port=1234,
                          backend="gloo", timeout_s=60)  # fmt: skip
    assert {k for k in LAUNCHER_VARS if env.get(k) == "9"} == set()
    assert not {"JPY_PARENT_PID", "IPP_CONNECTION_INFO", "HORA_GPU"} & set(env)
    assert env["HOME"] == "/h"


def test_only_reads_the_fields_named() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "HORA_JOB_ID": "not a number"}
    assert RankEnv.from_environ(env, only=("rank",)) == RankEnv(rank=1)
    assert detect_world(env).rank == 1  # the world's reader is not stopped by other values
    with pytest.raises(ValueError, match="no field ranks"):
        RankEnv.from_environ(env, only=("ranks",))


def test_the_slurm_rank_launcher_writes_only_the_contract_s_names() -> None:
    # slurm_rank.py runs on the nodes with the standard library alone (python -I -S), so it
    # spells the names itself: they must be the contract's, and parse back through it
    from hora_service.runtimes import slurm_rank

    launch = RankEnv(rank=0, world_size=4, local_world_size=2, gpus_per_rank=1).to_environ()
    task = {"SLURM_LOCALID": "1", "SLURM_PROCID": "3", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
            "SLURM_JOB_ID": "42", "HORA_MASTER_HOST": "127.0.0.1",
            "CUDA_VISIBLE_DEVICES": "0,1"}  # fmt: skip
    placed = slurm_rank.placed(launch, task)
    assert set(placed) - {"CUDA_VISIBLE_DEVICES"} <= set(FULL.to_environ())
    got = RankEnv.from_environ(placed)
    assert (got.rank, got.local_rank, got.cross_rank, got.gpu) == (3, 1, 1, "1")
    assert (got.slurm_job_id, got.master_port) == ("42", 20042)


def test_secrets_stay_out_of_the_repr() -> None:
    assert "s" * 64 not in repr(FULL) and '"k"' not in repr(FULL)


@pytest.mark.parametrize(
    ("kind", "want"),
    [("job", (("HORA_PREFLIGHT", "1"), ("HORA_PREFLIGHT_FAIL_BELOW", "0.3"),
              ("HORA_PREFLIGHT_BASELINE", "/srv/base"))),
     ("session", (("HORA_PREFLIGHT_FAIL_BELOW", "0.3"), ("HORA_PREFLIGHT_BASELINE", "/srv/base")))],
)  # fmt: skip
def test_the_service_asks_for_the_preflight_in_the_contract_s_names(
    kind: str, want: tuple[tuple[str, str], ...]
) -> None:
    from pathlib import Path
    from types import SimpleNamespace

    from hora_service.jobs.launch import preflight_env

    settings = SimpleNamespace(job_preflight=True, job_preflight_fail_below=0.3,
                               job_preflight_baseline_dir=Path("/srv/base"))  # fmt: skip
    asked = preflight_env(settings, kind)  # type: ignore[arg-type]
    assert asked == want
    got = RankEnv.from_environ(dict(asked))
    assert (got.preflight_fail_below, got.preflight_baseline) == (0.3, "/srv/base")

def test_the_batch_script_exports_the_contract_s_master_host() -> None:
    from hora_service.runtimes.sbatch import BATCH_SCRIPT

    var = RankEnv.var("master_host")
    assert f"\n{var}=$(hostname)\nexport {var}\n" in BATCH_SCRIPT
    assert "@MASTER_HOST@" not in BATCH_SCRIPT
