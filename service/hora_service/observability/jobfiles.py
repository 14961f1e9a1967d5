"""Reading files a job wrote under the work root, without trusting them (control plane).

A job names some of the files the service reads for it (its timeline, ``HOROVOD_TIMELINE``,
and the per-rank ``.part`` files beside it). The service runs as root in multi-user mode, so
reading such a path as itself would let a job read what its own account cannot (another
user's trace in a private directory, a root-only file through a symlink), make a request wait
for ever (a FIFO), or read without end (``/dev/zero``). Every such file is read as a daemon
reads a path a user controls:

* the path is taken apart lexically and must lie under the work root; each directory below
  the root is opened relative to the one above with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink
  anywhere on the way is refused, never followed, and a directory swapped for a link while
  it is walked is refused too), and must be one the job's account may enter (its mode, owner
  and group, as the kernel would check them for that account);
* the file is opened relative to its directory with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is
  refused; a FIFO cannot make the open or the read wait), and ``fstat`` of that descriptor
  must show a regular file of the job's account that the account may read: a FIFO, device,
  socket or directory, or another user's or root's file, is refused;
* at most ``limit`` bytes are read; a larger file (or one that grows past it) is refused.

A refusal raises :class:`UntrustedJobFile`, whose message names the file and what it is: the
routes answer it as an error of that job alone. Nothing here blocks on a file a job controls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hora.errors import HoraError

_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Account:
    """The OS account whose files these are (the job's): its uid and primary gid.

    Jobs run with their supplementary groups cleared, so the primary group is the only one.
    """

    uid: int
    gid: int


class UntrustedJobFile(HoraError):
    """A file a job named is not one the service reads for it.

    Attributes:
        path: the file (or the directory on its way) as the job named it.
        what: what it is instead, in words.
    """

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        super().__init__(f"{path} is {what}; the service did not read it")


def _may(st: os.stat_result, who: Account, bits: int) -> bool:
    """Whether ``who`` has ``bits`` (4 read, 1 search) on it: owner, else group, else others."""
    if who.uid == 0:
        return True
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == who.uid:
        return mode >> 6 & bits == bits
    if st.st_gid == who.gid:
        return mode >> 3 & bits == bits
    return mode & bits == bits


def relative_to_root(root: Path, path: Path) -> PurePosixPath:
    """``path`` (absolute) below ``root``, taken apart without touching the file system.

    Raises:
        UntrustedJobFile: it is not below ``root``.

    Example:
        >>> relative_to_root(Path("/w"), Path("/w/ann/../ann/t.json"))
        PurePosixPath('ann/t.json')
        >>> relative_to_root(Path("/w"), Path("/w/../etc/passwd"))
        Traceback (most recent call last):
        hora_service.observability.jobfiles.UntrustedJobFile: /w/../etc/passwd is outside ...
    """
    norm = PurePosixPath(os.path.normpath(path))
    try:
        rel = norm.relative_to(PurePosixPath(os.path.normpath(root)))
    except ValueError:
        raise UntrustedJobFile(str(path), f"outside the work root {root}") from None
    return rel


def _enter(dfd: int, name: str, shown: str, who: Account) -> int:
    try:
        fd = os.open(name, _FLAGS | os.O_DIRECTORY, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedJobFile(shown, "a symbolic link or not a directory") from None
        raise
    if not _may(os.fstat(fd), who, 1):
        os.close(fd)
        raise UntrustedJobFile(shown, f"a directory uid {who.uid} cannot enter")
    return fd


@contextlib.contextmanager
def open_dir(root: Path, rel: PurePosixPath, who: Account) -> Iterator[int]:
    """A descriptor of directory ``root/rel``, walked as the module docstring says.

    Raises:
        FileNotFoundError: a directory on the way does not exist.
        UntrustedJobFile: a link, not a directory, or one ``who`` cannot enter.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not _may(os.fstat(fd), who, 1):
            raise UntrustedJobFile(str(root), f"a directory uid {who.uid} cannot enter")
        for i, name in enumerate(rel.parts):
            if name in ("", ".", ".."):
                raise UntrustedJobFile(str(root / rel), "not a plain path")
            nxt = _enter(fd, name, str(root.joinpath(*rel.parts[: i + 1])), who)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def read_at(dfd: int, name: str, shown: str, who: Account, limit: int) -> bytes | None:
    """The bytes of file ``name`` in directory ``dfd`` (None: there is none), checked.

    Args:
        dfd: the directory, from :func:`open_dir`.
        name: the file's name in it.
        shown: the file as the job named it, for messages.
        who: the account that must own it and be able to read it.
        limit: most bytes read; a larger file is refused.

    Raises:
        UntrustedJobFile: see the module docstring.
    """
    try:
        fd = os.open(name, _FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedJobFile(shown, "a symbolic link (never followed)") from None
        raise UntrustedJobFile(shown, f"not readable ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedJobFile(shown, _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
        if st.st_uid != who.uid:
            raise UntrustedJobFile(shown, f"a file of uid {st.st_uid}, not of the job's account")
        if not _may(st, who, 4):
            raise UntrustedJobFile(shown, "a file its own account cannot read (mode "
                                          f"{stat.S_IMODE(st.st_mode):04o})")  # fmt: skip
        if st.st_size > limit:
            raise UntrustedJobFile(shown, f"larger than the {limit} bytes the service reads")
        return _read_upto(fd, shown, limit)
    finally:
        os.close(fd)


def _read_upto(fd: int, shown: str, limit: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while True:
        data = os.read(fd, min(_CHUNK, limit + 1 - got))
        if not data:
            return b"".join(parts)
        parts.append(data)
        got += len(data)
        if got > limit:
            raise UntrustedJobFile(shown, f"larger than the {limit} bytes the service reads")
