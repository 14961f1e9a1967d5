"""A shared-memory segment's file in ``/dev/shm``: created private and reserved, then mapped.

The file is made with mode 0600 under a random name by the rank that sets the segment up,
reserved in full at once (ENOSPC then, never SIGBUS on a first touch later), and marked with
a magic number that a mapping checks; :mod:`hora.torch._shm` and :mod:`hora.torch._arena`
unlink it as soon as every member has mapped it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAGIC = 0x686F7261_73686D32  # "horashm2"


def create(size: int, magic: int = MAGIC) -> str:
    """Create and fully reserve a segment file; '' when /dev/shm cannot hold it."""
    path = os.path.join(SHM_DIR, f"hora-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        log.debug("shared memory: cannot create %s: %s", path, e)
        return ""
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, never SIGBUS on first touch
        os.pwrite(fd, magic.to_bytes(8, "little"), 0)
    except OSError as e:
        log.debug("shared memory: cannot reserve %d bytes in %s: %s", size, SHM_DIR, e)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return ""
    os.close(fd)
    return path


def open_segment(path: str, size: int, magic: int = MAGIC) -> mmap.mmap | None:
    """Map a segment; None when it is not there (another host or IPC namespace)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(fd)
    if int.from_bytes(mm[:8], "little") != magic:
        mm.close()
        return None
    return mm
