"""``/healthz``, ``/v1/gpus`` and ``/metrics`` (control plane).

``/healthz`` is the only route without a token: it answers the background store check of
:mod:`hora_service.store.probe` (200 ``ok``, or 503 ``degraded`` with the reason) without touching
the store itself, so it stays fast while the store is slow. ``/metrics`` is Prometheus text
format 0.0.4, written by ``prometheus_client`` from the app's registry, whose collector
(:class:`hora_service.api.prometheus.ServiceCollector`) takes the manager's
:class:`MetricsSnapshot` at each scrape.
"""

from __future__ import annotations

import hora
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from hora.service_wire import Health
from prometheus_client.registry import CollectorRegistry

from hora_service.api.deps import CurrentUser, ManagerDep
from hora_service.api.errors import AUTH_RESPONSES
from hora_service.api.prometheus import PROMETHEUS_TYPE, exposition, registry
from hora_service.manager import JobManager
from hora_service.models import MetricsSnapshot, SlotInfo
from hora_service.observability.queueview import waiting_metrics
from hora_service.store.probe import HealthState, StoreProbe

router = APIRouter()


@router.get(
    "/healthz",
    response_model=Health,
    tags=["system"],
    summary="Health check (no token)",
    responses={503: {"model": Health, "description": "Degraded: the store is not usable"}},
)
async def healthz(request: Request) -> JSONResponse:
    """200 ``ok`` while the store reads and takes writes; 503 ``degraded`` with the reason.

    Needs no token. The answer comes from a background check (every few seconds), never
    from the store during the request.
    """
    probe: StoreProbe | None = getattr(request.app.state, "health", None)
    state = probe.state if probe is not None else HealthState("ok")
    body = Health(status=state.status, version=hora.__version__, reason=state.reason)
    headers = {} if state.ok else {"Retry-After": "5"}
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=200 if state.ok else 503, headers=headers
    )


@router.get(
    "/v1/gpus",
    response_model=list[SlotInfo],
    tags=["system"],
    summary="GPUs/slots and who holds them",
    responses=AUTH_RESPONSES,
)
def gpus(user: CurrentUser, manager: ManagerDep, request: Request) -> list[SlotInfo]:
    """Every GPU (or CPU slot on a machine without GPUs) and the job holding it, if any.

    With ``slurm_conf`` set, the Slurm cluster's GPUs follow, one row per node and GPU
    (``node``), with the job holding each where Slurm says (``slurm_job``, and hora's job
    and user when it is one of hora's). Then each parked session (``kind`` ``parked``, no
    ``index``: it holds no slot), with its owner, since when and its snapshot's size.
    """
    parked = request.app.state.sessions.parks.parked_rows()
    return manager.slots() + manager.cluster_slots() + parked


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    tags=["system"],
    summary="Prometheus metrics",
    responses={**AUTH_RESPONSES, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(user: CurrentUser, request: Request) -> PlainTextResponse:
    """Jobs by state and wait reason, queue waits, slot-hours per user, slots, latency."""
    return PlainTextResponse(exposition(request.app.state.metrics), media_type=PROMETHEUS_TYPE)


def metrics_snapshot(manager: JobManager) -> MetricsSnapshot:
    """The manager's numbers with the queue's waiting rows: what one scrape shows."""
    waiting, longest = waiting_metrics(manager)
    return manager.metrics().model_copy(update={"waiting": waiting, "waiting_longest_s": longest})


def metrics_registry(manager: JobManager) -> CollectorRegistry:
    """The app's metrics registry: one collector over ``manager``'s state."""
    return registry(lambda: metrics_snapshot(manager))
