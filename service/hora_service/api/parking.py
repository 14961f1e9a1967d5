"""Routes that park and resume a session (control plane).

``POST /v1/sessions/{id}/park`` begins a park (its directory and a ticket), ``.../park/commit``
records it and stops the engines, ``.../park/abort`` gives it up; ``.../resume`` queues a
parked session again, ``.../withdraw`` gives a resume up (it stays parked) and ``DELETE
.../snapshot`` deletes the snapshot once the kernel restored it. ``POST /v1/sessions/park``
asks the kernels of a user's running sessions to park them (a JupyterHub culler before it
stops a server). See :mod:`hora_service.sessions.park_manager`; ownership is the sessions'
rule (404).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from hora.errors import HoraError, SpecError
from hora.session_wire import ParkAbort, ParkBegin, ResumeRequest
from hora.spec import JobState, ParkCommit, ParkTicket, SessionInfo
from pydantic import BaseModel

from hora_service.api.deps import CurrentUser
from hora_service.api.errors import unprocessable
from hora_service.api.sessions import BODY, SESSION_RESPONSES, OwnedSession, SessionsDep
from hora_service.models import JobRecord
from hora_service.sessions.park_manager import ParkConflict
from hora_service.sessions.parkdirs import ParkDirError
from hora_service.users.quotas import OverLimit

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

CONFLICT: dict[int | str, dict[str, Any]] = {
    **SESSION_RESPONSES, **BODY,
    409: {"description": "The session is not in the state this step needs (the message says)"},
}  # fmt: skip
QUOTA: dict[int | str, dict[str, Any]] = {
    413: {"description": "Past the user's quota of parked snapshots (the figures are named)"}
}


class ParkAsked(BaseModel):
    """The sessions whose kernels were asked to park them."""

    user: str
    sessions: list[int]


@contextmanager
def _answers() -> Iterator[None]:
    """The park errors as HTTP answers: 409 conflict, 413 quota, 422 naming a field."""
    try:
        yield
    except SpecError as e:
        raise unprocessable(e) from None
    except OverLimit as e:
        raise HTTPException(status_code=e.status_code, detail=str(e)) from None
    except (ParkConflict, ParkDirError, HoraError) as e:  # e.g. it stopped meanwhile
        raise HTTPException(status_code=409, detail=str(e)) from None


def _step(sessions: SessionsDep, job: JobRecord, act: Callable[[], object]) -> SessionInfo:
    with _answers():
        act()
    return sessions.view(sessions.manager.get(job.id) or job)


@router.post(
    "/park", response_model=ParkAsked, summary="Ask a user's kernels to park their sessions",
    responses={**SESSION_RESPONSES, 403: {"description": "Another user's, and not an admin"}},
)  # fmt: skip
def park_all(
    user: CurrentUser,
    sessions: SessionsDep,
    who: Annotated[str | None, Query(alias="user", description="whose (admins only)")] = None,
) -> ParkAsked:
    """Ask the kernel of each of the user's running sessions to park it (as ``--force``).

    Each kernel hears it with its next heartbeat (within a third of the lease) and parks
    unless a cell runs; poll ``GET /v1/sessions?state=running`` until none is left.
    """
    owner = who or user.name
    if owner != user.name and not user.is_admin:
        raise HTTPException(status_code=403, detail="only an admin asks for another user")
    return ParkAsked(user=owner, sessions=sessions.parks.ask_all(owner, user.name))


@router.post(
    "/{job_id}/park", response_model=ParkTicket, summary="Begin parking a session",
    responses={**CONFLICT, **QUOTA},
)  # fmt: skip
def park_begin(job: OwnedSession, body: ParkBegin, sessions: SessionsDep) -> ParkTicket:
    """Make the park's directory (the owner's own, for the engines' account); a ticket.

    ``bytes`` is the kernel's estimate: past the quota already, a 413 says so at once.
    """
    with _answers():
        return sessions.parks.begin(job, body)


@router.post(
    "/{job_id}/park/commit", response_model=SessionInfo, summary="Commit a park",
    responses={**CONFLICT, **QUOTA, 422: {"description": "The parts do not match the ranks"}},
)  # fmt: skip
def park_commit(job: OwnedSession, body: ParkCommit, sessions: SessionsDep) -> SessionInfo:
    """Check every rank's part, count it against the quota, record it, stop the engines.

    The session is ``parked`` once its engines are gone (its slots are then free).
    """
    return _step(sessions, job, lambda: sessions.parks.commit(job, body))


@router.post(
    "/{job_id}/park/abort", response_model=SessionInfo, summary="Give a park up",
    responses=CONFLICT,
)  # fmt: skip
def park_abort(job: OwnedSession, body: ParkAbort, sessions: SessionsDep) -> SessionInfo:
    """Remove an unfinished park's parts; the engines run on (an idle session is stopped)."""
    return _step(sessions, job, lambda: sessions.parks.abort(job, body))


@router.post(
    "/{job_id}/resume", response_model=SessionInfo, summary="Resume a parked session",
    responses={**CONFLICT, 422: {"description": "Another size without elastic state, ..."}},
)  # fmt: skip
def resume(job: OwnedSession, req: ResumeRequest, sessions: SessionsDep) -> SessionInfo:
    """Queue a parked session again; its engines restore the snapshot when they start."""
    return _step(sessions, job, lambda: sessions.parks.resume(job, req))


@router.post(
    "/{job_id}/withdraw", response_model=SessionInfo, summary="Give a resume up",
    responses=CONFLICT,
)  # fmt: skip
def withdraw(job: OwnedSession, sessions: SessionsDep) -> SessionInfo:
    """A session asked to resume goes back to being parked, its snapshot kept.

    Any other session is withdrawn or stopped as ``DELETE /v1/sessions/{id}`` does.
    """
    return _step(sessions, job, lambda: sessions.parks.withdraw(job))


@router.delete(
    "/{job_id}/snapshot", response_model=SessionInfo, summary="Delete a restored snapshot",
    responses=CONFLICT,
)  # fmt: skip
def delete_snapshot(job: OwnedSession, sessions: SessionsDep) -> SessionInfo:
    """The kernel restored the snapshot (or gave it up): delete it."""

    def act() -> None:
        if job.state == JobState.parked:
            raise ParkConflict(f"session {job.id} is parked: end it with DELETE instead")
        sessions.parks.restored(job)

    return _step(sessions, job, act)

