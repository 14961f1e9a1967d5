"""detect_world / rank_env for every launcher hora supports, including bad values."""

from __future__ import annotations

import pytest
from hora.env import DEFAULT_MASTER_PORT, World, _first_slurm_host, detect_world, rank_env
from hora.errors import LauncherEnvError


def test_rank_env_round_trips_through_detect_world() -> None:
    env = rank_env(3, 4, local_rank=1, local_size=2, master_port=1234, cross_rank=1, cross_size=2)
    w = detect_world(env)
    assert w == World(
        rank=3,
        size=4,
        local_rank=1,
        local_size=2,
        cross_rank=1,
        cross_size=2,
        launcher="hora",
        master_addr="127.0.0.1",
        master_port=1234,
    )


def test_torchrun() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "abc",
    }
    w = detect_world(env)
    assert (w.launcher, w.rank, w.size, w.local_rank, w.local_size) == ("torchrun", 5, 8, 1, 4)
    assert (w.cross_rank, w.cross_size, w.master_addr, w.master_port) == (1, 2, "node0", 29400)
    assert w.job_id == "abc"


def test_torchrun_defaults_without_local_vars() -> None:
    w = detect_world({"RANK": "0", "WORLD_SIZE": "2"})
    assert (w.local_rank, w.local_size, w.master_addr, w.master_port) == (
        0,
        2,
        "127.0.0.1",
        DEFAULT_MASTER_PORT,
    )


def test_openmpi_has_no_master_but_a_job_id() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "PMIX_NAMESPACE": "prterun-host-1234@1",
    }
    w = detect_world(env)
    assert (w.launcher, w.rank, w.size, w.local_rank, w.local_size) == ("openmpi", 3, 4, 1, 2)
    assert (w.cross_rank, w.cross_size) == (1, 2)
    assert w.master_addr is None and w.master_port is None
    assert w.job_id == "prterun-host-1234@1"


@pytest.mark.parametrize(
    "local",
    [
        {"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        {"PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"},
    ],
    ids=["intel-hydra", "pmi-local"],
)
def test_mpich_and_intel_mpi(local: dict[str, str]) -> None:
    w = detect_world({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_KVSNAME": "kvs_1", **local})
    assert (w.launcher, w.rank, w.size, w.local_rank, w.local_size) == ("mpich", 1, 2, 1, 2)
    assert w.master_addr is None and w.job_id == "kvs_1"


def test_slurm_uses_first_node_and_job_derived_port() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "2",
        "SLURM_NODELIST": "gpu[03-05]",
        "SLURM_JOB_ID": "12345",
        "SLURM_TASKS_PER_NODE": "2(x3)",
    }
    w = detect_world(env)
    assert (w.launcher, w.rank, w.size, w.local_rank, w.local_size) == ("slurm", 5, 6, 1, 2)
    assert (w.cross_rank, w.cross_size) == (2, 3)
    assert w.master_addr == "gpu03" and w.master_port == DEFAULT_MASTER_PORT + 2345
    assert w.job_id == "12345"


def test_slurm_uneven_tasks_per_node() -> None:
    env = {
        "SLURM_PROCID": "4",
        "SLURM_NTASKS": "5",
        "SLURM_LOCALID": "0",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "a,b",
        "SLURM_TASKS_PER_NODE": "4,1",
    }
    w = detect_world(env)
    assert (w.local_size, w.master_addr) == (1, "a")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("gpu[03-05,07],cpu1", "gpu03"),
        ("a1,b2", "a1"),
        ("n[1-2]-ib", "n1-ib"),
        ("rack-[10,12]", "rack-10"),
        ("x[007]", "x007"),
    ],
)
def test_slurm_nodelist_first_host(nodelist: str, first: str) -> None:
    assert _first_slurm_host(nodelist) == first


def test_master_addr_in_env_wins_over_launcher() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODELIST": "n1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "777",
    }
    w = detect_world(env)
    assert (w.master_addr, w.master_port) == ("h", 777)


def test_no_launcher_is_a_world_of_one() -> None:
    assert detect_world({}) == World()
    assert detect_world({"PATH": "/bin", "MASTER_PORT": "1"}).size == 1


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "?"}, "LOCAL_RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
            "local rank 3",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, "MASTER_PORT"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "1", "PMI_SIZE": "1"}, "rank 1"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "n"}, "SLURM_NTASKS"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": ",n1"}, "SLURM_NODELIST"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], field: str) -> None:
    with pytest.raises(LauncherEnvError, match=field.replace("?", r"\?")):
        detect_world(env)


@pytest.mark.parametrize(("args", "msg"), [((2, 2), "outside"), ((0, 0), ">= 1")])
def test_rank_env_rejects_bad_worlds(args: tuple[int, int], msg: str) -> None:
    with pytest.raises(LauncherEnvError, match=msg):
        rank_env(*args)


def test_horovodrun_alone_is_refused_not_a_world_of_one() -> None:
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}
    with pytest.raises(LauncherEnvError, match="HOROVOD_SIZE=2.*hora run"):
        detect_world(env)
    # the conformance run sets Horovod's variables on top of hora run's: hora run's win
    world = detect_world({**env, "RANK": "1", "WORLD_SIZE": "2"})
    assert (world.rank, world.size) == (1, 2)
    assert detect_world({"HOROVOD_SIZE": "1"}).size == 1
