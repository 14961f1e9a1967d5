"""The sealed rendezvous and the per-attempt namespaces' pure parts (issue 16, item 1).

:mod:`hora.torch._sealed` on a real in-memory torch store: a process without the launch's
secret sees opaque key names, cannot read a value, and a value it writes (or copies from
another key) is refused; the launchers give every rank of a launch one fresh secret. The
namespace holder's configuration and argument list, and the docker network, are pure.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from hora.engines.plan import engine_env
from hora.env import RDZV_SECRET_VAR
from hora.launch.config import LaunchConfig, build_rank_envs
from hora.spec import JobSpec
from hora.torch._sealed import RendezvousForgery, SealedStore, seal_name, store_key
from hora_service.identity import RunAs
from hora_service.runtimes import namespaces
from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.core import rank_environment
from hora_service.runtimes.docker import DockerConfig, network_mode


def test_a_sealed_store_hides_names_and_values() -> None:
    raw = dist.HashStore()
    store = SealedStore(raw, store_key("ours"))
    store.set("hora/arrived/0", "127.0.0.1:4242")
    assert store.get("hora/arrived/0") == b"127.0.0.1:4242"
    assert store.check(["hora/arrived/0"]) and not store.check(["hora/arrived/1"])
    name = seal_name(store_key("ours"), "hora/arrived/0")
    assert raw.check([name])
    assert "arrived" not in name
    assert b"4242" not in raw.get(name)  # encrypted, not only signed
    assert store.add("count", 2) == 2 and store.add("count", 1) == 3


def test_a_value_written_without_the_secret_is_refused() -> None:
    raw = dist.HashStore()
    ours = SealedStore(raw, store_key("ours"))
    theirs = SealedStore(raw, store_key("theirs"))
    name = seal_name(store_key("ours"), "hora/arrived/1")
    raw.set(name, b"1")  # a raw write at the name a listing shows
    with pytest.raises(RendezvousForgery, match="HORA_RDZV_SECRET"):
        ours.get("hora/arrived/1")
    theirs.set("hora/arrived/1", "1")  # another secret writes its own names, never ours
    assert not raw.check([seal_name(store_key("theirs"), "hora/arrived/0")])
    ours.set("hora/arrived/0", "1")
    raw.set(name, raw.get(seal_name(store_key("ours"), "hora/arrived/0")))  # copied value
    with pytest.raises(RendezvousForgery):
        ours.get("hora/arrived/1")


def test_compare_set_and_wait_see_through_the_seal() -> None:
    store = SealedStore(dist.HashStore(), store_key("s"))
    assert store.compare_set("k", "", "a") == b"a"
    assert store.compare_set("k", "a", "b") == b"b"
    assert store.compare_set("k", "x", "c") == b"b"
    store.wait(["k"], datetime.timedelta(seconds=1))


def test_launchers_give_each_launch_one_fresh_secret() -> None:
    cfg = LaunchConfig(np=2, command=("true",))
    first = build_rank_envs(cfg, {RDZV_SECRET_VAR: "the job's own"}, 29500)
    again = build_rank_envs(cfg, {}, 29500)
    assert first[0][RDZV_SECRET_VAR] == first[1][RDZV_SECRET_VAR] != "the job's own"
    assert again[0][RDZV_SECRET_VAR] != first[0][RDZV_SECRET_VAR]
    base = {RDZV_SECRET_VAR: "kernel's"}
    env = engine_env(
        base, rank=0, size=2, device=None, master_port=1, backend="gloo", timeout_s=5,
        rdzv_secret="cluster's",
    )  # fmt: skip
    assert env[RDZV_SECRET_VAR] == "cluster's"


def _plan(tmp_path: Path, **kw: object) -> AttemptPlan:
    return AttemptPlan(
        job_id=7, attempt=2, spec=JobSpec(command=["python", "t.py"], workers=2), slots=(0, 1),
        slot_kind="cpu", run_dir=tmp_path / "run", workdir=Path("/tmp/work dir/$(x)"),
        master_port=29500, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_attempt_secret_reaches_every_rank_and_never_the_repr(tmp_path: Path) -> None:
    plan = _plan(tmp_path, rdzv_secret="s" * 64)
    envs = [rank_environment(plan, r, {}) for r in range(2)]
    assert envs[0][RDZV_SECRET_VAR] == envs[1][RDZV_SECRET_VAR] == "s" * 64
    assert "s" * 64 not in repr(plan)


def test_namespaces_only_for_jobs_run_as_an_account(tmp_path: Path) -> None:
    who = RunAs(user="hora-ann", uid=1234, gid=1234, home=Path("/home/hora-ann"))
    assert namespaces.wanted(_plan(tmp_path, private_network=True, run_as=who))
    assert not namespaces.wanted(_plan(tmp_path, private_network=True))  # single-user
    assert not namespaces.wanted(_plan(tmp_path, private_network=False, run_as=who))
    config = namespaces.holder_config(_plan(tmp_path), release="6.1.0")
    assert config == {
        "cgroups": [], "keep": ["/tmp/work dir/$(x)"], "hidepid": True, "tmp_bytes": None
    }  # fmt: skip
    sized = namespaces.holder_config(_plan(tmp_path, tmp_bytes=8 << 20))
    assert sized["tmp_bytes"] == 8 << 20  # job_disk_limit: each private tmpfs's size
    rooted = namespaces.holder_config(_plan(tmp_path, work_root=Path("/tmp/work dir")))
    assert rooted["keep"] == ["/tmp/work dir", "/tmp/work dir/$(x)"]  # the parent first
    assert namespaces.holder_config(_plan(tmp_path), release="5.4.0")["hidepid"] is False
    kept = namespaces.holder_config(_plan(tmp_path, tmp_paths=(Path("/tmp/ci/checkout"),)))
    assert kept["keep"] == ["/tmp/ci/checkout", "/tmp/work dir/$(x)"]  # job_tmp_paths too
    argv = namespaces.holder_argv("/usr/bin/python3")
    assert argv == ["/usr/bin/python3", "-I", "-S", str(namespaces.HOLDER)]
    assert os.path.isfile(argv[-1])


def test_a_private_docker_job_has_no_network_but_a_session_keeps_its_own(tmp_path: Path) -> None:
    config = DockerConfig(instance="ab12")
    assert network_mode(_plan(tmp_path, private_network=True), config) == "none"
    assert network_mode(_plan(tmp_path, private_network=False), config) == "host"
