"""The JupyterHub REST API as the hora service uses it (control plane).

Three calls, with the service's own ``api_token`` where the hub wants one:

* ``GET {api}/user`` with a user's token: whose token it is and which scopes it carries
  (:meth:`HubApi.user_for_token`). The service accepts it only if the token may use this
  service (``access:services!service=NAME``, or ``access:services``): the hub returns the
  user of any token, so that check is the service's own.
* ``POST {api}/oauth2/token``: the browser's OAuth code (with its PKCE verifier) for a token
  (:meth:`HubApi.token_for_code`).
* ``GET {api}/users/{name}``: whether the hub counts a user as its admin
  (:meth:`HubApi.is_admin`; asked only when the setting ``hub_admins`` is on).

Answers about tokens are kept ``cache_s`` seconds (by the token's SHA-256, never in clear), so
that a notebook's heartbeats do not each cost a request to the hub; a token the hub revoked
(at logout, or when the user's server stopped) stops working within that time. The hub being
unreachable is a :class:`HubUnavailable` (the API answers 503), never "no such user".
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from hora.errors import HoraError

TIMEOUT_S = 10.0
MAX_CACHED = 4096


class HubUnavailable(HoraError):
    """The hub did not answer, or answered something the service cannot use."""

    retry_after_s = 5


@dataclass(frozen=True)
class HubUser:
    """A hub user, as a token of theirs showed them to the service.

    Attributes:
        name: the hub's user name.
        scopes: the scopes the token carries (as the hub expanded them).
    """

    name: str
    scopes: frozenset[str]

    def may_use(self, service: str) -> bool:
        """Whether the token may use the service called ``service``.

        Example:
            >>> HubUser("ann", frozenset({"access:services!service=hora"})).may_use("hora")
            True
            >>> HubUser("ann", frozenset({"access:servers!user=ann"})).may_use("hora")
            False
        """
        return bool({"access:services", f"access:services!service={service}"} & self.scopes)


def pkce_pair() -> tuple[str, str]:
    """A PKCE verifier and its S256 challenge (RFC 7636), for one sign-in.

    Example:
        >>> verifier, challenge = pkce_pair()
        >>> len(verifier) >= 43 and "=" not in challenge
        True
    """
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def authorize_url(
    base_url: str, client_id: str, redirect_uri: str, state: str, challenge: str
) -> str:
    """Where the browser signs in: the hub's ``/hub/api/oauth2/authorize`` with PKCE.

    Example:
        >>> authorize_url("/", "service-hora", "/services/hora/oauth_callback", "s", "c")[:44]
        '/hub/api/oauth2/authorize?client_id=service-'
    """
    query = urlencode({
        "client_id": client_id, "redirect_uri": redirect_uri, "response_type": "code",
        "state": state, "code_challenge": challenge, "code_challenge_method": "S256",
    })  # fmt: skip
    return f"/{base_url.strip('/')}/hub/api/oauth2/authorize?{query}".replace("//hub", "/hub")


class HubApi:
    """The hub's REST API (see the module docstring).

    Args:
        api_url: the hub's API, e.g. ``http://127.0.0.1:8081/hub/api``.
        token: the service's ``api_token`` (also its OAuth client secret).
        client_id: the service's OAuth client id (``service-NAME``).
        redirect_uri: the service's registered OAuth redirect URI.
        cache_s: how long an answer about a token is trusted.

    Example:
        >>> hub = HubApi("http://127.0.0.1:8081/hub/api", "secret", "service-hora", "/cb")
        >>> hub.user_for_token("a user's token")  # doctest: +SKIP
        HubUser(name='ann', scopes=frozenset({'access:services!service=hora', ...}))
    """

    def __init__(
        self,
        api_url: str,
        token: str,
        client_id: str,
        redirect_uri: str,
        cache_s: float = 30.0,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.client_id = client_id
        self.redirect_uri = redirect_uri
        self.cache_s = cache_s
        self._token = token
        self._http = httpx.Client(timeout=TIMEOUT_S, trust_env=False)
        self._cache: dict[str, tuple[float, HubUser | None]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def user_for_token(self, token: str) -> HubUser | None:
        """The hub user whose token this is (None: the hub does not know it).

        Raises:
            HubUnavailable: the hub did not answer, or not with a user.
        """
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        user = self._ask_user(token)
        with self._lock:
            if len(self._cache) >= MAX_CACHED:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= MAX_CACHED:
                    self._cache.clear()
            self._cache[key] = (now + self.cache_s, user)
        return user

    def _ask_user(self, token: str) -> HubUser | None:
        model = self._call("GET", "/user", token, none_on=(401, 403, 404))
        if model is None:
            return None
        name, scopes = model.get("name"), model.get("scopes")
        if model.get("kind", "user") != "user" or not isinstance(name, str) or not name:
            return None  # a service's token is no user's
        if not isinstance(scopes, list):
            raise HubUnavailable(f"the hub's answer about a token has no scopes: {model!r:.200}")
        return HubUser(name, frozenset(str(s) for s in scopes))

    def token_for_code(self, code: str, verifier: str) -> str | None:
        """The token the hub grants for an OAuth ``code`` (None: the hub refused the code).

        Raises:
            HubUnavailable: the hub did not answer.
        """
        form = {
            "client_id": self.client_id, "client_secret": self._token,
            "grant_type": "authorization_code", "code": code,
            "redirect_uri": self.redirect_uri, "code_verifier": verifier,
        }  # fmt: skip
        answer = self._call("POST", "/oauth2/token", None, form=form, none_on=(400, 401, 403))
        token = (answer or {}).get("access_token")
        return token if isinstance(token, str) and token else None

    def is_admin(self, name: str) -> bool:
        """Whether the hub counts user ``name`` as its admin (False when it has no such user).

        Raises:
            HubUnavailable: the hub did not answer, or refused the service (its role needs
                ``read:users``).
        """
        model = self._call("GET", f"/users/{quote(name, safe='')}", self._token, none_on=(404,))
        return bool(model and model.get("admin") is True)

    def _call(
        self,
        method: str,
        path: str,
        token: str | None,
        form: dict[str, str] | None = None,
        none_on: tuple[int, ...] = (),
    ) -> dict[str, Any] | None:
        headers = {"Authorization": f"token {token}"} if token else {}
        try:
            r = self._http.request(method, self.api_url + path, headers=headers, data=form)
        except httpx.HTTPError as e:
            raise HubUnavailable(f"cannot reach the hub at {self.api_url}: {e}") from None
        if r.status_code in none_on:
            return None
        if r.status_code != 200:
            raise HubUnavailable(f"the hub answered {r.status_code} to {method} {path}")
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise HubUnavailable(f"the hub's answer to {method} {path} is not a JSON object")
        return body
