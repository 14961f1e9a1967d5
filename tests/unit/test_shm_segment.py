"""The shared-memory segment file (hora.torch._shm) as another user's job would meet it.

An attacker with a job of their own on the same machine looks in /dev/shm for another job's
segment to read its gradients or write into them. The file is created with mode 0600 under a
random name, by the job's own uid, and unlinked by the ranks as soon as every one has mapped
it (tests/dist/test_shm.py checks that part); here a process of another uid tries to open it
while it exists. That part needs root, as the service's isolation tests do (CI runs as root).
"""

from __future__ import annotations

import os
import stat

import pytest
from hora.torch import _shm

NOBODY = 65534


def test_segment_is_private_to_its_owner_and_fully_reserved() -> None:
    path = _shm.create(1 << 20)
    assert path, "could not create a segment in /dev/shm"
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        assert st.st_size == 1 << 20
        assert st.st_blocks * 512 >= 1 << 20  # reserved now, no SIGBUS on first touch later
        assert os.path.basename(path).startswith(f"hora-{os.getpid()}-")
        assert len(os.path.basename(path).rsplit("-", 1)[1]) == 16  # 64 random bits
    finally:
        os.unlink(path)


def test_another_users_process_cannot_open_a_segment() -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to act as another user (CI runs as root)")
    path = _shm.create(1 << 16)
    assert path
    try:
        pid = os.fork()
        if pid == 0:  # the attacker: another uid, same machine, knows the name
            code = 3
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                for flags in (os.O_RDWR, os.O_RDONLY):
                    try:
                        os.close(os.open(path, flags))
                        code = 1  # opened: the segment leaks
                        break
                    except PermissionError:
                        code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        os.unlink(path)


def test_switches() -> None:
    assert not _shm.enabled({"HORA_SHM": "off"})
    assert not _shm.enabled({"HORA_SHM": "0"})
    on_x86 = os.uname().machine in ("x86_64", "AMD64")
    assert _shm.enabled({}) == (on_x86 and os.access("/dev/shm", os.W_OK))
    assert _shm.slot_bytes(2) == 4 * 1024 * 1024
    assert _shm.slot_bytes(8) * _shm.NBUF * 8 <= _shm.SEGMENT_BUDGET
    assert _shm.slot_bytes(1000) == _shm.SLOT_MIN
