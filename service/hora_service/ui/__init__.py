"""The web dashboard at ``/ui`` (control plane): the pool, the queue, jobs, sessions, users.

:func:`install` adds its routes and state to the service app. The page is plain HTML, CSS
and JavaScript under ``static/`` (shipped in the package; no build step, no library).
"""

from __future__ import annotations

from fastapi import FastAPI
from hora.spec import SlotKind

from hora_service.ui.auth import UiSessions
from hora_service.ui.gpustats import GpuProbe


def install(app: FastAPI) -> None:
    """Serve the dashboard from ``app`` (same origin as the API)."""
    from hora_service.ui.routes import router

    app.state.ui_sessions = UiSessions()
    app.state.gpu_probe = GpuProbe(app.state.manager.inventory[0].kind == SlotKind.gpu)
    app.include_router(router)
