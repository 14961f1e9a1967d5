"""hora.env's launcher variables: LAUNCHER_VARS is the one list a launcher strips."""

from __future__ import annotations

from hora.engines import plan
from hora.env import LAUNCHER_VARS, rank_env
from hora.launch.config import LaunchConfig, build_rank_envs


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
