"""Reading an attempt's run files without trusting them (control plane).

The run directory (``DATA_DIR/logs/<job>/<attempt>``) holds what the rank shim writes: each
rank's log, pid and exit files. The shim runs as the service's account (on the host in the
local runtime, as the container's root in the docker runtime) and the directory is not
writable by the job's account, so a job cannot replace them. The service still reads them as
files a job might have planted, the way daemons read files in directories a user controls:

* opened relative to a descriptor of the run directory, with ``O_NOFOLLOW`` (a symlink is
  refused, never followed) and ``O_NONBLOCK`` (a FIFO cannot make the open or the read wait);
* ``fstat`` of the opened descriptor must show a regular file owned by the service's account
  (a FIFO, device, socket or directory, or a file of another owner, is refused);
* the run directory itself must be a real directory of the service's account, not writable
  by group or others;
* small files (pid, exit) are read only up to a few bytes.

A refusal raises :class:`UntrustedRunFile`, whose message names the file and what it is; the
runtimes turn it into the rank's reason (the job fails and says why), the logs route into an
error answer. Nothing here can block on a file a job controls.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from hora.errors import HoraError

SMALL_FILE_BYTES = 64  # pid and exit files hold one integer
_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


class UntrustedRunFile(HoraError):
    """A run file is not what the shim writes (a symlink, FIFO, device, another owner).

    Attributes:
        name: the file's name in the run directory (``rank1.exit``).
        what: what was found instead, in words.
    """

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what
        super().__init__(
            f"{name} in the run directory is {what}, not a file the rank shim wrote; "
            "the service did not read it"
        )


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _check_dir(fd: int, owner: int) -> None:
    st = os.fstat(fd)
    if st.st_uid != owner:
        raise UntrustedRunFile(".", f"a directory of uid {st.st_uid}")
    if st.st_mode & 0o022:
        raise UntrustedRunFile(".", "a directory other accounts can write")


@contextlib.contextmanager
def open_run_file(path: Path, owner: int | None = None) -> Iterator[int]:
    """A read-only descriptor of run file ``path``, checked (see the module docstring).

    Args:
        path: the file, in a run directory built by the service (never from user input).
        owner: the account that must own it and its directory (default: the service's).

    Yields:
        The descriptor (closed on exit).

    Raises:
        FileNotFoundError: the file (or its directory) does not exist.
        UntrustedRunFile: it is a symlink, not a regular file, or not the service's.
    """
    owner = os.geteuid() if owner is None else owner
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    dfd = os.open(path.parent, flags | os.O_DIRECTORY)
    try:
        _check_dir(dfd, owner)
        try:
            fd = os.open(path.name, flags | os.O_NOCTTY, dir_fd=dfd)
        except OSError as e:
            if e.errno == 40:  # ELOOP: the name is a symlink
                raise UntrustedRunFile(path.name, _KINDS[stat.S_IFLNK]) from None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedRunFile(path.name, _kind(st.st_mode))
        if st.st_uid != owner:
            raise UntrustedRunFile(path.name, f"a file of uid {st.st_uid}")
        yield fd
    finally:
        os.close(fd)


def read_small(path: Path, owner: int | None = None) -> str | None:
    """The text of a pid or exit file (its first bytes), or None if there is none yet.

    Raises:
        UntrustedRunFile: see :func:`open_run_file`.

    Example:
        >>> read_small(Path("/nonexistent/rank0.exit")) is None
        True
    """
    try:
        with open_run_file(path, owner) as fd:
            return os.read(fd, SMALL_FILE_BYTES).decode("ascii", "replace")
    except FileNotFoundError:
        return None


def read_int(path: Path, owner: int | None = None) -> int | None:
    """The integer in a pid or exit file; None if missing, empty or not an integer.

    Raises:
        UntrustedRunFile: see :func:`open_run_file`.
    """
    text = read_small(path, owner)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def read_chunk(path: Path, offset: int, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of a log from ``offset``; a missing file reads as empty.

    Raises:
        UntrustedRunFile: see :func:`open_run_file`.
    """
    try:
        with open_run_file(path) as fd:
            # past the end reads as empty; seeking there may fail (an offset past the
            # file system's largest file is EINVAL)
            if offset >= os.fstat(fd).st_size:
                return b""
            return os.pread(fd, max_bytes, offset)
    except FileNotFoundError:
        return b""


def file_size(path: Path) -> int:
    """Size of a log in bytes, 0 if it does not exist yet.

    Raises:
        UntrustedRunFile: see :func:`open_run_file`.
    """
    try:
        with open_run_file(path) as fd:
            return os.fstat(fd).st_size
    except FileNotFoundError:
        return 0
