"""Where parked sessions' snapshots live, made, measured and removed safely (control plane).

A session's snapshot is a directory ``<workdir>/.hora-parked/session-<id>-<ticket>`` in the
working directory of its engines: the owner's own (``WORK_ROOT/<user>``, mode 0700, their
account's) in multi-user mode, where every runtime's engines see it (a docker container
mounts the working directory, Slurm's nodes share it). The service makes
``.hora-parked`` and the session's directory mode 0700 and gives them to the account the
engines run as, which alone writes the parts; no other user, and no job of another user,
can read them.

The owner controls what lies under their working directory, so the service (root, in
multi-user mode) never follows a link there: every path below the working directory is
opened component by component with ``O_NOFOLLOW`` and checked with ``fstat``, sizes are
read with ``lstat``, and a snapshot is removed with ``shutil.rmtree`` on a directory
descriptor (which does not follow links either).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hora.errors import HoraError

PARK_DIR = ".hora-parked"
PRIVATE = 0o700


class ParkDirError(HoraError):
    """A snapshot's directory cannot be made, read or removed as it must be."""


def session_dir_name(session_id: int, ticket: str) -> str:
    """The directory of one park of a session.

    Example:
        >>> session_dir_name(12, "0123456789abcdef")
        'session-12-0123456789abcdef'
    """
    return f"session-{int(session_id)}-{ticket}"


def _of_session(session_id: int) -> re.Pattern[str]:
    return re.compile(rf"^session-{int(session_id)}-[0-9a-f]{{16}}$")


@contextmanager
def _opened(path: Path, *parts: str) -> Iterator[int]:
    """A descriptor of ``path/parts...``, no component below ``path`` followed as a link."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts:
            inner = os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _own(fd: int, name: str, account: tuple[int, int] | None) -> None:
    """Check the directory open at ``fd`` and make it ``account``'s (None: ours), mode 0700.

    A directory of ours becomes the account's; one of another account is refused.
    """
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise ParkDirError(f"{name} is not a directory")
    mine = os.geteuid()
    want = account[0] if account is not None else mine
    if st.st_uid != want:
        if st.st_uid != mine or account is None:
            raise ParkDirError(f"{name} belongs to uid {st.st_uid}, not to the session's account")
        os.fchown(fd, account[0], account[1])
    os.fchmod(fd, PRIVATE)


def _mkdir(parent: int, name: str, account: tuple[int, int] | None, shown: str) -> None:
    try:
        os.mkdir(name, PRIVATE, dir_fd=parent)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)  # fmt: skip
    except OSError as e:
        link = e.errno in (errno.ELOOP, errno.ENOTDIR)
        why = "a link (never followed)" if link else e.strerror
        raise ParkDirError(f"{shown}: {why}") from None
    try:
        _own(fd, shown, account)
    finally:
        os.close(fd)


def make(workdir: Path, session_id: int, ticket: str, account: tuple[int, int] | None) -> Path:
    """Make the directory of one park, private to ``account`` (None: the service's own).

    Raises:
        ParkDirError: the working directory or ``.hora-parked`` cannot be used (a link,
            another account's, not a directory), or the directory cannot be made.
    """
    name = session_dir_name(session_id, ticket)
    try:
        with _opened(workdir) as base:
            _mkdir(base, PARK_DIR, account, str(workdir / PARK_DIR))
            with _opened(workdir, PARK_DIR) as root:
                _mkdir(root, name, account, str(workdir / PARK_DIR / name))
    except OSError as e:
        raise ParkDirError(f"cannot make {workdir / PARK_DIR / name}: {e.strerror or e}") from None
    return workdir / PARK_DIR / name


def measure(workdir: Path, session_id: int, ticket: str, files: Sequence[str]) -> dict[str, int]:
    """The sizes of ``files`` in a park's directory (regular files only, links not followed).

    Raises:
        ParkDirError: a file is missing, not a regular file, or the directory cannot be read.
    """
    name = session_dir_name(session_id, ticket)
    sizes: dict[str, int] = {}
    try:
        with _opened(workdir, PARK_DIR, name) as fd:
            for f in files:
                st = os.stat(f, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise ParkDirError(f"{name}/{f} is not a regular file")
                sizes[f] = st.st_size
    except FileNotFoundError as e:
        raise ParkDirError(f"{name}/{e.filename or '?'} is missing") from None
    except OSError as e:
        raise ParkDirError(f"cannot read {workdir / PARK_DIR / name}: {e.strerror or e}") from None
    return sizes


def flush(workdir: Path, session_id: int, ticket: str, files: Sequence[str]) -> None:
    """Flush a park's parts and its directory to disk (``fsync``; links not followed).

    The ranks write their parts through the page cache and the park is recorded at once;
    this makes it survive a power loss too (a part cut short by one never matches its
    checksum, so it is never restored either way). A part that cannot be opened is skipped.
    """
    name = session_dir_name(session_id, ticket)
    try:
        with _opened(workdir, PARK_DIR, name) as fd:
            for f in files:
                try:
                    part = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    continue
                try:
                    os.fsync(part)
                finally:
                    os.close(part)
            os.fsync(fd)
    except OSError:
        return


def remove(workdir: Path, session_id: int, keep: str | None = None) -> list[str]:
    """Remove the park directories of a session, but ``keep`` (a ticket); their names.

    A directory that cannot be read or is gone is left alone (nothing to remove, or not
    ours to remove); nothing below the working directory is followed as a link.
    """
    mine = _of_session(session_id)
    kept = session_dir_name(session_id, keep) if keep else None
    removed = []
    try:
        with _opened(workdir, PARK_DIR) as root:
            for name in os.listdir(root):
                if mine.match(name) and name != kept:
                    shutil.rmtree(name, dir_fd=root, ignore_errors=True)
                    removed.append(name)
    except OSError:
        return removed
    return removed
