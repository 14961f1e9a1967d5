"""FastAPI dependencies of the job API (control plane): settings, manager, user, owned job.

The ownership rule lives here and only here (:func:`owned_job`): a user sees only their
own jobs, another user's job answers 404 exactly like a job that does not exist, and an
admin sees every job.

The dependencies are ``async``, and every SQLite read they make (a token look-up, a job
that is not cached) runs in the thread pool: a store that another process blocks must not
freeze the event loop (``/healthz`` and every other request would wait with it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from fastapi.dependencies.models import Dependant
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from hora_service.hub.users import HubUsers
from hora_service.manager import JobManager
from hora_service.models import JobRecord, User
from hora_service.settings import Settings
from hora_service.users.registry import Users

MAX_JOB_ID = 2**63 - 1
MAX_TOKEN_CHARS = 512

bearer = HTTPBearer(
    auto_error=False,
    description="A token from `hora user add NAME` (or printed by `hora up`).",
)


async def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings` (built in ``create_app``, never at import)."""
    settings: Settings = request.app.state.settings
    return settings


async def get_manager(request: Request) -> JobManager:
    """The app's :class:`JobManager`."""
    manager: JobManager = request.app.state.manager
    return manager


SettingsDep = Annotated[Settings, Depends(get_settings)]
ManagerDep = Annotated[JobManager, Depends(get_manager)]


def unauthorized(detail: str) -> HTTPException:
    """A 401 that tells the client to send a bearer token."""
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


class TokenCache:
    """Known tokens -> user for ``ttl_s`` seconds, so that a busy client costs no store lookup.

    Only tokens the store accepted are kept (keyed by their SHA-256, never in clear), for
    ``ttl_s`` seconds: a user removed from the store loses access within that time. The
    default, 0, asks the store on every request (one indexed read), so that removing a user
    (``hora user remove``, from another process) revokes their token on the next request.
    """

    def __init__(self, ttl_s: float = 0.0, max_entries: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, User]] = {}
        self._lock = threading.Lock()

    def lookup(self, token: str, load: Callable[[str], User | None]) -> User | None:
        """The user of ``token``, from the cache or from ``load`` (the store)."""
        if self.ttl_s <= 0:
            return load(token)
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        user = load(token)
        if user is not None:
            with self._lock:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[key] = (now + self.ttl_s, user)
        return user


class Identify:
    """Whose bearer token this is: a hora token (the store), else the hub's (hub mode).

    Args:
        users: the service's users.
        hub: in hub mode, the hub's users (:class:`hora_service.hub.users.HubUsers`).
    """

    def __init__(self, users: Users, hub: HubUsers | None = None) -> None:
        self.users = users
        self.hub = hub

    def __call__(self, token: str) -> User | None:
        """The user of ``token``, or None.

        Raises:
            hora_service.hub.users.HubUserRefused: a hub user who cannot be a hora user.
            hora_service.hub.api.HubUnavailable: the hub did not answer.
        """
        user = self.users.for_token(token)
        if user is None and self.hub is not None:
            user = self.hub.user_for_token(token)
        return user


def identify(request: Request) -> Identify:
    """The app's :class:`Identify` (built in ``create_app``)."""
    found: Identify = request.app.state.identify
    return found


async def current_user(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> User:
    """The user whose bearer token came with the request.

    Raises:
        HTTPException: 401 when the token is missing, malformed or unknown.
        hora_service.hub.users.HubUserRefused: (hub mode) a hub user who cannot be a hora
            user (403).
        hora_service.hub.api.HubUnavailable: (hub mode) the hub did not answer (503).
    """
    if creds is None or not creds.credentials:
        raise unauthorized("missing bearer token (send 'Authorization: Bearer <token>')")
    token = creds.credentials
    if len(token) > MAX_TOKEN_CHARS:
        raise unauthorized("invalid token")
    who = identify(request)
    cache: TokenCache | None = getattr(request.app.state, "token_cache", None)
    if cache is not None:
        user = await run_in_threadpool(cache.lookup, token, who)
    else:
        user = await run_in_threadpool(who, token)
    if user is None:
        raise unauthorized("invalid token")
    return user


CurrentUser = Annotated[User, Depends(current_user)]


def _query_names(dependant: Dependant) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def known_query(request: Request) -> None:
    """Refuse query parameters the route does not take (a typo is a 422, not ignored).

    Raises:
        HTTPException: 422 naming the first unknown parameter.
    """
    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is None or not request.query_params:
        return
    known = _query_names(dependant)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        name = unknown[0].encode("utf-8", "backslashreplace").decode()
        detail = [
            {"loc": ["query", name], "msg": "unknown query parameter", "type": "extra_forbidden"}
        ]
        raise HTTPException(status_code=422, detail=detail)


async def owned_job(
    job_id: Annotated[int, Path(ge=1, le=MAX_JOB_ID, description="the job's id")],
    user: CurrentUser,
    manager: ManagerDep,
) -> JobRecord:
    """The job ``job_id`` if the current user may see it (theirs, or any job for an admin).

    Raises:
        HTTPException: 404 when the job does not exist or belongs to someone else.
    """
    job = await run_in_threadpool(manager.get, job_id)
    # by the user's stable id: a new user who took a removed user's name owns none of theirs
    if job is None or not (user.is_admin or job.user_id == user.id):
        raise HTTPException(status_code=404, detail=f"job {job_id} not found")
    return job


OwnedJob = Annotated[JobRecord, Depends(owned_job)]
