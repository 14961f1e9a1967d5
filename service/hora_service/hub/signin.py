"""The service behind JupyterHub: its prefix, the dashboard's sign-in through the hub.

Control plane.

In hub mode (setting ``hub``) :func:`install` adds to the app:

* :class:`HubPrefix`: the hub's proxy passes the whole path (``/services/hora/v1/jobs``);
  requests under the prefix get it as their ``root_path``, so the same routes answer there
  and at the service's own address (where the notebooks and the CLI may reach it directly).
* ``GET /ui/hub/login``: the start of the OAuth code flow with PKCE. The browser goes to the
  hub's ``/hub/api/oauth2/authorize``; a random ``state`` travels with it, and the same value
  in a short-lived cookie (``hora_oauth_state``, HttpOnly, the prefix's path) binds the flow to
  this browser; the PKCE verifier stays in the service's memory.
* ``GET /oauth_callback``: the hub sends the browser back with a code; the service checks the
  state against the cookie, trades the code (and the verifier) for the user's token, maps the
  hub user to a hora user (:mod:`hora_service.hub.users`) and opens a dashboard session (the
  ``hora_ui`` cookie, as a token sign-in does), bound to the hub's own session cookie.
* ``GET /``: to the dashboard (the hub checks that the service is up there).

The API needs nothing more: a hub token in ``Authorization: Bearer`` is accepted like a hora
token (:class:`hora_service.api.deps.Identify`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from hora_service.api.deps import identify
from hora_service.hub.api import HubApi, HubUnavailable, authorize_url, pkce_pair
from hora_service.hub.users import HubUserRefused, HubUsers
from hora_service.settings import Settings
from hora_service.ui.auth import COOKIE, HUB_SESSION_COOKIE, UiSessions, root_of
from hora_service.users.registry import Users

STATE_COOKIE = "hora_oauth_state"
PENDING_S = 600.0
MAX_PENDING = 10_000

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class HubPrefix:
    """Give requests under the hub's prefix that prefix as their ``root_path``.

    Args:
        app: the ASGI app to wrap.
        prefix: the service's path behind the proxy, e.g. ``/services/hora/``.
    """

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = "/" + prefix.strip("/")

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """Pass the request on, with ``root_path`` set when its path lies under the prefix."""
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (
            path == self.prefix or path.startswith(self.prefix + "/")
        ):
            scope = dict(scope, root_path=self.prefix)
        await self.app(scope, receive, send)


class PendingSignIns:
    """Sign-ins begun: each OAuth ``state`` with its PKCE verifier, for ``PENDING_S``."""

    def __init__(self, ttl_s: float = PENDING_S) -> None:
        self.ttl_s = ttl_s
        self._by_state: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def begin(self) -> tuple[str, str]:
        """A new sign-in: its ``state`` and PKCE challenge (the verifier is kept here)."""
        state = secrets.token_urlsafe(32)
        verifier, challenge = pkce_pair()
        with self._lock:
            now = time.monotonic()
            if len(self._by_state) >= MAX_PENDING:
                self._by_state = {k: v for k, v in self._by_state.items() if v[1] > now}
                while len(self._by_state) >= MAX_PENDING:
                    self._by_state.pop(next(iter(self._by_state)))
            self._by_state[state] = (verifier, now + self.ttl_s)
        return state, challenge

    def finish(self, state: str) -> str | None:
        """The verifier of a live sign-in (once: it is forgotten), or None."""
        with self._lock:
            found = self._by_state.pop(state, None)
        if found is None or found[1] <= time.monotonic():
            return None
        return found[0]


router = APIRouter(include_in_schema=False)


@router.get("/")
async def home(request: Request) -> RedirectResponse:
    """The dashboard."""
    return RedirectResponse(f"{root_of(request)}/ui/", status_code=302)


@router.get("/ui/hub/login")
async def hub_login(request: Request) -> RedirectResponse:
    """Send the browser to the hub to sign in (the OAuth code flow with PKCE)."""
    settings: Settings = request.app.state.settings
    hub: HubApi = request.app.state.hub_api
    state, challenge = request.app.state.sign_ins.begin()
    where = authorize_url(settings.hub_base_url, hub.client_id, hub.redirect_uri, state, challenge)
    answer = RedirectResponse(where, status_code=302)
    answer.set_cookie(
        STATE_COOKIE, state, max_age=int(PENDING_S), path=f"{root_of(request)}/",
        httponly=True, samesite="lax", secure=request.url.scheme == "https",
    )  # fmt: skip
    return answer


@router.get("/oauth_callback")
async def oauth_callback(
    request: Request,
    code: Annotated[str, Query(min_length=1, max_length=1024)],
    state: Annotated[str, Query(min_length=1, max_length=256)],
) -> RedirectResponse:
    """Finish a sign-in: check the state, trade the code for a token, open a session."""
    mine = request.cookies.get(STATE_COOKIE, "")
    if not mine or not hmac.compare_digest(mine.encode(), state.encode()):
        raise HTTPException(403, "this sign-in was not started by this browser: sign in again")
    verifier = request.app.state.sign_ins.finish(state)
    if verifier is None:
        raise HTTPException(403, "this sign-in expired: sign in again")
    hub: HubApi = request.app.state.hub_api
    token = await run_in_threadpool(hub.token_for_code, code, verifier)
    if token is None:
        raise HTTPException(403, "the hub did not accept this sign-in: sign in again")
    user = await run_in_threadpool(identify(request), token)
    if user is None:
        service = request.app.state.settings.hub_service_name
        raise HTTPException(403, f"the hub does not let this user use the service {service!r}")
    sessions: UiSessions = request.app.state.ui_sessions
    hub_session = request.cookies.get(HUB_SESSION_COOKIE, "")
    sid, _ = sessions.open(token, hub_session=hub_session, owner=user.name)
    root = root_of(request)
    answer = RedirectResponse(f"{root}/ui/", status_code=302)
    answer.set_cookie(
        COOKIE, sid, max_age=int(sessions.ttl_s), path=f"{root}/ui", httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )  # fmt: skip
    answer.delete_cookie(STATE_COOKIE, path=f"{root}/")
    return answer


def install(app: FastAPI, settings: Settings, users: Users) -> HubUsers:
    """Serve the app behind JupyterHub (see the module docstring); the hub's users.

    Raises:
        hora_service.api.safety.UnsafeConfigError: no ``hub_api_token``, or not multi-user
            mode outside dev mode.
    """
    from hora_service.api.safety import UnsafeConfigError

    if users.mode != "multi" and not settings.dev_mode:
        raise UnsafeConfigError(
            "hub mode runs each hub user's sessions and jobs as their own OS account, which "
            f"needs multi-user mode (run hora serve as root); this service is in {users.mode} "
            "mode (--dev accepts that, for a trial)"
        )
    if settings.hub_api_token is None or not settings.hub_api_token.get_secret_value():
        raise UnsafeConfigError(
            "hub mode needs the service's api_token of the hub's configuration "
            "(HORA_HUB_API_TOKEN, or JUPYTERHUB_API_TOKEN as the hub sets it)"
        )
    hub = HubApi(
        settings.hub_api_url, settings.hub_api_token.get_secret_value(), settings.hub_client,
        settings.hub_callback, settings.hub_cache_s,
    )  # fmt: skip
    app.state.hub_api = hub
    app.state.sign_ins = PendingSignIns()
    app.add_middleware(HubPrefix, prefix=settings.hub_prefix)
    app.include_router(router)

    @app.exception_handler(HubUserRefused)
    async def _refused(request: Request, exc: HubUserRefused) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    @app.exception_handler(HubUnavailable)
    async def _hub_down(request: Request, exc: HubUnavailable) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": str(exc)}, status_code=503, headers=headers)

    return HubUsers(users, hub, settings.hub_service_name, settings.hub_admins)
