"""``/healthz``, ``/v1/gpus`` and ``/metrics`` (control plane).

``/healthz`` is the only route without a token. ``/metrics`` is Prometheus text format 0.0.4
rendered from the manager's :class:`MetricsSnapshot` by
:func:`hora_service.api.prometheus.render_metrics`.
"""

from __future__ import annotations

import hora
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from hora_service.api.deps import CurrentUser, ManagerDep
from hora_service.api.errors import AUTH_RESPONSES
from hora_service.api.prometheus import PROMETHEUS_TYPE, render_metrics
from hora_service.models import SlotInfo

router = APIRouter()


class Health(BaseModel):
    """The answer of ``/healthz``."""

    status: str
    version: str


@router.get("/healthz", response_model=Health, tags=["system"], summary="Liveness check (no token)")
async def healthz() -> Health:
    """Answers 200 while the service is up; needs no token."""
    return Health(status="ok", version=hora.__version__)


@router.get(
    "/v1/gpus",
    response_model=list[SlotInfo],
    tags=["system"],
    summary="GPUs/slots and who holds them",
    responses=AUTH_RESPONSES,
)
def gpus(user: CurrentUser, manager: ManagerDep) -> list[SlotInfo]:
    """Every GPU (or CPU slot on a machine without GPUs) and the job holding it, if any."""
    return manager.slots()


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    tags=["system"],
    summary="Prometheus metrics",
    responses={**AUTH_RESPONSES, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(user: CurrentUser, manager: ManagerDep) -> PlainTextResponse:
    """Jobs by state, queue length, slots allocated and total, scheduling latency."""
    return PlainTextResponse(render_metrics(manager.metrics()), media_type=PROMETHEUS_TYPE)
