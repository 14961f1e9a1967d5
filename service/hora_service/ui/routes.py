"""The dashboard's routes: the page, sign-in, and the JSON it polls (control plane).

``/ui`` serves a static page (``static/``, shipped in the package; no build step) whose script
polls ``/ui/api/*`` every second or two. Those routes authenticate with the session cookie of
:mod:`hora_service.ui.auth` and apply the API's rules: a user sees their own jobs and
sessions (an admin everyone's; another user's job is a 404 as in ``/v1``), everyone sees who
holds which slot, and another user's queue entries show only their place.
"""

from __future__ import annotations

import json
import socket
import time
from html import escape
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from hora.errors import SpecError
from hora.spec import JobKind, JobState, SlotKind
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from hora_service.api.deps import owned_job
from hora_service.api.logstream import file_size, read_chunk
from hora_service.api.workerlog import rank_log
from hora_service.jobs.preflight import job_preflight
from hora_service.manager import JobManager
from hora_service.models import JobRecord, User
from hora_service.observability.jobtrace import job_scaling
from hora_service.observability.queueview import entries_json, job_queue, queue_entries
from hora_service.ui.auth import (
    COOKIE,
    PosterDep,
    UiSessions,
    ViewerDep,
    root_of,
    same_origin,
)
from hora_service.ui.gpustats import GpuProbe
from hora_service.ui.timeline import job_timeline

LOG_CHUNK = 256 * 1024
STATIC = resources.files("hora_service.ui") / "static"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}
# the page loads only its own script and style; nothing inline, nothing from elsewhere
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


class Login(BaseModel):
    """The sign-in form: a user's API token."""

    token: Annotated[str, Field(min_length=1, max_length=512)]


def _mgr(request: Request) -> JobManager:
    manager: JobManager = request.app.state.manager
    return manager


@router.get("", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
async def page(request: Request) -> Response:
    """The dashboard's one page (it signs in and routes by ``#/...`` itself).

    Behind JupyterHub, a browser that is not signed in goes to the hub to sign in.
    """
    root = root_of(request)
    sessions: UiSessions = request.app.state.ui_sessions
    hub = bool(request.app.state.settings.hub)
    if hub and root and sessions.get(request.cookies.get(COOKIE)) is None:
        return RedirectResponse(f"{root}/ui/hub/login", status_code=302)
    html = (STATIC / "index.html").read_text().replace("/ui/static/", f"{root}/ui/static/")
    marks = f'data-root="{escape(root)}" data-hub="{"1" if hub else ""}"'
    return HTMLResponse(html.replace("<html ", f"<html {marks} ", 1), headers=HEADERS)


@router.get("/static/{name}")
async def asset(name: str) -> Response:
    """The page's script and style (a fixed list: nothing else is served from here)."""
    if name not in ASSETS:
        raise HTTPException(404, "not found")
    return Response((STATIC / name).read_bytes(), media_type=ASSETS[name], headers=HEADERS)


@router.post("/login")
async def login(body: Login, request: Request) -> JSONResponse:
    """Exchange a token for a session cookie; answers who signed in and the CSRF token."""
    if not same_origin(request):
        raise HTTPException(403, "cross-site request refused")
    user = await run_in_threadpool(_mgr(request).users.for_token, body.token)
    if user is None:
        raise HTTPException(401, "unknown token")
    sessions: UiSessions = request.app.state.ui_sessions
    sid, session = sessions.open(body.token, owner=user.name)
    answer = JSONResponse({"user": user.name, "is_admin": user.is_admin, "csrf": session.csrf})
    answer.set_cookie(
        COOKIE, sid, max_age=int(sessions.ttl_s), path=f"{root_of(request)}/ui", httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )  # fmt: skip
    return answer


@router.post("/logout")
async def logout(request: Request, who: PosterDep) -> JSONResponse:
    """End this browser's session."""
    request.app.state.ui_sessions.close(request.cookies.get(COOKIE))
    answer = JSONResponse({"ok": True})
    answer.delete_cookie(COOKIE, path=f"{root_of(request)}/ui")
    return answer


@router.get("/api/me")
async def me(who: ViewerDep) -> dict[str, Any]:
    """Who is signed in, and the CSRF token their POSTs must carry."""
    return {"user": who.user.name, "is_admin": who.user.is_admin, "csrf": who.session.csrf}


@router.get("/api/pool")
def pool(request: Request, who: ViewerDep) -> dict[str, Any]:
    """Every slot with its holder (job or session, user, since), state and GPU figures."""
    manager = _mgr(request)
    _, holders = manager.queue_snapshot()
    by_slot = {s: h for h in holders for s in h.slots}
    probe: GpuProbe = request.app.state.gpu_probe
    stats = probe.read()
    slots = []
    for slot in manager.inventory:
        h = by_slot.get(slot.index)
        gpu = stats.get(slot.index) if slot.kind == SlotKind.gpu else None
        slots.append({
            "index": slot.index, "kind": slot.kind, "name": slot.name,
            "state": "free" if h is None else "draining" if h.stopping else "held",
            "holder": None if h is None else {
                "kind": h.kind, "id": h.id, "user": h.user, "since": h.since,
                "ends_at": h.ends_at, "what": h.what,
                # a job's name is its owner's to see (another user's is not shown, as in
                # the queue)
                "name": h.name if who.user.is_admin or h.user == who.user.name else None,
            },
            "gpu": gpu.model_dump() if gpu is not None else None,
        })  # fmt: skip
    node = {"name": socket.gethostname(), "runtime": "local", "slots": slots}
    parked = [
        {"id": r.job_id, "user": r.user, "name": r.name, "since": r.parked_at,
         "bytes": r.snapshot_bytes}
        for r in request.app.state.sessions.parks.parked_rows()
    ]  # fmt: skip
    return {"nodes": [node], "total": len(slots), "parked": parked, "now": time.time()}


@router.get("/api/queue")
def queue(request: Request, who: ViewerDep) -> Response:
    """The queue in order, each of the viewer's entries with its reason."""
    sessions = request.app.state.sessions
    now = time.time()
    entries = queue_entries(_mgr(request), who.user, now, sessions.idle_seen_by(who.user, now))
    return Response(entries_json(entries), media_type="application/json")


def _row(job: JobRecord) -> dict[str, Any]:
    size = job.elastic.label if job.elastic is not None else None  # now/min..max
    return {
        "id": job.id, "kind": job.kind, "name": job.spec.name, "user": job.user,
        "state": job.state.value, "workers": job.spec.workers, "size": size,
        "gpus_per_worker": job.spec.gpus_per_worker, "priority": job.spec.priority.value,
        "attempt": job.attempt, "reason": job.reason, "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }  # fmt: skip


@router.get("/api/jobs")
def jobs(
    request: Request,
    who: ViewerDep,
    state: JobState | None = None,
    kind: Annotated[str | None, Query(pattern="^(job|session)$")] = None,
    user: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Jobs the viewer may see, newest first, filtered by state, kind and user."""
    owner = user if who.user.is_admin else who.user.name
    found, total = _mgr(request).list_jobs(owner or None, state, 2000 if kind else limit, 0)
    rows = [_row(j) for j in found if kind is None or j.kind == kind][:limit]
    return {"items": rows, "total": total if kind is None else len(rows)}


async def _visible(request: Request, job_id: int, user: User) -> JobRecord:
    if not 1 <= job_id < 2**63:
        raise HTTPException(404, f"job {job_id} not found")
    return await owned_job(job_id, user, _mgr(request))  # the API's one ownership rule


@router.get("/api/jobs/{job_id}")
async def job(job_id: int, request: Request, who: ViewerDep) -> dict[str, Any]:
    """One job or session: spec, transitions, per-rank exit codes, and why it waits."""
    record = await _visible(request, job_id, who.user)
    sessions = request.app.state.sessions
    idle_of = sessions.idle_seen_by(who.user)
    queue = await run_in_threadpool(job_queue, _mgr(request), record, idle_of)
    data = record.model_copy(update={"queue": queue}).model_dump(mode="json")
    if record.kind == JobKind.session:
        view = await run_in_threadpool(sessions.view, record, None, who.user)
        data["session"] = view.model_dump(mode="json", include={"idle_s", "stop_in_s", "warning"})
    data["can_resubmit"] = record.kind == JobKind.job and record.user_id == who.user.id
    data["preflight"] = await run_in_threadpool(job_preflight, _mgr(request), record)
    return data


@router.get("/api/jobs/{job_id}/logs")
async def logs(
    job_id: int,
    request: Request,
    who: ViewerDep,
    rank: Annotated[int, Query(ge=0, le=1 << 20)] = 0,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
) -> dict[str, Any]:
    """One rank's log of the current attempt from ``offset`` (the page polls for more)."""
    record = await _visible(request, job_id, who.user)
    try:
        path, take = rank_log(_mgr(request), record, rank, record.attempt)
    except SpecError as e:
        raise HTTPException(422, str(e)) from None
    data, size = await run_in_threadpool(_read, path, offset)
    over = record.state.terminal
    text, used = take(data, over and offset + len(data) >= size)
    complete = over and offset + used >= size
    return {"text": text, "next": offset + used, "attempt": record.attempt, "complete": complete}


def _read(path: Path, offset: int) -> tuple[bytes, int]:
    return read_chunk(path, offset, LOG_CHUNK), file_size(path)


@router.get("/api/jobs/{job_id}/timeline")
async def timeline(job_id: int, request: Request, who: ViewerDep) -> dict[str, Any]:
    """The job's merged per-rank timeline (``HOROVOD_TIMELINE`` in its env), if it has one."""
    record = await _visible(request, job_id, who.user)
    return await run_in_threadpool(job_timeline, _mgr(request), record)


@router.get("/api/jobs/{job_id}/scaling")
async def scaling(job_id: int, request: Request, who: ViewerDep) -> dict[str, Any] | None:
    """The job's scaling report from its timeline (None: it has none)."""
    record = await _visible(request, job_id, who.user)
    report = await run_in_threadpool(job_scaling, _mgr(request), record)
    return None if report is None else report.model_dump(mode="json")


@router.post("/api/jobs/{job_id}/cancel")
async def cancel(job_id: int, request: Request, who: PosterDep) -> dict[str, Any]:
    """Cancel a job, or stop a session."""
    record = await _visible(request, job_id, who.user)
    why = "stopped by the user" if record.kind == JobKind.session else "cancelled by the user"
    done = await run_in_threadpool(_mgr(request).cancel, record.id, why)
    return _row(done)


@router.post("/api/jobs/{job_id}/resubmit")
async def resubmit(job_id: int, request: Request, who: PosterDep) -> dict[str, Any]:
    """Submit the same spec again as a new job (only its owner may: it runs as them)."""
    record = await _visible(request, job_id, who.user)
    if record.kind != JobKind.job or record.user_id != who.user.id:
        raise HTTPException(403, "only the job's owner can resubmit it")
    spec = record.spec.model_copy(update={"submission_id": None})
    try:
        new = await run_in_threadpool(_mgr(request).submit, who.user.name, spec)
    except SpecError as e:
        raise HTTPException(422, f"{e.field}: {e}") from None
    return _row(new)


@router.get("/api/sessions")
def sessions(request: Request, who: ViewerDep) -> list[dict[str, Any]]:
    """The viewer's sessions (an admin's: everyone's) with idle time and culling countdown."""
    manager, views = _mgr(request), request.app.state.sessions
    found, _ = manager.list_jobs(None if who.user.is_admin else who.user.name, None, 2000, 0)
    keep = [j for j in found if j.kind == JobKind.session][:200]
    return [views.view(j).model_dump(mode="json", exclude={"queue"}) for j in keep]


@router.get("/api/users")
def users(request: Request, who: ViewerDep) -> dict[str, Any]:
    """For admins: every user with their quota and idle timeout, and the service's limits."""
    if not who.user.is_admin:
        raise HTTPException(403, "admins only")
    s = _mgr(request).settings
    rows = [u.model_dump(include={"name", "is_admin", "gpu_quota", "os_uid", "idle_timeout_s"})
            for u in _mgr(request).users.all()]  # fmt: skip
    limits = {
        k: getattr(s, k)
        for k in (
            "user_gpu_quota", "max_running_jobs_per_user", "max_queued_jobs_per_user",
            "session_idle_timeout_s", "session_idle_timeout_max_s", "max_log_streams_per_user",
        )
    }  # fmt: skip
    return {"users": rows, "limits": json.loads(json.dumps(limits, default=str))}
