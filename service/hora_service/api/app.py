"""The FastAPI application of the job service (control plane).

:func:`create_app` builds everything at call time (nothing at import): the settings, the
:class:`JobManager` (started in the lifespan, stopped at shutdown), the routes under ``/v1``,
``/healthz``, ``/metrics``, the request-size limit and the error handlers.

Outside dev mode the service refuses unsafe settings at startup (see
:mod:`hora_service.api.safety`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import hora
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from hora.errors import HoraError, SpecError
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from hora_service import ui
from hora_service.api import jobs, logs, parking, queue, sessions, system
from hora_service.api.deps import CurrentUser, Identify, TokenCache, known_query
from hora_service.api.errors import spec_error_detail, validation_detail
from hora_service.api.limits import BodySizeLimit
from hora_service.api.safety import check_safe
from hora_service.hub import signin
from hora_service.manager import JobManager
from hora_service.sessions.session_manager import SessionManager
from hora_service.settings import Settings
from hora_service.store.db import StoreUnavailable, is_unavailable
from hora_service.store.probe import StoreProbe
from hora_service.users.quotas import OverLimit, StreamCounter

log = logging.getLogger(__name__)
_REFUSAL = "method_not_allowed"  # the routes of _post_only (their methods are not allowed)


def create_app(settings: Settings | None = None, manager: JobManager | None = None) -> FastAPI:
    """Build the job service app.

    Args:
        settings: service settings (default: built from ``HORA_*`` environment variables).
        manager: a job manager; when given, its caller starts and stops it. Otherwise the
            app creates one and starts it in the lifespan and stops it at shutdown.

    Returns:
        The FastAPI app, ready for uvicorn.

    Example:
        >>> app = create_app(Settings(data_dir=tmp_path))  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    settings = settings or Settings()
    owned = manager is None
    mgr = manager or JobManager(settings)

    probe = StoreProbe(settings.db_path, mgr.journal, settings.health_interval_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owned:
            mgr.start()
        try:
            check_safe(settings, len(mgr.users.all()))
            probe.start()
            yield
        finally:
            probe.stop()
            if owned:
                mgr.stop()
            if settings.hub:
                app.state.hub_api.close()

    app = FastAPI(
        title="hora job service",
        version=hora.__version__,
        description="Submit, watch and cancel data-parallel PyTorch jobs on this machine.",
        lifespan=lifespan,
        dependencies=[Depends(known_query)],
        # the schema and its pages need a token like every route but /healthz (_add_docs)
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.manager = mgr
    app.state.sessions = SessionManager(mgr, settings)
    app.state.health = probe
    app.state.log_streams = StreamCounter(settings.max_log_streams_per_user)
    app.state.token_cache = TokenCache()
    app.state.metrics = system.metrics_registry(mgr)
    app.add_middleware(BodySizeLimit, max_bytes=max(1, int(settings.max_request_bytes)))
    app.include_router(jobs.router)
    app.include_router(logs.router)
    app.include_router(parking.router)
    _post_only(app, "/v1/sessions/park")  # before /v1/sessions/{job_id} takes "park" for an id
    app.include_router(sessions.router)
    app.include_router(sessions.address_router)
    app.include_router(system.router)
    app.include_router(queue.router)
    ui.install(app)
    hub_users = signin.install(app, settings, mgr.users) if settings.hub else None
    app.state.identify = Identify(mgr.users, hub_users)
    _add_docs(app)
    _add_handlers(app)
    _document_common_answers(app)
    return app


COMMON_ANSWERS: dict[str, dict[str, str]] = {
    "400": {"description": "The body could not be parsed (not JSON, not UTF-8)"},
    "413": {"description": "Request body larger than max_request_bytes"},
    "503": {"description": "The job store is unavailable now; retry after Retry-After"},
}


def _document_common_answers(app: FastAPI) -> None:
    """Add to the schema the answers any route may give, so that it says what happens.

    Every route with a body may answer 400 (unparsable) and 413 (too large); every route
    that needs a token may answer 503 (the token is looked up in the store).
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    answers = op.setdefault("responses", {})
                    codes = ["400", "413"] if "requestBody" in op else []
                    codes += ["503"] if op.get("security") else []
                    for code in codes:
                        answers.setdefault(code, COMMON_ANSWERS[code])
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def _add_docs(app: FastAPI) -> None:
    """``/openapi.json``, ``/docs`` and ``/redoc``, behind the bearer token."""

    @app.get("/openapi.json", include_in_schema=False)
    async def _openapi(user: CurrentUser) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def _docs(user: CurrentUser) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def _redoc(user: CurrentUser) -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


def store_unavailable(exc: BaseException) -> JSONResponse:
    """503 with ``Retry-After``: the store cannot take the request now; nothing was lost."""
    retry = int(getattr(exc, "retry_after_s", 5))
    why = str(getattr(exc, "orig", None) or exc).splitlines()[0][:300]
    return JSONResponse(
        {"detail": f"the job store is unavailable ({why}); retry in {retry}s"},
        status_code=503,
        headers={"Retry-After": str(retry)},
    )


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: FastAPI, scope: Mapping[str, Any]) -> list[str]:
    """Every method the app serves at this request's path (for a correct ``Allow``).

    Each method is routed as the router routes it: the first route that matches the path
    and that method in full serves it, unless it is a refusal of :func:`_post_only`. Asked
    of the router, not of its route list: FastAPI keeps an included router as one entry.
    """
    allowed = []
    for method in _METHODS:
        probe = {
            "type": "http",
            "method": method,
            "path": scope["path"],
            "root_path": scope.get("root_path", ""),
            "headers": [],
            "query_string": b"",
        }
        for route in app.router.routes:
            if route.matches(probe)[0] == Match.FULL:
                if getattr(route, "name", "") != _REFUSAL:
                    allowed.append(method)
                break
    return allowed


def _post_only(app: FastAPI, path: str) -> None:
    """Any other method on ``path`` is a 405 naming the methods it has (``POST``).

    A literal path beside a parameter one (``/v1/sessions/park`` beside
    ``/v1/sessions/{job_id}``) would otherwise answer ``GET`` as a read of the session named
    "park": a 422 for its id or an unknown query parameter, where the schema says the path
    has no ``GET`` (schemathesis found it).
    """

    async def refuse(request: Request) -> Response:
        allow = ", ".join(allowed_methods(app, request.scope))
        return JSONResponse({"detail": "Method Not Allowed"}, 405, headers={"Allow": allow})

    others = ["GET", "PUT", "PATCH", "DELETE", "OPTIONS"]
    app.router.routes.append(
        Route(path, refuse, methods=others, name=_REFUSAL, include_in_schema=False)
    )


def _add_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # the route that refused lists only its own method(s), or none (an included
            # router, the dashboard's files): name every method the path has
            allow = ", ".join(allowed_methods(app, request.scope))
            exc = StarletteHTTPException(405, exc.detail, headers={"Allow": allow})
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.exception_handler(SpecError)
    async def _spec_error(request: Request, exc: SpecError) -> JSONResponse:
        return JSONResponse({"detail": spec_error_detail(exc)}, status_code=422)

    @app.exception_handler(OverLimit)
    async def _over_limit(request: Request, exc: OverLimit) -> JSONResponse:
        headers = {"Retry-After": "10"} if exc.status_code == 429 else {}
        detail = [{"loc": ["limits", exc.field], "msg": str(exc), "type": "over_limit"}]
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(StoreUnavailable)
    async def _store_busy(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return store_unavailable(exc)

    @app.exception_handler(DBAPIError)
    async def _store_error(request: Request, exc: DBAPIError) -> JSONResponse:
        if not is_unavailable(exc):
            log.error("%s %s: %s", request.method, request.url.path, exc)
            return JSONResponse({"detail": "internal error"}, status_code=500)
        log.warning("%s %s: the store failed: %s", request.method, request.url.path, exc.orig)
        return store_unavailable(exc)

    @app.exception_handler(HoraError)
    async def _hora_error(request: Request, exc: HoraError) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        code = {"code": exc.code} if exc.code else {}
        return JSONResponse({"detail": str(exc), **code}, status_code=409)
