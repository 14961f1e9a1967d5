"""Who a job runs as: the user modes and the OS account of each hora user (control plane).

Modes (setting ``user_mode``; ``auto`` picks ``multi`` when the service runs as root, else
``single``):

* ``multi``: each hora user maps to an unprivileged OS account of their own (created by
  ``hora user add NAME`` as ``hora-NAME``, or assigned with ``--uid N``); never root, never the
  service's own account, never one already mapped to another user. The rank shim clears its
  supplementary groups and sets its gid and uid to the account's before ``exec``, so the
  kernel keeps jobs away from the service's files and from other users' processes.
* ``single``: one hora user; jobs run as the service's account (it cannot switch users
  without root). A second user is refused.
* ``shared``: several hora users, jobs all run as the service's account: the API keeps
  them apart, the kernel does not. Only for users who trust each other and the service.

Every process is built from an argument list (``useradd`` included); nothing reaches a shell.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hora.errors import SpecError

log = logging.getLogger(__name__)

ACCOUNT_PREFIX = "hora-"
# what useradd accepts everywhere (Debian's default NAME_REGEX), 32 characters at most
ACCOUNT_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
USERADD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RunAs:
    """The OS account a job's processes run as.

    Attributes:
        uid: user id (never 0, never the service's).
        gid: primary group id; supplementary groups are cleared.
        home: the account's home directory (the job's ``HOME``).
        user: the account's name (the job's ``USER`` and ``LOGNAME``).
    """

    uid: int
    gid: int
    home: Path
    user: str


class IdentityError(SpecError):
    """An OS account cannot be used for a hora user; ``field`` names what to change."""


def resolve_mode(setting: str, euid: int | None = None) -> str:
    """The user mode in effect: ``multi``, ``single`` or ``shared``.

    Raises:
        IdentityError: ``multi`` was asked for but the service is not root.

    Example:
        >>> resolve_mode("auto", euid=0), resolve_mode("auto", euid=1000)
        ('multi', 'single')
    """
    euid = os.geteuid() if euid is None else euid
    if setting == "auto":
        return "multi" if euid == 0 else "single"
    if setting == "multi" and euid != 0:
        raise IdentityError(
            "user_mode",
            "multi-user mode runs each user's jobs as their own OS account, which needs a "
            "service running as root (or the docker runtime)",
        )
    return setting


def run_as(uid: int, service_uid: int | None = None) -> RunAs:
    """The :class:`RunAs` of an existing account that may run jobs.

    Raises:
        IdentityError: no such account, or it is root or the service's own account.
    """
    service_uid = os.geteuid() if service_uid is None else service_uid
    if uid == 0 or uid == service_uid:
        who = "root" if uid == 0 else "the service's own account"
        raise IdentityError("uid", f"uid {uid} is {who}; a job must run as an unprivileged account")
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise IdentityError("uid", f"there is no OS account with uid {uid}") from None
    return RunAs(uid=entry.pw_uid, gid=entry.pw_gid, home=Path(entry.pw_dir), user=entry.pw_name)


def account_name(user: str) -> str:
    """The OS account ``hora user add`` creates for a hora user.

    Raises:
        IdentityError: the name does not make a valid account name (use ``--uid``).

    Example:
        >>> account_name("ann")
        'hora-ann'
    """
    account = ACCOUNT_PREFIX + user
    if not ACCOUNT_NAME.match(account):
        raise IdentityError(
            "name",
            f"{account!r} is not a valid OS account name (lower-case letters, digits, _ and -, "
            "at most 32 characters): create an account yourself and pass --uid",
        )
    return account


def useradd_argv(account: str) -> list[str]:
    """The ``useradd`` command that creates a job account with a private group and a home.

    Example:
        >>> useradd_argv("hora-ann")[-1]
        'hora-ann'
    """
    return [
        "useradd", "--create-home", "--user-group", "--shell", "/usr/sbin/nologin",
        "--comment", "hora job account", account,
    ]  # fmt: skip


def check_account_free(user: str) -> str:
    """The name of the account :func:`create_account` would create for ``user``.

    Raises:
        IdentityError: it exists already (it may hold another user's files: reuse it
            knowingly with ``--uid``), or the name is not a valid account name.
    """
    account = account_name(user)
    try:
        found = pwd.getpwnam(account)
    except KeyError:
        return account
    raise IdentityError(
        "name",
        f"the OS account {account} (uid {found.pw_uid}) exists already; it may hold an "
        f"earlier user's files: remove it (userdel -r {account}) or assign it with --uid",
    )


def create_account(user: str) -> RunAs:
    """Create the OS account of hora user ``user`` (see :func:`account_name`).

    Raises:
        IdentityError: the account exists already (it may hold another user's files: reuse
            it knowingly with ``--uid``), or ``useradd`` failed.
    """
    account = check_account_free(user)
    try:
        done = subprocess.run(
            useradd_argv(account), capture_output=True, text=True, timeout=USERADD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise IdentityError("name", f"cannot run useradd: {e}") from None
    if done.returncode != 0:
        raise IdentityError("name", f"useradd {account} failed: {done.stderr.strip()}")
    return run_as(pwd.getpwnam(account).pw_uid)


def remove_account(user: str) -> None:
    """Remove the OS account :func:`create_account` made for ``user`` (and its home).

    Used to undo a ``hora user add`` that failed after the account was made; a failure to
    remove it is logged, not raised (the original error matters more).
    """
    account = account_name(user)
    try:
        done = subprocess.run(
            ["userdel", "--remove", "--force", account],
            capture_output=True, text=True, timeout=USERADD_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("cannot remove the OS account %s after a failed user add: %s", account, e)
        return
    if done.returncode not in (0, 6):  # 6: no such user (it is gone already)
        log.error("userdel %s failed: %s", account, done.stderr.strip())
