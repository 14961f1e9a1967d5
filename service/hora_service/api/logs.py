"""``GET /v1/jobs/{id}/logs``: read or follow one rank's log (control plane).

Without ``follow`` the answer is ``text/plain``: at most ``limit`` bytes (capped by
``Settings.max_log_request_bytes``) from ``offset``, with ``X-Hora-Next-Offset`` telling where
to continue, ``X-Hora-Attempt`` the attempt read and ``X-Hora-Log-Complete: true`` once the
attempt is over and everything was read. With ``follow=true`` it is a stream of Server-Sent
Events: each event's ``data`` is a JSON string of log text and its ``id`` the byte offset after
it; resuming from ``offset`` or the ``Last-Event-ID`` header continues exactly there; the stream
ends with ``event: end`` when the attempt is over and the file is drained. Paths come from
the manager (built from ids, never from the request).

An elastic job's ranks are those of its current world: rank ``R``'s log is the lines of the
worker at ``R``, read from the driver's log (:mod:`hora_service.api.workerlog`; offsets are
the driver's log's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from hora.errors import SpecError
from hora.spec import JobState

from hora_service.api.deps import CurrentUser, ManagerDep, OwnedJob, SettingsDep
from hora_service.api.errors import JOB_RESPONSES, unprocessable
from hora_service.api.logstream import (
    FollowState,
    file_size,
    follow_log,
    read_chunk,
)
from hora_service.api.workerlog import Take, rank_log
from hora_service.manager import JobManager
from hora_service.models import JobRecord, User
from hora_service.users.quotas import OverLimit, StreamCounter

MAX_OFFSET = 2**62
DEFAULT_LIMIT = 1 << 20

router = APIRouter(tags=["logs"])


@router.get(
    "/v1/jobs/{job_id}/logs",
    summary="Read or follow one rank's log",
    response_class=Response,
    responses={
        **JOB_RESPONSES,
        429: {"description": "You have max_log_streams_per_user log streams open already"},
        200: {
            "description": "Log text (text/plain), or an SSE stream with follow=true",
            "content": {
                "text/plain": {"schema": {"type": "string"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        },
    },
)
def job_logs(
    job: OwnedJob,
    user: CurrentUser,
    manager: ManagerDep,
    settings: SettingsDep,
    request: Request,
    rank: Annotated[int, Query(ge=0, le=1 << 20, description="which rank's log")] = 0,
    attempt: Annotated[int | None, Query(ge=0, le=1000, description="default: the current")] = None,
    follow: Annotated[
        bool, Query(description="stream as Server-Sent Events until the end")
    ] = False,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="byte offset to start from")] = 0,
    limit: Annotated[
        int, Query(ge=1, le=1 << 30, description="most bytes to return")
    ] = DEFAULT_LIMIT,
    last_event_id: Annotated[int | None, Header(ge=0, le=MAX_OFFSET)] = None,
) -> Response:
    """Read (plain text) or follow (SSE) the log of ``rank`` of one attempt of a job."""
    if attempt is not None and attempt > job.attempt:
        msg = f"job {job.id} is at attempt {job.attempt}; attempt {attempt} has not happened"
        raise unprocessable(SpecError("attempt", msg), "query")
    chosen = job.attempt if attempt is None else attempt
    try:
        path, take = rank_log(manager, job, rank, chosen)
    except SpecError as e:
        raise unprocessable(e, "query") from None
    start = offset if last_event_id is None else last_event_id
    if follow:
        return _stream(request, manager, job, chosen, path, start, user, take)
    return _plain(manager, job, chosen, path, start, min(limit, _max_read(settings)), take)


def _max_read(settings: object) -> int:
    return int(getattr(settings, "max_log_request_bytes", DEFAULT_LIMIT))


async def _counted(events: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    """``events``, calling ``done`` once they end (drained, failed or the client left)."""
    try:
        async for event in events:
            yield event
    finally:
        done()


def _attempt_over(manager: JobManager, job_id: int, attempt: int) -> FollowState:
    job = manager.get(job_id)
    if job is None:
        return FollowState(True, {"state": "deleted", "attempt": attempt})
    over = (
        job.state.terminal
        or job.attempt > attempt
        or (job.state == JobState.retrying and job.attempt == attempt)
    )
    return FollowState(
        over, {"state": job.state.value, "attempt": attempt, "current_attempt": job.attempt}
    )


def _plain(
    manager: JobManager, job: JobRecord, attempt: int, path: Path, offset: int, limit: int,
    take: Take,
) -> Response:
    over = _attempt_over(manager, job.id, attempt).done
    data = read_chunk(path, offset, limit)
    size = file_size(path)
    text, used = take(data, over and offset + len(data) >= size)
    headers = {
        "X-Hora-Next-Offset": str(offset + used),
        "X-Hora-Log-Size": str(size),
        "X-Hora-Attempt": str(attempt),
        "X-Hora-Log-Complete": "true" if over and offset + used >= size else "false",
    }
    return Response(text.encode(), media_type="text/plain; charset=utf-8", headers=headers)


def _stream(
    request: Request,
    manager: JobManager,
    job: JobRecord,
    attempt: int,
    path: Path,
    offset: int,
    user: User,
    take: Take,
) -> StreamingResponse:
    streams: StreamCounter = request.app.state.log_streams
    if not streams.open(user.id):
        raise OverLimit(
            "log_streams",
            f"you have {streams.limit} log streams open already (the limit); close one",
            429,
        )
    events = _counted(
        follow_log(
            path, offset, lambda: _attempt_over(manager, job.id, attempt),
            request.is_disconnected, take=take,
        ),
        lambda: streams.close(user.id),
    )
    headers = {
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        "X-Hora-Attempt": str(attempt),
    }
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)
