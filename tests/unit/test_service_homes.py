"""Users' working directories are made private and never taken over (hora_service.users.homes).

Needs root (the directory is handed to another account): CI runs as root; without it these
fail and say so. The account is ``nobody``, whose home hora never touches.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest
from hora.errors import SpecError
from hora_service.identity import RunAs
from hora_service.users import homes

NOBODY = pwd.getpwnam("nobody")
WHO = RunAs(uid=NOBODY.pw_uid, gid=NOBODY.pw_gid, home=Path(NOBODY.pw_dir), user="nobody")


@pytest.fixture(autouse=True)
def root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests hand directories to another account and need root")


def test_the_working_directory_is_made_private_to_the_account(tmp_path: Path) -> None:
    made = homes.ensure_workdir(tmp_path, "ann", WHO)
    st = made.stat()
    assert made == tmp_path / "ann" and (st.st_uid, st.st_mode & 0o777) == (WHO.uid, 0o700)
    assert homes.ensure_workdir(tmp_path, "ann", WHO) == made  # found again as it is
    homes.check_workdir_free(tmp_path, "ann", WHO.uid)  # the account's own: accepted


def test_a_planted_symlink_or_another_accounts_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "ann").symlink_to(target)
    with pytest.raises(SpecError, match="a symlink") as e:
        homes.ensure_workdir(tmp_path, "ann", WHO)
    assert e.value.field == "working_dir" and target.stat().st_uid == 0  # not followed
    with pytest.raises(SpecError, match="not a directory of this user's account"):
        homes.check_workdir_free(tmp_path, "ann", WHO.uid)
    (tmp_path / "bob").mkdir()  # root's, as another account's would be
    with pytest.raises(SpecError, match="belongs to uid 0"):
        homes.ensure_workdir(tmp_path, "bob", WHO)
    with pytest.raises(SpecError, match="not a directory of this user's account"):
        homes.check_workdir_free(tmp_path, "bob", None)  # a new account owns nothing yet


def test_only_homes_of_accounts_hora_made_are_changed() -> None:
    assert not homes.created_by_hora(WHO)
    assert homes.make_home_private(WHO) is False
