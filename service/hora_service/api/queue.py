"""``GET /v1/queue``: every queued job and session in order, with its reason (control plane).

A non-admin sees their own entries whole and only the place, size and priority of others'.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from hora.spec import QueueEntry
from starlette.concurrency import run_in_threadpool

from hora_service.api.deps import CurrentUser, ManagerDep
from hora_service.api.errors import AUTH_RESPONSES
from hora_service.observability.queueview import entries_json, queue_entries

router = APIRouter(tags=["jobs"])


@router.get(
    "/v1/queue",
    response_model=list[QueueEntry],
    summary="The queue in order, each entry with its reason",
    responses=AUTH_RESPONSES,
)
async def queue(user: CurrentUser, manager: ManagerDep, request: Request) -> Response:
    """Queued jobs and sessions in the order the scheduler considers them.

    Each of your entries carries ``reason``: a ``kind`` (slots, quota, running_limit,
    priority, gang, image, backoff, runtime), the figures behind it and ``text``.
    """
    sessions = request.app.state.sessions
    now = time.time()
    entries = await run_in_threadpool(
        queue_entries, manager, user, now, sessions.idle_seen_by(user, now)
    )
    return Response(entries_json(entries), media_type="application/json")
