"""The CPUs a host's ranks can run on at once (hora.torch._cpus), and the slot that follows.

``cgroup_cap`` reads cgroup v2 and v1 trees laid out in a temporary directory (the files the
kernel shows under /sys/fs/cgroup: ``cpu.max`` is ``QUOTA PERIOD`` or ``max PERIOD``; v1's
``cpu.cfs_quota_us`` is -1 or the quota); the fallback
of a crowded set's segment to the usual size meets a real limit of the kernel on file size
(``RLIMIT_FSIZE``, in a forked child) that lets the usual segment fit and not the bigger one.
"""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

from hora.torch import _cpus, _shm

MIB = 1024 * 1024


def _tree(tmp_path: Path, caps: dict[str, str], own: str = "/user.slice/job") -> Path:
    root = tmp_path / "cgroup"
    for group, cap in {"": "", **caps}.items():
        d = root / group.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        if cap:
            (d / "cpu.max").write_text(cap + "\n")
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup-self").write_text(f"0::{own}\n")
    return root


def test_the_lowest_cap_from_the_process_group_up_to_the_root(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"/user.slice": "150000 100000", "/user.slice/job": "max 100000"})
    assert _cpus.cgroup_cap(str(tmp_path / "cgroup-self"), str(root)) == 1.5
    root = _tree(tmp_path, {"/user.slice": "400000 100000", "/user.slice/job": "50000 100000"})
    assert _cpus.cgroup_cap(str(tmp_path / "cgroup-self"), str(root)) == 0.5


def test_no_cap_no_cgroup_v2_or_unreadable_files_mean_none(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"/user.slice": "max 100000"})
    self_file = tmp_path / "cgroup-self"
    assert _cpus.cgroup_cap(str(self_file), str(root)) is None
    self_file.write_text("12:cpu,cpuacct:/user.slice\n")  # cgroup v1, not mounted here
    assert _cpus.cgroup_cap(str(self_file), str(root)) is None
    assert _cpus.cgroup_cap(str(tmp_path / "missing"), str(root)) is None
    (root / "user.slice" / "cpu.max").write_text("garbage\n")
    self_file.write_text("0::/user.slice/job\n")
    assert _cpus.cgroup_cap(str(self_file), str(root)) is None


def _v1_tree(tmp_path: Path, quotas: dict[str, int], mount: str = "cpu,cpuacct") -> Path:
    root = tmp_path / "cgroup-v1"
    for group, quota in {"": -1, **quotas}.items():
        d = root / mount / group.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    return root


def test_cgroup_v1_quotas_count_too(tmp_path: Path) -> None:
    # an older Slurm or Docker host: the cpu controller on v1, quota -1 where none is set
    self_file = tmp_path / "cgroup-self"
    self_file.write_text("12:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/job_7\n0::/\n")
    root = _v1_tree(tmp_path, {"/slurm": -1, "/slurm/job_7": 250000})
    assert _cpus.cgroup_cap(str(self_file), str(root)) == 2.5
    root = _v1_tree(tmp_path, {"/slurm": 50000, "/slurm/job_7": -1})
    assert _cpus.cgroup_cap(str(self_file), str(root)) == 0.5  # a group above caps it
    (root / "cpu.max").write_text("30000 100000\n")  # v2's file at the root, both kinds: lowest
    assert _cpus.cgroup_cap(str(self_file), str(root)) == 0.3
    (root / "cpu.max").unlink()
    root = _v1_tree(tmp_path / "plain", {"/slurm/job_7": 300000}, mount="cpu")  # mounted as cpu
    assert _cpus.cgroup_cap(str(self_file), str(root)) == 3.0
    root = _v1_tree(tmp_path / "none", {"/slurm/job_7": -1})
    assert _cpus.cgroup_cap(str(self_file), str(root)) is None


def test_a_group_path_that_climbs_out_of_the_root_stops_at_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, {})
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # above the root: never read
    (tmp_path / "cgroup-self").write_text("0::/../..\n")
    assert _cpus.cgroup_cap(str(tmp_path / "cgroup-self"), str(root)) is None


def test_members_together_have_the_union_of_their_cpus_under_the_lowest_cap() -> None:
    assert _cpus.at_once([([0], None), ([1], None)]) == 2  # each alone has one
    assert _cpus.at_once([([0], None), ([0], None), ([0], None)]) == 1
    assert _cpus.at_once([([0, 1, 2, 3], 2.5), ([0, 1, 2, 3], 8.0)]) == 3
    assert _cpus.at_once([([0, 1], 0.2)]) == 1
    affinity, cap = _cpus.mine()
    assert affinity == sorted(os.sched_getaffinity(0)) and (cap is None or cap > 0)


def test_a_crowded_set_has_bigger_slots_within_its_budget() -> None:
    assert _shm.slot_bytes(2, crowded=True) == _shm.slot_bytes(3, crowded=True) == 8 * MIB
    assert _shm.slot_bytes(8, crowded=True) == 4 * MIB
    assert _shm.slot_bytes(1000, crowded=True) == _shm.SLOT_MIN
    for n in range(2, 40):
        assert _shm.NBUF * n * _shm.slot_bytes(n, crowded=True) <= _shm.CROWDED_BUDGET
        assert _shm.slot_bytes(n, crowded=True) >= _shm.slot_bytes(n)
        assert _shm.slot_bytes(n, crowded=True) % _shm.ALIGN == 0


def _create_under_limit(members: int, limit: int) -> tuple[str, int]:
    """``create_for(members, crowded=True)`` in a child whose files may not pass ``limit``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            path, slot = _shm.create_for(members, crowded=True)
            os.write(w, f"{path} {slot}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        path, slot = f.read().split(" ")
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return path, int(slot)


def test_a_crowded_segment_that_does_not_fit_falls_back_to_the_usual_size() -> None:
    usual, big = _shm.segment_bytes(3), _shm.segment_bytes(3, slot=_shm.slot_bytes(3, True))
    assert usual < big
    for limit, want in ((big, _shm.slot_bytes(3, True)), (usual, _shm.slot_bytes(3))):
        path, slot = _create_under_limit(3, limit)
        try:
            assert slot == want
            assert os.stat(path).st_size == _shm.segment_bytes(3, slot=slot)
        finally:
            os.unlink(path)
    path, slot = _create_under_limit(3, usual - 1)
    assert (path, slot) == ("", 0)
