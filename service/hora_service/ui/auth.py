"""Sign-in for the dashboard: a token once, then an HttpOnly session cookie (control plane).

``POST /ui/login`` takes a user's API token and answers with a cookie ``hora_ui`` (HttpOnly,
``SameSite=Strict``, ``Path=/ui``, ``Secure`` over https) that names a server-side session;
the token itself stays in the service's memory, and every request looks its user up again,
so removing a user ends their dashboard sessions at once. Sessions live ``UI_SESSION_S``
(12 h) and end at logout or when the service restarts. Behind JupyterHub (hub mode) the
cookie's path is the service's prefix plus ``/ui``, and a browser may sign in through the
hub instead (:mod:`hora_service.hub.signin`): its session holds the hub's OAuth token, which
is checked with the hub like any token, and is bound to the hub's own session cookie.
One user holds at most
``SESSIONS_PER_USER`` sessions: a sign-in beyond that ends *their own* oldest one, never
another user's, so no amount of signing in by one user signs anyone else out (sessions are
counted by the user the token resolves to).

Cross-site requests: besides ``SameSite=Strict``, every POST must carry the session's CSRF
token in ``X-Hora-CSRF`` (the page reads it from ``GET /ui/api/me``, which a cross-site page
cannot read), and a POST whose ``Origin`` is not the service's own is refused.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from hora_service.api.deps import identify
from hora_service.models import User

COOKIE = "hora_ui"
CSRF_HEADER = "X-Hora-CSRF"
HUB_SESSION_COOKIE = "jupyterhub-session-id"  # the hub's, path /: it names the hub login
UI_SESSION_S = 12 * 3600.0
SESSIONS_PER_USER = 32


@dataclass
class UiSession:
    """One signed-in browser: the user's token (never sent back) and its CSRF token.

    A browser signed in through JupyterHub (hub mode) holds the hub's OAuth token here, and
    ``hub_session`` is the hub's ``jupyterhub-session-id`` cookie it signed in with: the
    session is good only with that cookie beside it.
    """

    token: str
    csrf: str
    expires: float
    hub_session: str | None = None
    owner: str = ""  # whose sessions it counts among (the user's name; else the token)


class UiSessions:
    """Signed-in browsers by session id (in memory; a restart signs everyone out)."""

    def __init__(self, ttl_s: float = UI_SESSION_S) -> None:
        self.ttl_s = ttl_s
        self._by_id: dict[str, UiSession] = {}
        self._of_token: dict[str, list[str]] = {}  # session ids by owner, oldest first
        self._lock = threading.Lock()

    def open(
        self, token: str, hub_session: str | None = None, owner: str | None = None
    ) -> tuple[str, UiSession]:
        """A new session for ``token``: its id (the cookie's value) and the session.

        Sessions are counted by ``owner`` (the user's name; the token when not given: a hub
        sign-in brings a new OAuth token each time, so it passes the user). The owner's
        expired sessions go, and beyond ``SESSIONS_PER_USER`` their oldest live ones; other
        owners' sessions are never touched.
        """
        key = owner or token
        sid = secrets.token_urlsafe(32)
        expires = time.time() + self.ttl_s
        session = UiSession(token, secrets.token_urlsafe(32), expires, hub_session, key)
        with self._lock:
            now = time.time()
            mine = [s for s in self._of_token.get(key, []) if self._live(s, now)]
            while len(mine) >= SESSIONS_PER_USER:
                self._by_id.pop(mine.pop(0), None)
            mine.append(sid)
            self._of_token[key] = mine
            self._by_id[sid] = session
        return sid, session

    def _live(self, sid: str, now: float) -> bool:
        """Whether ``sid`` is a live session; drops it when it has expired (lock held)."""
        session = self._by_id.get(sid)
        if session is not None and session.expires <= now:
            del self._by_id[sid]
            return False
        return session is not None

    def count(self, token: str) -> int:
        """How many live sessions ``token`` (or the owner of that name) has."""
        with self._lock:
            now = time.time()
            return sum(self._live(s, now) for s in self._of_token.get(token, []))

    def get(self, sid: str | None) -> UiSession | None:
        """The live session ``sid`` names, or None."""
        if not sid or len(sid) > 128:
            return None
        with self._lock:
            session = self._by_id.get(sid)
            if session is not None and session.expires <= time.time():
                del self._by_id[sid]
                return None
        return session

    def close(self, sid: str | None) -> None:
        """End a session (logout)."""
        with self._lock:
            session = self._by_id.pop(sid or "", None)
            if session is not None:
                key = session.owner or session.token
                mine = [s for s in self._of_token.get(key, []) if s != sid]
                if mine:
                    self._of_token[key] = mine
                else:
                    self._of_token.pop(key, None)


@dataclass(frozen=True)
class Viewer:
    """The signed-in user of a dashboard request, and their session."""

    user: User
    session: UiSession


def root_of(request: Request) -> str:
    """The prefix the request came through (behind JupyterHub's proxy), else ``""``."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def same_origin(request: Request) -> bool:
    """True unless the request names an ``Origin`` other than the service's own."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return origin in (f"{request.url.scheme}://{host}",)


async def viewer(request: Request) -> Viewer:
    """The user signed in with this request's cookie.

    Raises:
        HTTPException: 401 when there is no live session or its user is gone (or, for a
            session made through the hub, the hub's session cookie is not the one it was
            made with, or the hub revoked its token).
    """
    sessions: UiSessions = request.app.state.ui_sessions
    session = sessions.get(request.cookies.get(COOKIE))
    if session is None:
        raise HTTPException(401, "not signed in")
    if session.hub_session is not None and not hmac.compare_digest(
        request.cookies.get(HUB_SESSION_COOKIE, "").encode(), session.hub_session.encode()
    ):
        raise HTTPException(401, "not signed in (not with this browser's hub session)")
    user = await run_in_threadpool(identify(request), session.token)
    if user is None:
        sessions.close(request.cookies.get(COOKIE))
        raise HTTPException(401, "not signed in (the user was removed)")
    return Viewer(user, session)


ViewerDep = Annotated[Viewer, Depends(viewer)]


async def checked_post(request: Request, who: ViewerDep) -> Viewer:
    """:func:`viewer`, for a POST: same origin and the session's CSRF token.

    Raises:
        HTTPException: 403 for a cross-site request or a missing or wrong CSRF token.
    """
    if not same_origin(request):
        raise HTTPException(403, "cross-site request refused")
    given = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode(), who.session.csrf.encode()):
        raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header")
    return who


PosterDep = Annotated[Viewer, Depends(checked_post)]
