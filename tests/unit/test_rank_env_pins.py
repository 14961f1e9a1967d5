"""Every rank-environment builder's result pinned on representative inputs: keys, values and
order (the launch file's text keeps the order), so moving them onto one builder
(:func:`hora.env.layered_env`) is shown to change nothing.

The service's local runtime (and Slurm's, which adds the node placement), the docker runtime's
container environment, the notebook engines' and ``hora run``'s: each layers the same parts
(base, account, job, the rank contract, hora's forced values and defaults) with its own
precedence rules, spelled out case by case below.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hora.engines.plan import INLINE_MPL, engine_env
from hora.launch.config import ElasticConfig, LaunchConfig, build_rank_envs
from hora.launch.elastic import ElasticDriver
from hora.spec import JobSpec
from hora_service.identity import RunAs
from hora_service.runtimes import AttemptPlan
from hora_service.runtimes.containment import Container
from hora_service.runtimes.core import rank_environment
from hora_service.runtimes.docker import container_env

Items = list[tuple[str, str]]
PREFLIGHT = (("HORA_PREFLIGHT", "1"), ("HORA_PREFLIGHT_FAIL_BELOW", "0.5"))
SERVICE = {
    "PATH": "/bin", "HOME": "/root", "USER": "root", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "0",
    "CUDA_VISIBLE_DEVICES": "0", "HORA_PREFLIGHT_FAIL_BELOW": "0.9", "OMP_NUM_THREADS": "3",
}  # fmt: skip
ANN = RunAs(uid=1234, gid=1234, home=Path("/home/hora-ann"), user="hora-ann")


def world(rank: int, size: int, port: int, *, first: bool = True) -> Items:
    """The world variables hora.env.rank_env writes (one host), spelled out."""
    got = [
        ("WORLD_SIZE", str(size)), ("LOCAL_RANK", str(rank)), ("LOCAL_WORLD_SIZE", str(size)),
        ("LOCAL_SIZE", str(size)), ("CROSS_RANK", "0"), ("GROUP_RANK", "0"), ("CROSS_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("HORA_LAUNCHER", "hora"),
    ]  # fmt: skip
    return [("RANK", str(rank)), *got] if first else got


def plan(kind: str, spec: dict[str, object], **kw: object) -> AttemptPlan:
    return AttemptPlan(
        job_id=7, attempt=3, spec=JobSpec.model_validate({"command": ["python", "t.py"], **spec}),
        slots=(4, 5, 6, 7), slot_kind=kind, run_dir=Path("/r"), workdir=Path("/w"),
        master_port=29999, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def gpu_plan() -> AttemptPlan:
    job = {"RANK": "99", "HOME": "/mine", "HORA_PREFLIGHT": "0", "SEED": "1"}
    return plan(
        "gpu", {"workers": 2, "gpus_per_worker": 2, "env": job}, run_as=ANN,
        container=Container(kind="tag", tag="hora/7/3"), preflight_env=PREFLIGHT,
        rdzv_secret="s" * 8,
    )  # fmt: skip


def test_a_multi_user_gpu_rank_of_the_local_runtime() -> None:
    # base < account < job < contract < forced; the job's HORA_PREFLIGHT=0 (turning its own
    # preflight off) and HOME win, its RANK does not; the service's CUDA_VISIBLE_DEVICES and
    # PYTHONUNBUFFERED do not either (they keep their place in the order)
    assert list(rank_environment(gpu_plan(), 1, SERVICE).items()) == [
        ("PATH", "/bin"), ("HOME", "/mine"), ("USER", "hora-ann"), ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"), ("CUDA_VISIBLE_DEVICES", "4,5,6,7"),
        ("HORA_PREFLIGHT_FAIL_BELOW", "0.5"), ("OMP_NUM_THREADS", "3"),
        ("LOGNAME", "hora-ann"), ("RANK", "1"), ("HORA_PREFLIGHT", "0"), ("SEED", "1"),
        *world(1, 2, 29999, first=False),
        ("HORA_GPU", "6,7"), ("HORA_SLOTS", "6,7"), ("HORA_JOB_ID", "7"),
        ("HORA_RESTART_COUNT", "2"), ("HORA_ATTEMPT", "hora/7/3"),
        ("HORA_RDZV_SECRET", "ssssssss"),
    ]  # fmt: skip


def test_a_single_user_cpu_rank_of_the_local_runtime() -> None:
    p = plan("cpu", {"workers": 4, "env": {"A": "1", "HORA_JOB_ID": "x"}}, preflight_env=PREFLIGHT)
    # no account: the service's HOME/USER stay; CPU slots: CUDA_VISIBLE_DEVICES is empty;
    # HORA_PREFLIGHT, set by nobody before, comes last
    assert list(rank_environment(p, 2, SERVICE).items()) == [
        ("PATH", "/bin"), ("HOME", "/root"), ("USER", "root"), ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"), ("CUDA_VISIBLE_DEVICES", ""),
        ("HORA_PREFLIGHT_FAIL_BELOW", "0.5"), ("OMP_NUM_THREADS", "3"), ("A", "1"),
        ("HORA_JOB_ID", "7"), *world(2, 4, 29999), ("HORA_SLOTS", "6"),
        ("HORA_RESTART_COUNT", "2"), ("HORA_PREFLIGHT", "1"),
    ]  # fmt: skip


def test_a_rank_in_a_container() -> None:
    image = ["PATH=/usr/local/bin:/bin", "LANG=en", "X=1"]
    service = {**SERVICE, "LC_ALL": "C", "PASS": "p"}
    env = container_env(gpu_plan(), 0, image, service, ["PASS", "PATH"])
    # the image's PATH, never the host's; HOME /tmp; the container's GPUs count from 0
    assert list(env.items()) == [
        ("PATH", "/usr/local/bin:/bin"), ("LANG", "C.UTF-8"), ("X", "1"), ("LC_ALL", "C"),
        ("PASS", "p"), ("HOME", "/tmp"), ("USER", "hora-ann"), ("LOGNAME", "hora-ann"),
        ("RANK", "0"), ("HORA_PREFLIGHT", "0"), ("SEED", "1"), *world(0, 2, 29999, first=False),
        ("CUDA_VISIBLE_DEVICES", "0,1,2,3"), ("HORA_GPU", "4,5"), ("HORA_SLOTS", "4,5"),
        ("HORA_JOB_ID", "7"), ("HORA_RESTART_COUNT", "2"), ("HORA_ATTEMPT", "hora/7/3"),
        ("HORA_RDZV_SECRET", "ssssssss"), ("PYTHONUNBUFFERED", "1"),
        ("HORA_PREFLIGHT_FAIL_BELOW", "0.5"),
    ]  # fmt: skip


KERNEL = {
    "PATH": "/bin", "RANK": "5", "MASTER_PORT": "1", "HORA_RDZV_SECRET": "k", "HORA_GPU": "0",
    "JPY_PARENT_PID": "9", "IPP_CONNECTION_INFO": "{}", "CUDA_VISIBLE_DEVICES": "0",
    "PYTHONUNBUFFERED": "0", "OMP_NUM_THREADS": "8", "MPLBACKEND": "agg",
}  # fmt: skip


def test_a_gpu_engine() -> None:
    env = engine_env(
        KERNEL, rank=1, size=2, device="3", master_port=1234, backend="nccl", timeout_s=60,
        gpus=["1", "3"], rdzv_secret="c",
    )  # fmt: skip
    # the kernel's world, GPU and ties to Jupyter/ipyparallel are stripped; its OMP stays
    assert list(env.items()) == [
        ("PATH", "/bin"), ("CUDA_VISIBLE_DEVICES", "1,3"), ("PYTHONUNBUFFERED", "1"),
        ("OMP_NUM_THREADS", "8"), ("MPLBACKEND", INLINE_MPL), *world(1, 2, 1234),
        ("HORA_BACKEND", "nccl"), ("HORA_TIMEOUT", "60"), ("HORA_GPU", "3"),
        ("HORA_RDZV_SECRET", "c"),
    ]  # fmt: skip


def test_cpu_engines() -> None:
    no_omp = {k: v for k, v in KERNEL.items() if k != "OMP_NUM_THREADS"}
    env = engine_env(
        no_omp, rank=0, size=2, device=None, master_port=1234, backend="gloo", timeout_s=7.5,
        threads=2,
    )  # fmt: skip
    # a CPU engine keeps the kernel's CUDA_VISIBLE_DEVICES and gets OMP only if it has none
    assert list(env.items()) == [
        ("PATH", "/bin"), ("CUDA_VISIBLE_DEVICES", "0"), ("PYTHONUNBUFFERED", "1"),
        ("MPLBACKEND", INLINE_MPL), *world(0, 2, 1234), ("HORA_BACKEND", "gloo"),
        ("HORA_TIMEOUT", "7.5"), ("OMP_NUM_THREADS", "2"),
    ]  # fmt: skip
    env = engine_env(
        KERNEL, rank=0, size=1, device=None, master_port=1234, backend="gloo", timeout_s=7.5
    )
    assert list(env.items()) == [
        ("PATH", "/bin"), ("CUDA_VISIBLE_DEVICES", "0"), ("PYTHONUNBUFFERED", "1"),
        ("OMP_NUM_THREADS", "8"), ("MPLBACKEND", INLINE_MPL), *world(0, 1, 1234),
        ("HORA_BACKEND", "gloo"), ("HORA_TIMEOUT", "7.5"),
    ]  # fmt: skip


def test_the_ranks_of_hora_run() -> None:
    cfg = LaunchConfig(
        np=2, command=("true",), timeline_filename=Path("/t.json"), start_timeout=30.0,
        backend="gloo",
    )  # fmt: skip
    parent = {
        "PATH": "/bin", "RANK": "5", "WORLD_SIZE": "9", "HORA_RDZV_SECRET": "job",
        "PYTHONUNBUFFERED": "0", "OMPI_COMM_WORLD_RANK": "1",
    }  # fmt: skip
    # the parent's world and secret go; its PYTHONUNBUFFERED stays (a default only);
    # OMP_NUM_THREADS=1 as torchrun's, between the base and the contract
    assert [list(e.items()) for e in build_rank_envs(cfg, parent, 4321, "sec")] == [
        [
            ("PATH", "/bin"), ("PYTHONUNBUFFERED", "0"), ("OMP_NUM_THREADS", "1"),
            *world(r, 2, 4321), ("HOROVOD_TIMELINE", "/t.json"), ("HORA_BACKEND", "gloo"),
            ("HORA_TIMEOUT", "30"), ("HORA_START_TIMEOUT", "30"), ("HORA_RDZV_SECRET", "sec"),
        ]
        for r in range(2)
    ]  # fmt: skip
    (env,) = build_rank_envs(LaunchConfig(np=1, command=("true",)), {"OMP_NUM_THREADS": "4"}, 1)
    assert list(env.items())[:2] == [("OMP_NUM_THREADS", "4"), ("PYTHONUNBUFFERED", "1")]
    assert list(env.items())[2:] == [*world(0, 1, 1), ("HORA_RDZV_SECRET", env["HORA_RDZV_SECRET"])]


def test_the_workers_of_an_elastic_hora_run() -> None:
    cfg = LaunchConfig(
        np=2, command=("true",), start_timeout=30.0, backend="gloo",
        elastic=ElasticConfig(min_np=1, max_np=2, timeout=60.0),
    )  # fmt: skip
    parent = {"PATH": "/bin", "RANK": "5", "HORA_RDZV_SECRET": "job", "OMP_NUM_THREADS": "2"}
    driver = ElasticDriver(cfg, parent)
    try:
        env = driver.worker_env("w0", "localhost")
        secret = env["HORA_RDZV_SECRET"]
        assert secret != "job"
        # the defaults come after the world, OMP_NUM_THREADS the parent's
        assert list(env.items()) == [
            ("PATH", "/bin"), ("OMP_NUM_THREADS", "2"), *world(0, 2, 29500),
            ("HOROVOD_ELASTIC", "1"), ("HOROVOD_HOSTNAME", "localhost"),
            ("HORA_BACKEND", "gloo"), ("HORA_TIMEOUT", "30"), ("HORA_RDZV_SECRET", secret),
            ("HORA_ELASTIC_DIR", str(driver.root)), ("HORA_ELASTIC_WORKER", "w0"),
            ("HORA_ELASTIC_TIMEOUT", "60"), ("PYTHONUNBUFFERED", "1"),
        ]  # fmt: skip
    finally:
        shutil.rmtree(driver.root)
