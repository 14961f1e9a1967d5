"""Hub users as hora users: found by name, made on first contact, bound to their account.

Control plane.

A hub user is the hora user of the same name. The first time one reaches the service (a
signed-in browser, a notebook's token), the service creates that hora user with the
service's defaults (its quota and limits apply: the user has none of their own) and binds it
to the OS account of the same name, the account JupyterHub's ``LocalProcessSpawner`` and
batchspawner run the user's server as; no ``hora-NAME`` account is made beside it. A hora
user of that name that runs as another account is refused, not rebound: an admin decides
(:class:`HubUserRefused`, 403, says what to do).

A hub admin is a hora admin only when the setting ``hub_admins`` is on; a hora admin
(``hora user add NAME --admin``) stays one whatever the hub says.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable

from hora.errors import HoraError

from hora_service.hub.api import HubApi
from hora_service.models import User
from hora_service.users.registry import Users


class HubUserRefused(HoraError):
    """A hub user the service cannot map to a hora user; the message says why and the fix."""


def account_uid(name: str) -> int:
    """The uid of the OS account called ``name``.

    Raises:
        HubUserRefused: there is none.

    Example:
        >>> account_uid("root")
        0
    """
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise HubUserRefused(
            f"the hub user {name!r} has no OS account of that name; hora runs a hub user's "
            "sessions and jobs as the account the hub's spawner runs their server as"
        ) from None


class HubUsers:
    """The hora user of a hub user's token (see the module docstring).

    Args:
        users: the service's users.
        hub: the hub's API.
        service: the service's name at the hub (its access scope).
        hub_admins: the hub's admins are hora admins too.
        uid_of: the OS account of a hub user name (default :func:`account_uid`).
    """

    def __init__(
        self,
        users: Users,
        hub: HubApi,
        service: str,
        hub_admins: bool = False,
        uid_of: Callable[[str], int] = account_uid,
    ) -> None:
        self.users = users
        self.hub = hub
        self.service = service
        self.hub_admins = hub_admins
        self.uid_of = uid_of

    def user_for_token(self, token: str) -> User | None:
        """The hora user of a hub token; None if the hub does not know it or it may not use us.

        Raises:
            HubUserRefused: the hub user cannot be mapped (no account, another binding).
            hora_service.hub.api.HubUnavailable: the hub did not answer.
        """
        found = self.hub.user_for_token(token)
        if found is None or not found.may_use(self.service):
            return None
        user = self.user_for(found.name)
        if self.hub_admins and not user.is_admin and self.hub.is_admin(found.name):
            return user.model_copy(update={"is_admin": True})
        return user

    def user_for(self, name: str) -> User:
        """The hora user ``name``, created and bound to the account ``name`` if new.

        Outside multi-user mode (dev mode's trial) the user is bound to no account.

        Raises:
            HubUserRefused: see :meth:`user_for_token`.
        """
        uid = self.uid_of(name) if self.users.mode == "multi" else None
        user = self.users.by_name(name) or self._make(name, uid)
        if user.os_uid != uid:
            runs = "no account" if user.os_uid is None else f"uid {user.os_uid}"
            raise HubUserRefused(
                f"the hora user {name!r} runs as {runs}, but the hub runs {name!r}'s server "
                f"as uid {uid}: an admin binds them (hora user remove {name}; the next "
                "sign-in makes the user again)"
            )
        return user

    def _make(self, name: str, uid: int | None) -> User:
        try:
            self.users.create(name, uid=uid)
        except HoraError as e:  # the store's refusal included
            found = self.users.by_name(name)
            if found is not None:  # made by a request that came at the same time
                return found
            raise HubUserRefused(f"cannot make hub user {name!r} a hora user: {e}") from None
        made = self.users.by_name(name)
        if made is None:
            raise HubUserRefused(f"cannot make hub user {name!r} a hora user")
        return made
