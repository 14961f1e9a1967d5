"""Private places of each user's jobs: the account's home and the user's working directory.

Control plane, multi-user mode. ``useradd`` makes homes ``0755`` on most systems, so any job
could list another account's home and read what it keeps there; hora makes the homes of the
accounts it creates ``0700`` (:func:`make_home_private`, at ``hora user add`` and again at each
start of the service for accounts an older hora created). Accounts an admin assigns with
``--uid`` are theirs: their homes are left as they are.

Each user also gets a working directory of their own under the work root,
``WORK_ROOT/<user>`` (mode ``0700``, owned by their account; :func:`ensure_workdir`): it is
the default ``working_dir`` of their jobs and sessions, so a training script that writes a
checkpoint into its working directory can, and no other user can read it. With
``user_disk_limit`` set it is a file system of that size (:mod:`hora_service.users.disks`).

Every directory is opened with ``O_NOFOLLOW`` and checked with ``fstat`` before its mode or
owner changes: a symlink another user plants in a shared work root is refused, never
followed.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Sequence
from pathlib import Path

from hora.errors import HoraError, SpecError

from hora_service.identity import ACCOUNT_PREFIX, RunAs
from hora_service.runtimes import startcheck
from hora_service.users import disks

ACCOUNT_COMMENT = "hora job account"  # what useradd_argv writes in the account's GECOS field
PRIVATE = 0o700


def created_by_hora(who: RunAs) -> bool:
    """Whether hora created this account (``hora-NAME`` with hora's comment)."""
    try:
        entry = pwd.getpwuid(who.uid)
    except KeyError:
        return False
    return entry.pw_name.startswith(ACCOUNT_PREFIX) and entry.pw_gecos == ACCOUNT_COMMENT


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def make_home_private(who: RunAs) -> bool:
    """Make the home of an account hora created ``0700``; True if its mode changed.

    Homes of other accounts, and a home that is a symlink or not the account's, are left
    alone.
    """
    if not created_by_hora(who):
        return False
    try:
        fd = _open_dir(who.home)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != who.uid or stat.S_IMODE(st.st_mode) & 0o077 == 0:
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o077)
        return True
    finally:
        os.close(fd)


def user_workdir(root: Path, name: str) -> Path:
    """The working directory of hora user ``name``: ``WORK_ROOT/<name>``.

    Example:
        >>> user_workdir(Path("/srv/work"), "ann")
        PosixPath('/srv/work/ann')
    """
    return root / name


def check_workdir_free(root: Path, name: str, uid: int | None) -> None:
    """Refuse a user whose working directory exists and is not (or cannot become) theirs.

    Args:
        root: the work root.
        name: the hora user.
        uid: their account (None: one not created yet, which owns nothing).

    Raises:
        SpecError: field ``name``: the path exists and is a symlink, not a directory, or
            another account's.
    """
    path = user_workdir(root, name)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise SpecError(
            "name",
            f"{path} exists and is not a directory of this user's account (uid "
            f"{st.st_uid}): it may hold another user's files; move it away first",
        )


def ensure_workdir(root: Path, name: str, who: RunAs, disk_bytes: int | None = None) -> Path:
    """The user's working directory, created ``0700`` and owned by ``who`` if missing.

    With ``disk_bytes``, a directory made now is a file system of that size
    (:mod:`hora_service.users.disks`); one that has an image is mounted again if it is not.

    Raises:
        SpecError: field ``working_dir``: the path is a symlink, not a directory, or
            another account's, or it cannot be created (or its disk made or mounted).
    """
    path = user_workdir(root, name)
    disks.mount(root, name)
    try:
        os.mkdir(path, PRIVATE)
        created = True
    except FileExistsError:
        created = False
    except OSError as e:
        raise SpecError("working_dir", f"cannot create {path}: {e.strerror}") from None
    try:
        fd = _open_dir(path)
    except OSError as e:
        link = e.errno == errno.ELOOP or path.is_symlink()  # ENOTDIR with O_DIRECTORY
        why = "a symlink (never followed)" if link else e.strerror
        raise SpecError("working_dir", f"the default working directory {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.geteuid() != who.uid:
            if disk_bytes:  # the image's root belongs to the account (mkfs root_owner)
                disks.create(root, name, who, disk_bytes)
            else:
                os.fchown(fd, who.uid, who.gid)
                os.fchmod(fd, PRIVATE)
        elif st.st_uid != who.uid:
            raise SpecError(
                "working_dir",
                f"the default working directory {path} belongs to uid {st.st_uid}, not to "
                f"{who.user} (uid {who.uid}); name a working_dir or move it away",
            )
    finally:
        os.close(fd)
    return path


def closed_part(root: Path) -> Path | None:
    """The first of ``root`` and its parents that other accounts cannot enter (None: none).

    Job accounts are "other" to what root owns: a directory without the ``o+x`` bit on the way
    to the work root keeps every job out of its working directory.

    Example:
        >>> closed_part(Path("/"))
    """
    for part in (*reversed(root.parents), root):
        try:
            if not part.stat().st_mode & stat.S_IXOTH:
                return part
        except OSError:
            return part
    return None


def check_work_root(root: Path, accounts: Sequence[RunAs]) -> None:
    """Refuse a multi-user work root that job accounts cannot enter, naming the setting.

    Accepted when every account may enter it by the mode bits of ``root`` and its parents
    or, where a bit is missing, when each of ``accounts`` (the users' own) can, checked as
    that account (a group of theirs may open it).

    Raises:
        HoraError: the work root, or a parent, is closed to them.
    """
    closed = closed_part(root)
    if closed is None or (accounts and all(_can_enter(who, root) for who in accounts)):
        return
    try:
        mode = f"mode {stat.S_IMODE(closed.stat().st_mode):04o}"
    except OSError as e:
        mode = str(e.strerror)
    raise HoraError(
        f"multi-user mode, but job accounts cannot enter the work root {root} ({closed} is "
        f"{mode}): every job would be refused its working directory. Set work_root "
        "(hora serve --work-root DIR, or HORA_WORK_ROOT) to a directory they can enter, "
        "e.g. /srv/hora-work (it defaults to the service account's home)"
    )


def _can_enter(who: RunAs, root: Path) -> bool:
    try:
        startcheck.check(who, root, None, "")
    except SpecError:
        return False
    return True
