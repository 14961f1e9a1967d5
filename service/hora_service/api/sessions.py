"""Routes under ``/v1/sessions``: a notebook's engines as a scheduled session (control plane).

Create, list, get, heartbeat, replace a dead engine, hand off, delete. Ownership is the jobs'
rule (:func:`owned_job`): another user's session answers 404 exactly like one that does not
exist; a job's id is not a session.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from hora.errors import SpecError
from hora.session_wire import (
    EngineReplacement,
    Heartbeat,
    SessionAddress,
    SessionList,
    SessionRequest,
)
from hora.spec import JobKind, JobSpec, JobState, RuntimeName, SessionInfo

from hora_service.api.deps import CurrentUser, ManagerDep, OwnedJob
from hora_service.api.errors import AUTH_RESPONSES, unprocessable
from hora_service.jobs.preflight import job_preflight
from hora_service.models import JobRecord
from hora_service.sessions.session_manager import SessionManager

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
# beside /v1/sessions/{id}, not under it: an id route must not answer other methods there
address_router = APIRouter(prefix="/v1", tags=["sessions"])

Responses = dict[int | str, dict[str, Any]]
BODY: Responses = {400: {"description": "The body could not be read (not UTF-8, not JSON)"}}
BUSY: Responses = {503: {"description": "The store cannot take it now; retry after Retry-After"}}
SESSION_RESPONSES: Responses = {
    **AUTH_RESPONSES,
    404: {"description": "No such session, it belongs to another user, or the id is a job's"},
}


async def get_sessions(request: Request) -> SessionManager:
    """The app's :class:`SessionManager`."""
    sessions: SessionManager = request.app.state.sessions
    return sessions


SessionsDep = Annotated[SessionManager, Depends(get_sessions)]


async def owned_session(job: OwnedJob) -> JobRecord:
    """The session ``job_id`` if the current user may see it (404 otherwise, or for a job)."""
    if job.kind != JobKind.session:
        raise HTTPException(status_code=404, detail=f"session {job.id} not found")
    return job


OwnedSession = Annotated[JobRecord, Depends(owned_session)]


@router.post(
    "",
    status_code=201,
    response_model=SessionInfo,
    summary="Ask for engines",
    responses={
        **AUTH_RESPONSES,
        **BODY,
        **BUSY,
        413: {"description": "Request body or session too large"},
        429: {"description": "Too many of your jobs and sessions wait in the queue already"},
    },  # fmt: skip
)
def create_session(req: SessionRequest, user: CurrentUser, sessions: SessionsDep) -> SessionInfo:
    """Queue a session of ``workers`` engines that connect to the kernel's controller.

    It is scheduled with the jobs (priority, quota, backfill); the answer's ``queue`` says
    where it stands. A request that can never run here is a 422 naming the field.
    """
    try:
        return sessions.create(user.name, req)
    except SpecError as e:
        raise unprocessable(e) from None


@router.get("", response_model=SessionList, summary="List sessions", responses=AUTH_RESPONSES)
def list_sessions(
    user: CurrentUser,
    manager: ManagerDep,
    sessions: SessionsDep,
    state: Annotated[JobState | None, Query(description="only sessions in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> SessionList:
    """Your sessions (an admin sees everyone's), newest first."""
    jobs, _ = manager.list_jobs(None if user.is_admin else user.name, state, 10_000, 0)
    mine = [j for j in jobs if j.kind == JobKind.session]
    items = [sessions.view(j, viewer=user) for j in mine[:limit]]
    return SessionList(items=items, total=len(mine))


@address_router.get(
    "/session-address",
    response_model=SessionAddress,
    summary="Where a kernel's controller listens",
    responses={**AUTH_RESPONSES, 422: {"description": "Slurm's nodes cannot be asked"}},
)
def session_address(
    user: CurrentUser,
    sessions: SessionsDep,
    runtime: Annotated[RuntimeName, Query(description="the session's runtime")] = RuntimeName.local,
) -> SessionAddress:
    """The address of this machine a session's engines reach the kernel's controller at.

    ``127.0.0.1`` where they run on this machine; on Slurm, the admin's
    ``HORA_SLURM_SESSION_ADDRESS`` or the address this machine reaches the nodes from.
    """
    try:
        return sessions.address(runtime)
    except SpecError as e:
        raise unprocessable(e, "query") from None


@router.get(
    "/{job_id}", response_model=SessionInfo, summary="Get a session", responses=SESSION_RESPONSES
)
def get_session(
    job: OwnedSession, user: CurrentUser, sessions: SessionsDep, manager: ManagerDep
) -> SessionInfo:
    """State, slots, queue place (while queued), idle time, warning and preflight of one session.

    ``preflight`` is what ``%dist_start`` measured on the engines (rank 0 logs it), as a
    job's is (:func:`hora_service.jobs.preflight.job_preflight`).
    """
    view = sessions.view(job, viewer=user)
    figures = job_preflight(manager, job)
    return view if figures is None else view.model_copy(update={"preflight": figures})


@router.post(
    "/{job_id}/heartbeat",
    response_model=SessionInfo,
    summary="Renew a session's lease",
    responses={**SESSION_RESPONSES, **BODY},
)
def heartbeat(job: OwnedSession, beat: Heartbeat, sessions: SessionsDep) -> SessionInfo:
    """The kernel is alive; its engines have been idle ``idle_s`` seconds.

    The answer carries ``warning`` when the idle timeout is near, and the session's state
    (with ``reason``) once it ended.
    """
    return sessions.heartbeat(job, beat)


@router.post(
    "/{job_id}/replace",
    response_model=SessionInfo,
    summary="Start a new engine for a dead one",
    responses={
        **SESSION_RESPONSES,
        **BODY,
        409: {"description": "The session is not running, or that rank's engine is"},
        422: {"description": "No such rank, or the session's runtime cannot (field named)"},
    },  # fmt: skip
)
def replace_engine(
    job: OwnedSession, body: EngineReplacement, manager: ManagerDep, sessions: SessionsDep
) -> SessionInfo:
    """Start a new engine for ``rank``, whose engine died; the other engines are untouched.

    The session keeps a dead engine's slot until the kernel asks (``%%distributed``'s next
    cell does, after rebuilding the survivors' process group around a store on
    ``master_port``). Local sessions only: on docker and Slurm a dead engine ends the session.
    """
    try:
        return sessions.view(manager.replace_engine(job.id, body.rank, body.master_port))
    except SpecError as e:
        raise unprocessable(e) from None


@router.post(
    "/{job_id}/handoff",
    response_model=JobRecord,
    status_code=201,
    summary="Hand a session's slots to a new job",
    responses={**SESSION_RESPONSES, **BODY, **BUSY, 409: {"description": "Not running"}},
)
def handoff(job: OwnedSession, spec: JobSpec, manager: ManagerDep) -> JobRecord:
    """Submit ``spec`` as the session's owner and give it the session's slots.

    The session's engines are stopped; the job starts on its slots as soon as they are
    gone, before any queued job can take them. A job that needs more slots than the session
    holds is a 422 naming the field; a session that is not running is a 409.
    """
    try:
        return manager.handoff(job.id, job.user, spec)
    except SpecError as e:
        raise unprocessable(e) from None


@router.delete(
    "/{job_id}",
    response_model=SessionInfo,
    summary="Stop or withdraw a session",
    responses={**SESSION_RESPONSES, **BUSY},
)
def delete_session(job: OwnedSession, sessions: SessionsDep) -> SessionInfo:
    """Withdraw a queued session or stop a running one's engines; its slots are freed."""
    return sessions.delete(job)
