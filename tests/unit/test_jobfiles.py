"""hora_service.observability.jobfiles: a file a job names is read as its account's, never
through a link, never blocking on a FIFO, never past its limit
(real files in a temporary directory)."""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

import pytest
from hora_service.observability.jobfiles import (
    Account,
    UntrustedJobFile,
    open_dir,
    read_at,
    relative_to_root,
)

ME = Account(os.geteuid(), os.getegid())


def read(root: Path, rel: str, who: Account = ME, limit: int = 1 << 20) -> bytes | None:
    path = PurePosixPath(rel)
    with open_dir(root, path.parent, who) as dfd:
        return read_at(dfd, path.name, str(root / rel), who, limit)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "job").mkdir(mode=0o755)
    (tmp_path / "job" / "t.json").write_text("{}\n")
    tmp_path.chmod(0o755)  # other accounts may enter: only the checks under test refuse them
    return tmp_path


def test_the_jobs_own_file_is_read_and_a_missing_one_is_none(root: Path) -> None:
    assert read(root, "job/t.json") == b"{}\n"
    assert read(root, "job/none.json") is None
    with pytest.raises(FileNotFoundError):
        read(root, "nodir/t.json")


def test_a_symlink_is_refused_as_the_file_or_on_the_way(root: Path, tmp_path: Path) -> None:
    (root / "job" / "link.json").symlink_to(root / "job" / "t.json")
    (root / "linkdir").symlink_to(root / "job")
    with pytest.raises(UntrustedJobFile, match="link.json is a symbolic link"):
        read(root, "job/link.json")
    with pytest.raises(UntrustedJobFile, match="linkdir is a symbolic link or not a directory"):
        read(root, "linkdir/t.json")


def test_a_fifo_is_refused_at_once(root: Path) -> None:
    os.mkfifo(root / "job" / "fifo.json")  # nobody writes it: a blocking open would hang
    with pytest.raises(UntrustedJobFile, match=r"fifo.json is a named pipe \(FIFO\)"):
        read(root, "job/fifo.json")


def test_a_character_device_is_refused(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("mknod needs root (CI runs the unit tests as root)")
    os.mknod(root / "job" / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    with pytest.raises(UntrustedJobFile, match="zero is a character device"):
        read(root, "job/zero")


def test_a_file_over_the_limit_is_refused(root: Path) -> None:
    (root / "job" / "big.json").write_bytes(b"x" * 101)
    assert read(root, "job/big.json", limit=101) == b"x" * 101
    with pytest.raises(UntrustedJobFile, match="larger than the 100 bytes"):
        read(root, "job/big.json", limit=100)


def test_another_accounts_file_or_directory_is_refused(root: Path) -> None:
    other = Account(ME.uid + 1, ME.gid + 1)
    with pytest.raises(UntrustedJobFile, match=f"a file of uid {ME.uid}, not of the job's"):
        read(root, "job/t.json", who=other)
    (root / "job").chmod(0o700)  # not enterable by the other account
    with pytest.raises(UntrustedJobFile, match=f"a directory uid {other.uid} cannot enter"):
        read(root, "job/t.json", who=other)


def test_a_file_its_own_account_cannot_read_is_refused(root: Path) -> None:
    who, path = ME, root / "job" / "t.json"
    if who.uid == 0:  # root reads everything: take an account the check applies to
        who = Account(54321, 54321)
        os.chown(path, who.uid, who.gid)
    path.chmod(0o200)
    with pytest.raises(UntrustedJobFile, match=r"its own account cannot read \(mode 0200\)"):
        read(root, "job/t.json", who=who)


def test_paths_outside_the_root_are_refused_lexically() -> None:
    assert relative_to_root(Path("/w"), Path("/w/a/./b")) == PurePosixPath("a/b")
    with pytest.raises(UntrustedJobFile, match="outside the work root"):
        relative_to_root(Path("/w"), Path("/w/a/../../x"))
    with pytest.raises(UntrustedJobFile, match="outside the work root"):
        relative_to_root(Path("/w"), Path("/work/x"))
