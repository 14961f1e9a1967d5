"""The docker runtime's pure parts: the container it asks for, the env of each rank, the policy.

No engine here (the e2e tests in tests/e2e/test_service_docker.py use a real one): these pin
down what the container is made of, with hostile values in paths and arguments, and the
GPU binding every rank gets (a fake GPU inventory: this machine has no GPU).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from docker.types import DeviceRequest, Mount
from hora.errors import SpecError
from hora.spec import JobSpec
from hora.torch._rendezvous import device_index
from hora_service.identity import RunAs
from hora_service.images import apt_mirror, debootstrap_argv, wheel_argvs
from hora_service.runtimes import create
from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.docker import (
    INIT,
    DockerConfig,
    DockerRuntime,
    container_config,
    container_env,
    job_account,
    parse_ulimit,
)
from hora_service.settings import Settings

HOSTILE = ["train.py", "--name", "a b", "it's", '"q"', "$(rm -rf /)", "`id`", "x;y|z", "*"]
WHO = RunAs(uid=1234, gid=1235, home=Path("/home/hora-ann"), user="hora-ann")


def plan(tmp_path: Path, kind: str = "gpu", workers: int = 2, **kw: object) -> AttemptPlan:
    spec = JobSpec(
        command=["python", *HOSTILE], workers=workers, runtime="docker", image="hora:cpu", **kw
    )  # type: ignore[arg-type]
    work = tmp_path / "my work $(id)"
    return AttemptPlan(
        job_id=7, attempt=2, spec=spec, slots=(4, 5), slot_kind=kind,
        run_dir=tmp_path / "data" / "logs" / "7" / "2", workdir=work, master_port=29999,
    )  # fmt: skip


def test_container_config_golden(tmp_path: Path) -> None:
    p = plan(tmp_path)
    config = DockerConfig(
        instance="ab12", ulimits=("memlock=-1", "stack=67108864"), devices=("/dev/infiniband",)
    )
    got = container_config(p, config, WHO)
    run_dir, work = str(p.run_dir), str(p.workdir)
    assert got == {
        "image": "hora:cpu",
        "entrypoint": ["python", "-I", "-c", INIT],
        "command": [run_dir],  # the user's command is in the launch files, never in argv
        "name": "hora-ab12-7-2",
        "labels": {"hora.instance": "ab12", "hora.job": "7", "hora.attempt": "2"},
        # the init and shims: the container's root, owning the run directory, with only the
        # capabilities to drop each rank to WHO (the launch file's uid) and to signal it
        "user": "0:0",
        "working_dir": run_dir,  # each rank enters the job's directory as WHO
        "environment": {},
        "mounts": [
            Mount(target=work, source=work, type="bind"),
            Mount(target=run_dir, source=run_dir, type="bind"),
        ],
        "network_mode": "host",
        "ipc_mode": "private",
        "shm_size": "4g",
        "tmpfs": {},  # no job_disk_limit: /tmp is the container's own layer
        "ulimits": [parse_ulimit("memlock=-1"), parse_ulimit("stack=67108864")],
        "devices": ["/dev/infiniband:/dev/infiniband:rwm"],
        # one container holds all the job's GPUs on this host
        "device_requests": [DeviceRequest(device_ids=["4", "5"], capabilities=[["gpu"]])],
        "cap_drop": ["ALL"],
        "cap_add": ["SETUID", "SETGID", "KILL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "stdin_open": False,
        "tty": False,
        "detach": True,
    }
    cpu = container_config(plan(tmp_path, "cpu"), config, WHO)
    assert cpu["device_requests"] == []
    # a service that is not root cannot give the run directory away: all of it runs as WHO
    plain = container_config(p, config, WHO, root_init=False)
    assert (plain["user"], plain["working_dir"], plain["cap_add"]) == ("1234:1235", work, [])
    sized = container_config(dataclasses.replace(p, tmp_bytes=8 << 20), config, WHO)
    assert sized["tmpfs"] == {  # job_disk_limit: /tmp and /var/tmp hold at most 8 MiB each
        d: f"rw,exec,nosuid,nodev,mode=1777,size={8 << 20}" for d in ("/tmp", "/var/tmp")
    }


def test_never_root_and_never_the_docker_socket(tmp_path: Path) -> None:
    p = plan(tmp_path)
    config = DockerConfig(instance="x")
    assert job_account(p, config, euid=0).uid == 65534  # shared mode as root: nobody
    assert job_account(p, config, euid=1000).uid == 1000  # an unprivileged service: itself
    got = container_config(p, config, job_account(p, config, euid=0), root_init=False)
    assert got["user"] == "65534:65534" and got["privileged"] is False
    sources = [m["Source"] for m in got["mounts"]]
    assert not any("docker.sock" in s for s in sources) and len(sources) == 2


def test_each_rank_sees_all_the_jobs_gpus_counted_from_zero(tmp_path: Path) -> None:
    p = plan(tmp_path)
    image_env = ["PATH=/opt/hora/bin:/usr/bin", "LANG=C.UTF-8"]
    service = {"PATH": "/host/bin", "HOME": "/root", "SECRET": "s", "LC_ALL": "C", "OMP": "1"}
    envs = [container_env(p, r, image_env, service, passthrough=["OMP"]) for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the engine renumbers the job's GPUs
        assert (env["LOCAL_RANK"], env["LOCAL_SIZE"]) == (str(rank), "2")
        assert env["HORA_SLOTS"] == str(4 + rank)  # the host's GPU of this rank
        assert env["PATH"] == "/opt/hora/bin:/usr/bin" and env["HOME"] == "/tmp"
        assert "SECRET" not in env and env["LC_ALL"] == "C" and env["OMP"] == "1"
    # each rank then pins cuda:LOCAL_RANK over the GPUs it sees
    assert [device_index(r, 2, 2) for r in (0, 1)] == [0, 1]


def test_image_policy_names_the_image_field() -> None:
    runtime = DockerRuntime(DockerConfig(instance="x", allowed_images=("hora:*", "team/*")))
    runtime.check(JobSpec(command=["x"], runtime="docker", image="team/trainer:1"))  # type: ignore[arg-type]
    for image in ("evil/miner:latest", None):
        with pytest.raises(SpecError) as e:
            runtime.check(JobSpec(command=["x"], runtime="docker", image=image))  # type: ignore[arg-type]
        assert e.value.field == "image"


@pytest.mark.parametrize(
    ("given", "runtime"),
    [
        ({"image": "hora:cpu"}, "docker"),  # an image alone means docker, for every entry point
        ({"image": "hora:cpu", "runtime": "local"}, "local"),  # said: admission refuses it
        ({}, "local"),
    ],
)
def test_an_image_without_a_runtime_means_docker(given: dict[str, str], runtime: str) -> None:
    spec = JobSpec.model_validate({"command": ["x"], **given})
    assert spec.runtime.value == runtime
    # the client and the REST API send what the CLI sends: the same spec either way
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_settings_reach_the_runtime(tmp_path: Path) -> None:
    s = Settings(
        data_dir=tmp_path, docker_host="unix:///x.sock", docker_allowed_images="a:*, b:*",
        docker_ulimits="memlock=-1", docker_pull="never",
    )  # type: ignore[arg-type]
    runtime = create("docker", s)
    assert isinstance(runtime, DockerRuntime)
    assert runtime.config.host == "unix:///x.sock"
    assert runtime.config.allowed_images == ("a:*", "b:*")
    assert runtime.config.ulimits == ("memlock=-1",) and runtime.config.pull == "never"
    from_env = DockerConfig.from_settings(Settings(data_dir=tmp_path), {"DOCKER_HOST": "tcp://h:1"})
    assert from_env.host == "tcp://h:1"


@pytest.mark.parametrize("bad", ["memlock", "=1", "memlock=x", "nofile=1:y"])
def test_bad_ulimits_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="NAME=SOFT"):
        parse_ulimit(bad)


def test_image_build_commands(tmp_path: Path) -> None:
    argv = debootstrap_argv(tmp_path / "base dir", "http://m/debian")
    assert argv[0] == "debootstrap" and argv[-2:] == [str(tmp_path / "base dir"), "http://m/debian"]
    hora, deps = wheel_argvs(Path("/repo"), Path("/w"), Path("/h"), "py")
    assert "--no-deps" in hora and deps[-4:] == ["torch", "numpy", "scikit-learn", "ipyparallel"]
    sources = "Types: deb\nURIs: http://deb.example/debian-security\n\nURIs: http://deb.example/debian\n"
    assert apt_mirror([sources]) == "http://deb.example/debian"
    assert apt_mirror([]) == "http://deb.debian.org/debian"


def test_run_files_stay_the_services_and_the_shim_drops_to_the_job(tmp_path: Path) -> None:
    p = plan(tmp_path)
    p.run_dir.mkdir(parents=True)
    runtime = DockerRuntime(DockerConfig(instance="x"), service_env={"PATH": "/host"})
    runtime._write_run_files(p, WHO, ["PATH=/img"], [0, 1], root_init=True)
    box = json.loads((p.run_dir / "container.json").read_text())
    assert box == {"ranks": [0, 1]}  # the command is in the launch files only
    launch = json.loads((p.run_dir / "rank1.launch").read_text())
    assert launch["command"] == ["python", *HOSTILE] and launch["cwd"] == str(p.workdir)
    assert (launch["uid"], launch["gid"]) == (WHO.uid, WHO.gid)  # the shim drops to them
    assert launch["env"]["RANK"] == "1" and launch["env"]["PATH"] == "/img"
    assert (p.run_dir / "rank1.launch").stat().st_mode & 0o777 == 0o640
    # the job's account can read its run directory, never write it (no planted log or exit)
    assert p.run_dir.stat().st_mode & 0o777 == 0o750
    runtime._write_run_files(p, WHO, ["PATH=/img"], [0], root_init=False)
    assert json.loads((p.run_dir / "rank0.launch").read_text())["uid"] is None


def test_image_build_without_an_engine_says_where_it_looked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from hora_service.images import main

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    assert main(["image", "build", "--cpu", "--cache", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the Docker engine at unix://{tmp_path}/no-engine.sock" in err
