"""hora.leases on real files and real processes: locks, holders, kill -9, hostile files.

Holders are forked processes (a lease is a lock on an open file; whoever holds the file holds
the lease), killed with SIGKILL to show that nothing is left behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.lease_holder import Holder
from hora.leases import (
    DIR_NAME,
    Lease,
    LeaseDir,
    LeaseDirError,
    LeaseHolder,
    check_dir,
    default_dir,
)


@pytest.fixture
def leases(tmp_path: Path) -> LeaseDir:
    d = LeaseDir(tmp_path / "leases")
    d.ready()
    return d


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.kill()


def test_a_taken_lease_is_held_and_named_until_closed(leases: LeaseDir) -> None:
    lease = leases.take("gpu0", {"kind": "service", "url": "http://127.0.0.1:9", "job": 7})
    assert isinstance(lease, Lease)
    again = leases.take("gpu0", {"kind": "kernel"})  # another open file: refused, never waits
    assert isinstance(again, LeaseHolder)
    assert again.pid == os.getpid() and again.kind == "service" and again.job == 7
    assert again.words().startswith(f"hora service pid {os.getpid()} at http://127.0.0.1:9 (job 7")
    assert set(leases.held(["gpu0", "gpu1"])) == {"gpu0"}
    assert stat.S_IMODE(leases.file("gpu0").stat().st_mode) == 0o644
    lease.close()
    assert leases.held(["gpu0"]) == {}
    assert isinstance(leases.take("gpu0", {}), Lease)


def test_kill_9_of_the_holder_frees_its_lease(leases: LeaseDir, holders: list[Holder]) -> None:
    h = Holder(leases, "cpu0")
    holders.append(h)
    assert h.took
    seen = leases.held(["cpu0"])["cpu0"]
    assert seen.pid == h.pid and seen.kind == "kernel" and seen.alive
    h.kill()  # no clean-up of any kind
    assert leases.held(["cpu0"]) == {}
    assert isinstance(leases.take("cpu0", {}), Lease)


def test_a_child_that_inherited_the_lease_holds_it_after_its_parent_is_gone(
    leases: LeaseDir, holders: list[Holder]
) -> None:
    lease = leases.take("cpu1", {"kind": "service", "job": 3})
    assert isinstance(lease, Lease)
    child = Holder(leases, "cpu1", fd=lease.fileno())  # a rank shim, say
    holders.append(child)
    lease.close()  # the service let go (or died): the child's copy holds on
    seen = leases.held(["cpu1"])["cpu1"]
    assert seen.job == 3 and seen.locker == os.getpid()
    assert isinstance(leases.take("cpu1", {}), LeaseHolder)
    child.kill()
    assert leases.held(["cpu1"]) == {}


def test_a_claim_that_does_not_hold_the_lock_is_not_believed(
    leases: LeaseDir, holders: list[Holder]
) -> None:
    h = Holder(leases, "gpu1", {"kind": "kernel"})
    holders.append(h)
    # someone writes a claim naming pid 1 as the holder; the lock table says who holds it
    leases.file("gpu1").write_text(json.dumps({"pid": 1, "locker": 1, "kind": "service"}))
    seen = leases.held(["gpu1"])["gpu1"]
    assert seen.pid == h.pid and seen.kind == ""
    assert seen.words() == f"pid {h.pid} (user {seen.user})"


def test_without_a_lock_table_looking_tries_the_lock(
    tmp_path: Path, holders: list[Holder]
) -> None:
    leases = LeaseDir(tmp_path / "l", locks=tmp_path / "no-such-table")
    leases.ready()
    h = Holder(leases, "cpu0")
    holders.append(h)
    assert leases.held(["cpu0"])["cpu0"].pid == h.pid
    h.kill()
    assert leases.held(["cpu0"]) == {}
    assert isinstance(leases.take("cpu0", {}), Lease)  # the look did not keep it


def test_looking_at_no_lease_reads_no_lock_table(
    leases: LeaseDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the service looks at its free slots at every scheduling pass; with none free it must
    # not pay for the machine's lock table (milliseconds on some VMs, under its lock)
    import hora.leases as module

    reads: list[Path] = []
    real = module._lock_table

    def counted(path: Path = module.LOCKS) -> module.LockTable | None:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(module, "_lock_table", counted)
    assert leases.held([]) == {} and leases.held(iter(())) == {}
    assert reads == []
    assert leases.held(["cpu0"]) == {}
    assert len(reads) == 1


def test_a_symlinked_lease_file_is_never_followed(leases: LeaseDir, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    leases.file("gpu0").symlink_to(victim)
    got = leases.take("gpu0", {"kind": "service"})
    assert isinstance(got, LeaseHolder) and "symbolic link" in (got.problem or "")
    assert got.words().startswith("nobody: ")
    assert leases.held(["gpu0"])["gpu0"].problem is not None
    assert victim.read_text() == "precious"


@pytest.mark.timeout(20)
def test_a_fifo_or_a_hard_link_is_refused_without_blocking(
    leases: LeaseDir, tmp_path: Path
) -> None:
    os.mkfifo(leases.file("gpu0"))
    other = tmp_path / "other"
    other.write_text("x")
    os.link(other, leases.file("gpu1"))
    for name in ("gpu0", "gpu1"):
        got = leases.take(name, {"kind": "service"})
        assert isinstance(got, LeaseHolder) and "single link" in (got.problem or ""), got
        assert "remove it" in leases.held([name])[name].words()
    assert other.read_text() == "x"


def test_the_directory_is_made_sticky_and_world_writable(tmp_path: Path) -> None:
    d = LeaseDir(tmp_path / "new")
    d.ready()
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o1777
    d.ready()  # again: as it is


@pytest.mark.parametrize(
    ("mode", "why"),
    [(0o777, "writable by others but not sticky"), (0o1777, None), (0o755, None)],
)
def test_a_directory_writable_by_others_must_be_sticky(
    tmp_path: Path, mode: int, why: str | None
) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d").chmod(mode)
    if why is None:
        LeaseDir(tmp_path / "d").ready()
        return
    with pytest.raises(LeaseDirError, match=why) as e:
        LeaseDir(tmp_path / "d").ready()
    assert "HORA_LEASE_DIR" in str(e.value)


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LeaseDirError, match="symbolic link"):
        LeaseDir(tmp_path / "link").ready()


def _dir(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, uid, uid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "owner", "euid", "safe"),
    [
        (0o1777, 0, 1000, True),  # root's, as the machine's lock directory is
        (0o1777, 4242, 4242, True),  # this account's
        (0o1777, 4242, 1000, True),  # another account made it first: shared, sticky
        (0o1777, 4242, 0, False),  # ... but root does not depend on it
        (0o755, 4242, 1000, False),  # not writable here, and theirs alone
        (0o777, 1000, 1000, False),  # anyone may replace the files
    ],
)
def test_whose_directory_may_hold_the_leases(mode: int, owner: int, euid: int, safe: bool) -> None:
    assert (check_dir(_dir(mode, owner), euid) is None) == safe


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another account")
def test_root_refuses_a_directory_another_account_made(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    os.chown(d, 65534, 65534)
    with pytest.raises(LeaseDirError, match="belongs to"):
        LeaseDir(d).ready()


def test_the_default_is_the_machines_lock_directory_where_it_is_shared(tmp_path: Path) -> None:
    shared = tmp_path / "run-lock"
    shared.mkdir()
    shared.chmod(0o1777)
    assert default_dir(shared) == shared / DIR_NAME
    shared.chmod(0o755)  # a lock directory only root may write: every account uses /tmp
    assert default_dir(shared) == Path("/tmp") / DIR_NAME


def test_the_setting_names_the_directory(tmp_path: Path) -> None:
    assert LeaseDir.from_environ({"HORA_LEASE_DIR": str(tmp_path)}).path == tmp_path
    assert LeaseDir.from_environ({}).path == default_dir()


def test_a_description_is_only_known_keys_of_known_types(leases: LeaseDir) -> None:
    lease = leases.take("cpu0", {"kind": "service", "job": "seven", "url": "x\x1b[31m"})
    assert isinstance(lease, Lease)
    seen = leases.held(["cpu0"])["cpu0"]
    assert seen.job is None and seen.url is None and seen.kind == "service"
    leases.file("cpu0").write_bytes(b"\xff" * 10_000)  # not JSON, and long: read bounded
    assert leases.held(["cpu0"])["cpu0"].pid == os.getpid()


def test_the_lock_is_an_flock_any_process_sees(leases: LeaseDir) -> None:
    lease = leases.take("gpu2", {})
    assert isinstance(lease, Lease)
    fd = os.open(leases.file("gpu2"), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
