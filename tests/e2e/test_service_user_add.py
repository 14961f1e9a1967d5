"""``hora user add`` in multi-user mode on a full disk leaves no half-made OS account ("Why" #9).

Before, the account ``hora-NAME`` was created, the store then refused the user (no space), and
a retry was refused because the account existed. Here the data directory is a small tmpfs
(root, as CI runs), filled up; the failed add must remove the account it made, and the same
command succeeds once there is room.
"""

from __future__ import annotations

import os
import pwd
import secrets
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hora_service import identity

pytestmark = pytest.mark.timeout(180)


def fill(where: Path) -> Path:
    filler = where / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return filler


def exists(account: str) -> bool:
    try:
        pwd.getpwnam(account)
    except KeyError:
        return False
    return True


def test_a_failed_user_add_removes_the_account_it_made(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("creating OS accounts and mounting a tmpfs need root (CI runs as root)")
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir()
    work.mkdir()
    name = f"full{secrets.token_hex(3)}"
    account = identity.account_name(name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
    env.update(HORA_USER_MODE="multi", HORA_WORK_ROOT=str(work))

    def add() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "hora.cli", "user", "add", name, "--data-dir", str(data)]
        return subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )

    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(data)], check=True)
    try:
        keeper = [sys.executable, "-m", "hora.cli", "user", "add", "keep" + name[4:], "--uid",
                  "65534", "--data-dir", str(data)]  # fmt: skip
        first = subprocess.run(keeper, env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr  # the store exists, then the disk fills
        # a reader keeps the store's WAL files, as a running service does: the add opens the
        # store, makes the account, and only then finds no room for the user's row
        reader = sqlite3.connect(data / "hora.db")
        reader.execute("SELECT count(*) FROM users").fetchall()
        filler = fill(data)
        full = add()
        reader.close()
        assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
        assert not exists(account), f"{account} was left behind by the failed add"
        filler.unlink()
        again = add()
        assert again.returncode == 0, again.stderr
        assert exists(account)
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)
        subprocess.run(["userdel", "--remove", "--force", account], capture_output=True)
