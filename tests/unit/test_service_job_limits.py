"""Limits per attempt, the pure parts: values, ``auto`` shares, cgroup files, docker config,
and what a failed job's reason says (hora_service.runtimes.limits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hora_service.runtimes import container_init
from hora_service.runtimes.limits import (
    Hits,
    JobLimits,
    LimitError,
    Machine,
    cgroup_files,
    counter,
    docker_limits,
    note,
    parse,
    recorded_hits,
    resolve,
)
from hora_service.settings import Settings
from pydantic import ValidationError

MACHINE = Machine(memory_bytes=64 << 30, cpus=16, pids=32768)


@pytest.mark.parametrize(
    ("kind", "text", "value"),
    [
        ("memory", "2g", 2 << 30),
        ("memory", "512MiB", 512 << 20),
        ("memory", "1.5G", 1536 << 20),
        ("memory", "4096", 4096),
        ("pids", "1000", 1000),
        ("cpus", "0.5", 0.5),
        ("cpus", " AUTO ", "auto"),
        ("pids", "none", None),
    ],
)
def test_a_limit_reads_as_written(kind: str, text: str, value: object) -> None:
    assert parse(kind, text) == value


@pytest.mark.parametrize("text", ["0", "-1", "x", "nan", "inf", "1e999", "", "2 gigs"])
@pytest.mark.parametrize("kind", ["memory", "pids", "cpus"])
def test_a_bad_limit_names_its_kind(kind: str, text: str) -> None:
    with pytest.raises(LimitError, match=f"is not a {kind} limit") as e:
        parse(kind, text)
    assert e.value.field == kind


def test_auto_is_the_attempts_share_of_the_machine() -> None:
    auto = {"memory": "auto", "pids": "auto", "cpus": "auto"}
    quarter = resolve(auto, 2, 8, MACHINE)
    assert quarter.memory_bytes == int((64 << 30) * 0.9 / 4)
    assert (quarter.pids, quarter.cpus, quarter.slots) == (4096, 4.0, 2)
    tiny = resolve(auto, 1, 1000, Machine(1 << 30, 2, 4096))
    assert (tiny.memory_bytes, tiny.pids, tiny.cpus) == (256 << 20, 1024, 1.0)  # the floors
    assert resolve({"memory": "none", "pids": "7", "cpus": "none"}, 1, 4, MACHINE) == JobLimits(
        None, 7, None, 1
    )


def test_settings_refuse_a_bad_limit_or_umask_naming_the_setting() -> None:
    assert Settings(job_umask="22").job_umask == "022"
    for field, bad in (("job_memory_limit", "lots"), ("job_pids_limit", "0"), ("job_umask", "9")):
        with pytest.raises(ValidationError, match=field):
            Settings(**{field: bad})


def test_cgroup_files_per_version() -> None:
    limits = JobLimits(memory_bytes=1 << 30, pids=100, cpus=1.5, slots=2)
    v1 = cgroup_files("cgroup1", limits)
    assert ("memory", "memory.limit_in_bytes", str(1 << 30)) in v1
    assert ("memory", "memory.memsw.limit_in_bytes", str(1 << 30)) in v1
    assert ("cpu", "cpu.shares", "2048") in v1 and ("cpu", "cpu.cfs_quota_us", "150000") in v1
    v2 = cgroup_files("cgroup2", limits)
    assert ("memory", "memory.swap.max", "0") in v2 and ("cpu", "cpu.max", "150000 100000") in v2
    assert ("pids", "pids.max", "100") in v2 and ("cpu", "cpu.weight", "200") in v2
    assert cgroup_files("cgroup1", JobLimits()) == []


def test_docker_limits() -> None:
    got = docker_limits(JobLimits(memory_bytes=1 << 30, pids=100, cpus=None, slots=1))
    assert got == {
        "mem_limit": 1 << 30, "memswap_limit": 1 << 30, "pids_limit": 100, "cpu_shares": 1024
    }  # fmt: skip
    assert docker_limits(None) == {}


def test_the_reason_names_the_limit_hit() -> None:
    limits = JobLimits(memory_bytes=2 << 30, pids=1000)
    assert note(limits, Hits(oom_kills=1), killed=True) == (
        "was killed by the memory limit (2 GiB per attempt)", None
    )  # fmt: skip
    _, extra = note(limits, Hits(pids_max=3), killed=False)
    assert extra is not None and "pids limit (1000 processes and threads per attempt)" in extra
    assert note(limits, Hits(), killed=True) == (None, None)
    assert note(JobLimits(), Hits(oom_kills=1, pids_max=1), killed=True) == (None, None)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # cgroup v1, as the engine mounts the container's own directories in it
        (
            {
                "pids/pids.events": "max 7\n",
                "memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            },
            Hits(oom_kills=2, pids_max=7),
        ),
        # cgroup v2: one directory
        (
            {
                "pids.events": "max 3\n",
                "memory.events": "low 0\nhigh 0\nmax 1\noom 1\noom_kill 1\n",
            },
            Hits(oom_kills=1, pids_max=3),
        ),
        ({}, Hits()),  # no cgroup mounted in the container
    ],
)
def test_what_a_containers_init_records_of_its_cgroup_is_what_the_service_reads(
    tmp_path: Path, files: dict[str, str], expected: Hits
) -> None:
    # the engine removes the container's cgroup once its init exits, often before the service
    # has read it: the init (standard library only) records the counters on its way out
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    container_init._record_hits(str(run_dir), str(root))
    assert recorded_hits(run_dir / "container.hits") == expected
    if files:  # the init's stdlib reader agrees with the service's
        for name in files:
            for key in ("max", "oom_kill"):
                assert container_init._counter(str(root / name), key) == counter(root / name, key)


def test_a_missing_or_garbled_record_counts_nothing(tmp_path: Path) -> None:
    assert recorded_hits(tmp_path / "absent") == Hits()
    for text in ("not json", "[1, 2]", '{"pids_max": "many"}'):
        (tmp_path / "container.hits").write_text(text)
        assert recorded_hits(tmp_path / "container.hits") == Hits()
