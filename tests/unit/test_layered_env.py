"""hora.env.layered_env, the one builder of a rank's environment: its layers' precedence
(base < account < job < rank, defaults only fill gaps), the strip set, the order of the names,
that it changes nothing it is given, and that every launcher uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hora.env import LAUNCHER_VARS, TORCHRUN_DEFAULTS, Account, layered_env

ANN = Account(user="ann", home="/home/ann")


def test_each_layer_wins_over_the_ones_before() -> None:
    base = {"X": "base", "HOME": "/root", "USER": "root", "PATH": "/bin"}
    job = {"X": "job", "HOME": "/mine"}
    env = layered_env(base, account=ANN, job=job, rank={"X": "hora"})
    assert env == {"X": "hora", "HOME": "/mine", "USER": "ann", "PATH": "/bin", "LOGNAME": "ann"}
    env = layered_env(base, account=ANN, job={"Y": "1"})
    got = (env["X"], env["HOME"], env["USER"], env["LOGNAME"])
    assert got == ("base", "/home/ann", "ann", "ann")
    assert layered_env(base, job=job)["HOME"] == "/mine"
    assert layered_env(base)["USER"] == "root"  # no account: the base's own


@pytest.mark.parametrize(
    ("layer", "expected"),
    [("base", "base"), ("account", "/home/ann"), ("job", "job"), (None, "default")],
)
def test_a_default_fills_only_a_gap(layer: str | None, expected: str) -> None:
    name = "HOME"
    base = {name: "base"} if layer == "base" else {}
    job = {name: "job"} if layer == "job" else {}
    account = ANN if layer == "account" else None
    env = layered_env(base, account=account, job=job, rank={name: "default"}, defaults={name})
    assert env[name] == expected


def test_strip_removes_only_the_base_s_names() -> None:
    base = {"RANK": "5", "MASTER_PORT": "1", "PATH": "/bin"}
    env = layered_env(base, strip=LAUNCHER_VARS, job={"MASTER_PORT": "2"}, rank={"RANK": "0"})
    assert env == {"PATH": "/bin", "MASTER_PORT": "2", "RANK": "0"}
    assert "RANK" not in layered_env(base, strip=LAUNCHER_VARS)


def test_a_name_keeps_the_place_of_the_first_layer_that_set_it() -> None:
    env = layered_env(
        {"B": "1", "A": "1"}, account=ANN, job={"J": "1", "A": "2"},
        rank={"R": "1", "B": "3", **TORCHRUN_DEFAULTS}, defaults=TORCHRUN_DEFAULTS,
    )  # fmt: skip
    assert list(env) == [
        "B", "A", "HOME", "USER", "LOGNAME", "J", "R", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
    ]  # fmt: skip
    assert (env["A"], env["B"]) == ("2", "3")


def test_the_inputs_are_left_as_they_were() -> None:
    base, job, rank = {"A": "1", "RANK": "2"}, {"A": "2"}, {"A": "3"}
    env = layered_env(base, strip={"RANK"}, job=job, rank=rank)
    env["A"] = "4"
    assert (base, job, rank) == ({"A": "1", "RANK": "2"}, {"A": "2"}, {"A": "3"})


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
    }


def test_every_module_that_places_a_rank_builds_its_environment_with_layered_env() -> None:
    # a launcher that writes the world's variables (rank_env) layers the rest with the one
    # builder, never by hand
    root = Path(__file__).resolve().parents[2]
    product = [*(root / "kernels" / "hora").rglob("*.py"), *(root / "service").rglob("*.py")]
    placing = {p.relative_to(root).as_posix() for p in product if "rank_env" in _calls(p)}
    assert placing == {
        "kernels/hora/engines/plan.py", "kernels/hora/launch/config.py",
        "kernels/hora/launch/elastic.py", "service/hora_service/runtimes/core.py",
    }  # fmt: skip
    assert all("layered_env" in _calls(root / p) for p in placing)
