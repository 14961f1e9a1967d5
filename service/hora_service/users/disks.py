"""A disk limit per user: their working directory is a loop-mounted file system (control plane).

Where ``user_disk_limit`` is set (multi-user mode), the working directory ``WORK_ROOT/<user>``
is made as an ext4 file system of that size in an image file,
``WORK_ROOT/.hora-disks/<user>.img`` (sparse: it takes only what is written), mounted on it with
``nosuid,nodev``. A job that fills it gets ``ENOSPC`` ("No space left on device") in its own
writes; other users' directories and the service's data directory are not touched. The size is
fixed when the directory is made; :func:`mount` mounts an image again after a reboot (the
service does it at start and before each job of the user). Only root can do this; the images
directory is root's, mode 0700.

Argument lists only (``mkfs.ext4``, ``mount``); nothing reaches a shell.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path

from hora.errors import SpecError

from hora_service.identity import RunAs

IMAGES = ".hora-disks"
TOOL_TIMEOUT_S = 60.0


def image_path(root: Path, name: str) -> Path:
    """Where the disk image of user ``name`` lives.

    Example:
        >>> image_path(Path("/srv/work"), "ann")
        PosixPath('/srv/work/.hora-disks/ann.img')
    """
    return root / IMAGES / f"{name}.img"


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecError("working_dir", f"cannot run {argv[0]}: {e}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SpecError("working_dir", f"{argv[0]} failed: {why[0] if why else done.returncode}")


def _images_dir(root: Path) -> Path:
    d = root / IMAGES
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SpecError("working_dir", f"{d} is not a private directory of the service's")
    return d


def create(root: Path, name: str, who: RunAs, size: int) -> None:
    """Make the new, empty working directory of ``name`` a file system of ``size`` bytes.

    Raises:
        SpecError: field ``working_dir``: the image cannot be made or mounted.
    """
    _images_dir(root)
    image = image_path(root, name)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    try:
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", f"root_owner={who.uid}:{who.gid}",
              str(image)])  # fmt: skip
        mount(root, name)
    except SpecError:
        image.unlink(missing_ok=True)
        raise
    top = root / name
    with contextlib.suppress(OSError):
        (top / "lost+found").rmdir()
    os.chmod(top, 0o700)


def mount(root: Path, name: str) -> bool:
    """Mount the user's image on their working directory if it has one and it is not mounted.

    Returns:
        True if it mounted it now.

    Raises:
        SpecError: field ``working_dir``: ``mount`` failed.
    """
    image, target = image_path(root, name), root / name
    if not image.is_file() or not target.is_dir() or target.is_symlink() or target.is_mount():
        return False
    _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(target)])
    return True
