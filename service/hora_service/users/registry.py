"""The service's users under its user mode: creation, tokens, OS accounts (control plane).

:class:`Users` applies the rules of :mod:`hora_service.identity` to the store: who may be
created in which mode, which OS account a user's jobs run as, and the check at start-up that
a store set up for several users is not quietly served in single-user mode. The job manager
holds one and hands out its answers; nothing here touches jobs.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from pathlib import Path

from hora.errors import HoraError, SpecError

from hora_service import identity
from hora_service.models import User
from hora_service.runtimes import limits
from hora_service.store.db import Store, token_hash
from hora_service.users import disks, homes

USER_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
IDLE_TIMEOUT_MAX_S = 30 * 24 * 3600  # what a session may ask for (SessionRequest)


def new_token(draw: Callable[[int], str] = secrets.token_urlsafe) -> str:
    """A user's API token: 32 random bytes, URL-safe base64, never starting with ``-``.

    A token is passed on command lines (``hora jobs --token TOKEN``), where a value that
    starts with ``-`` reads as an option (argparse: "expected one argument"): one token in 64
    did. Such a draw is drawn again.

    Args:
        draw: the random source (``secrets.token_urlsafe``).

    Returns:
        The token.

    Example:
        >>> draws = iter(["-first", "second"])
        >>> new_token(lambda n: next(draws))
        'second'
    """
    while True:
        token = draw(32)
        if not token.startswith("-"):
            return token


def check_idle_timeout(field: str, seconds: float | None) -> float | None:
    """``seconds`` if it is a usable idle timeout (None: none set), else a SpecError.

    Raises:
        SpecError: zero, negative, NaN, infinite, or longer than 30 days (named ``field``).

    Example:
        >>> check_idle_timeout("idle_timeout_s", 600.0)
        600.0
    """
    if seconds is None:
        return None
    if not math.isfinite(seconds) or seconds <= 0 or seconds > IDLE_TIMEOUT_MAX_S:
        raise SpecError(
            field, f"{seconds!r} is not an idle timeout (seconds, > 0, at most 30 days)"
        )
    return float(seconds)


class Users:
    """Users and their OS accounts (see the module docstring).

    Args:
        mode: the user mode in effect (``multi``, ``single`` or ``shared``).
        store: opens (or returns) the store.

    Example:
        >>> users = Users("shared", lambda: Store(tmp_path / "hora.db"))  # doctest: +SKIP
        >>> token = users.create("ann")  # doctest: +SKIP
    """

    def __init__(
        self,
        mode: str,
        store: Callable[[], Store],
        work_root: Path | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        self.mode = mode
        self._store = store
        self.work_root = work_root
        self.disk_bytes = disk_bytes

    def create(
        self,
        name: str,
        admin: bool = False,
        quota: int | None = None,
        uid: int | None = None,
        make_account: bool = False,
        idle_timeout_s: float | None = None,
    ) -> str:
        """Create a user and return their token (shown once; only its hash is stored).

        Args:
            name: the user's name.
            admin: sees and acts on every job.
            quota: most slots this user's running jobs may hold.
            uid: in multi-user mode, the existing OS account their jobs run as.
            make_account: in multi-user mode without ``uid``, create the account
                ``hora-NAME`` (see :func:`hora_service.identity.create_account`) with a
                private home. In multi-user mode the user also gets their working directory
                ``WORK_ROOT/NAME`` (see :mod:`hora_service.users.homes`).
            idle_timeout_s: idle timeout of their sessions that ask for none (None: the
                service's default).

        Raises:
            SpecError: the name is empty, too long, or has characters other than letters,
                digits, ``.``, ``_`` and ``-``; the account cannot be used or created; a
                second user in single-user mode; a bad idle timeout (field
                ``idle_timeout_s``).
            hora_service.store.db.StoreError: the name is taken, or the uid is another user's.
        """
        if not name or len(name) > 64 or not set(name) <= USER_NAME_CHARS or name[0] in ".-":
            raise SpecError("name", f"{name!r} is not a user name (letters, digits, . _ -)")
        if quota is not None and quota < 1:
            raise SpecError("quota", "a GPU quota must be at least 1")
        idle_timeout_s = check_idle_timeout("idle_timeout_s", idle_timeout_s)
        store = self._store()
        self._check_mode(store, name, uid)
        who, made = self._account(store, name, uid, make_account)
        uid = who.uid if who is not None else uid
        token = new_token()
        try:
            if made and who is not None:
                homes.make_home_private(who)
            store.add_user(
                name, token_hash(token), admin, quota, os_uid=uid, idle_timeout_s=idle_timeout_s
            )
        except BaseException:
            if made:  # a full disk, a store error: a retry must find no half-made account
                identity.remove_account(name)
            raise
        if who is not None and self.work_root is not None and self.work_root.is_dir():
            homes.ensure_workdir(self.work_root, name, who, self.disk_bytes)  # else: first job
        return token

    def _account(
        self, store: Store, name: str, uid: int | None, make_account: bool
    ) -> tuple[identity.RunAs | None, bool]:
        """The OS account of a new user in multi-user mode, and whether it was made now."""
        if self.mode != "multi" or store.user_by_name(name) is not None:
            return None, False
        if uid is None and make_account:
            identity.check_account_free(name)
        if self.work_root is not None:  # before any account exists: nothing to undo
            homes.check_workdir_free(self.work_root, name, uid)
        if uid is not None:
            return identity.run_as(uid), False
        if make_account:
            return identity.create_account(name), True
        return None, False

    def workdir(self, name: str) -> Path | None:
        """The default working directory of user ``name`` (multi-user mode), created if missing.

        None in the other modes and without a work root.

        Raises:
            SpecError: the user has no usable account, or the directory cannot be made theirs.
        """
        if self.mode != "multi" or self.work_root is None:
            return None
        return homes.ensure_workdir(
            self.work_root, name, self.run_as_of(name), self.disk_bytes
        )

    def make_homes_private(self) -> None:
        """Make the homes of the accounts hora created ``0700`` (an older hora left 0755).

        Users' disk images (``user_disk_limit``) are mounted again too (after a reboot).
        """
        if self.mode != "multi":
            return
        for user in self.all():
            if user.os_uid is None:
                continue
            try:
                homes.make_home_private(identity.run_as(user.os_uid))
                if self.work_root is not None:
                    disks.mount(self.work_root, user.name)
            except SpecError:
                continue  # an account that is gone: its jobs are refused anyway

    def set_idle_timeout(self, name: str, idle_timeout_s: float | None) -> bool:
        """Set the idle timeout of a user's new sessions (None: back to the service default).

        Sessions already running keep theirs. False if there is no such user.

        Raises:
            SpecError: zero, negative, NaN or infinite (field ``idle_timeout_s``).
        """
        return self._store().set_idle_timeout(
            name, check_idle_timeout("idle_timeout_s", idle_timeout_s)
        )

    def limits_of(self, name: str) -> dict[str, str]:
        """The user's own job limits by kind, as written (none: the service's settings)."""
        found = self._store().user_by_name(name)
        return dict(found.limits) if found is not None else {}

    def set_limits(self, name: str, changes: dict[str, str]) -> bool:
        """Change a user's own job limits; ``default`` removes one. False if no such user.

        Args:
            name: the user.
            changes: kind (``memory``, ``pids``, ``cpus``) -> ``auto``, ``none``, a value,
                or ``default`` (back to the service's setting).

        Raises:
            SpecError: a value that is not a limit of its kind (field = the kind).
        """
        found = self._store().user_by_name(name)
        if found is None:
            return False
        merged = dict(found.limits)
        for kind, value in changes.items():
            if value.strip().lower() == "default":
                merged.pop(kind, None)
                continue
            try:
                limits.parse(kind, value)
            except limits.LimitError as e:
                raise SpecError(e.field, str(e)) from None
            merged[kind] = value.strip().lower()
        return self._store().set_limits(name, merged)

    def _check_mode(self, store: Store, name: str, uid: int | None) -> None:
        if uid is not None and self.mode != "multi":
            raise identity.IdentityError(
                "uid", f"--uid needs multi-user mode (this service is in {self.mode} mode)"
            )
        others = [u.name for u in store.users() if u.name != name]
        if self.mode == "single" and others:
            raise identity.IdentityError(
                "name",
                f"single-user mode: this service already has user {others[0]!r}. Jobs run as "
                "the service's own OS account (it is not root, so it cannot run them as "
                "anyone else), and a second user's jobs could read and change the first's "
                "files and the service's. Run the service as root for multi-user mode, or "
                "set HORA_USER_MODE=shared to accept that.",
            )

    def remove(self, name: str) -> bool:
        """Delete a user; their token stops working at once. False if there was none."""
        return self._store().remove_user(name)

    def for_token(self, token: str) -> User | None:
        """The user a bearer token belongs to, or None."""
        return self._store().user_by_digest(token_hash(token))

    def by_name(self, name: str) -> User | None:
        """The user called ``name``, or None."""
        return self._store().user_by_name(name)

    def all(self) -> list[User]:
        """Every user, by name."""
        return self._store().users()

    def run_as_of(self, name: str) -> identity.RunAs:
        """The OS account the jobs of the user called ``name`` run as (multi-user mode).

        Raises:
            SpecError: the user has none, or it cannot be used (field ``user``/``uid``).
        """
        found = self._store().user_by_name(name)
        return self.run_as(found.id if found is not None else None)

    def run_as(self, user_id: int | None) -> identity.RunAs:
        """The OS account the jobs of the user with this id run as (see :meth:`run_as_of`)."""
        found = self._store().user_by_id(user_id) if user_id is not None else None
        if found is None or found.os_uid is None:
            raise SpecError(
                "user",
                "this user has no OS account to run jobs as (multi-user mode); an admin "
                "assigns one with `hora user add NAME --uid N` for a new user",
            )
        return identity.run_as(found.os_uid)

    def check_work_root(self) -> None:
        """In multi-user mode, refuse a work root the job accounts cannot enter.

        Raises:
            HoraError: see :func:`hora_service.users.homes.check_work_root`.
        """
        root = self.work_root
        if self.mode != "multi" or root is None or not root.is_dir():
            return
        accounts = []
        for uid in (u.os_uid for u in self.all() if u.os_uid is not None):
            try:
                accounts.append(identity.run_as(uid))
            except SpecError:
                continue  # an account that is gone: its jobs are refused anyway
        homes.check_work_root(root, accounts)

    def check_start(self, db_path: Path) -> None:
        """Refuse single-user mode over a store with several users (a silent downgrade).

        Raises:
            HoraError: it has more than one user.
        """
        names = [u.name for u in self.all()]
        if self.mode == "single" and len(names) > 1:
            raise HoraError(
                f"single-user mode, but {db_path} has {len(names)} users "
                f"({', '.join(names[:5])}): their jobs would all run as this service's "
                "account. Run the service as root (multi-user mode), or set "
                "HORA_USER_MODE=shared to accept that."
            )
