"""Routes under ``/v1/jobs``: submit, list, get, scaling, cancel, delete (control plane).

Every route takes the user from :data:`CurrentUser`; routes on one job take it from
:data:`OwnedJob`, the single ownership check. Routes that write (submit, cancel, delete) are
plain ``def`` functions that FastAPI runs in its thread pool; the two read routes are
``async`` and run their SQLite reads in the thread pool too, so that a blocked store never
blocks the event loop.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from hora import service_wire
from hora.errors import HoraError, SpecError
from hora.service_wire import JobScaling
from hora.spec import JobSpec, JobState
from starlette.concurrency import run_in_threadpool

from hora_service.api.deps import CurrentUser, ManagerDep, OwnedJob
from hora_service.api.errors import AUTH_RESPONSES, JOB_RESPONSES, unprocessable
from hora_service.jobs.preflight_book import job_preflight
from hora_service.models import JobRecord
from hora_service.observability.jobtrace import job_scaling
from hora_service.observability.queueview import job_queue
from hora_service.store.db import StoreUnavailable

MAX_PAGE = 500
MAX_OFFSET = 10**9

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class JobList(service_wire.JobList[JobRecord]):
    """One page of jobs, newest first.

    :class:`hora.service_wire.JobList` of the service's records, named so that the API's
    schema calls it ``JobList`` as before (a parametrized model's name would be
    ``JobList_JobRecord_``).
    """


@router.post(
    "",
    status_code=201,
    response_model=JobRecord,
    summary="Submit a job",
    responses={
        **AUTH_RESPONSES,
        200: {"model": JobRecord, "description": "submission_id matched an existing job"},
        400: {"description": "The body could not be read (not UTF-8)"},
        413: {"description": "Request body or job spec too large"},
        429: {"description": "Too many of your jobs wait in the queue already"},
        503: {"description": "The job store cannot take the job now; retry after Retry-After"},
    },
)
def submit_job(
    spec: JobSpec, user: CurrentUser, manager: ManagerDep, response: Response
) -> JobRecord:
    """Queue a job of ``workers`` processes with ``gpus_per_worker`` GPUs each.

    Answers 201 with the new job. With a ``submission_id`` that this user already used, no
    new job is created: the answer is the existing job with 200. A spec that can never run
    here (more GPUs than the cluster has, an unavailable runtime, a bad ``working_dir``) is a
    422 naming the field.
    """
    try:
        job, created = manager.submit_or_find(user.name, spec, account=user)
    except SpecError as e:
        raise unprocessable(e) from None
    if not created:
        response.status_code = 200
    return job


@router.get("", response_model=JobList, summary="List jobs", responses=AUTH_RESPONSES)
async def list_jobs(
    user: CurrentUser,
    manager: ManagerDep,
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Response:
    """Your jobs (an admin sees everyone's), newest first, one page at a time."""
    owner = None if user.is_admin else user.name
    body = await run_in_threadpool(manager.list_json, owner, state, limit, offset)
    # each job's JSON is cached by the manager; the page is joined, not re-validated
    return Response(body, media_type="application/json")


@router.get("/{job_id}", response_model=JobRecord, summary="Get a job", responses=JOB_RESPONSES)
async def get_job(job: OwnedJob, manager: ManagerDep) -> JobRecord:
    """State, attempt, per-rank exit codes, reason and transition times of one job.

    While it waits, ``queue`` says where it stands and why (a structured reason).
    """
    queue = await run_in_threadpool(job_queue, manager, job)
    figures = await run_in_threadpool(job_preflight, manager, job)
    if queue is None and figures is None:
        return job
    return job.model_copy(update={"queue": queue, "preflight": figures})


@router.get(
    "/{job_id}/scaling",
    response_model=JobScaling,
    summary="A job's scaling report, from its timeline",
    responses={
        **JOB_RESPONSES,
        404: {"description": "No such job, or it has no timeline"},
        409: {"description": "The timeline is not a file the job's account wrote and may read"},
    },
)
async def get_scaling(job: OwnedJob, manager: ManagerDep) -> JobScaling:
    """The job's scaling report, as ``%%distributed --profile`` reports a cell.

    Per rank: wall time, time in collectives and waiting, bytes reduced, bandwidth against
    the preflight's; then the slowest rank and why, and an estimated scaling efficiency.
    Computed as ``%%distributed --profile`` computes a cell's, from the job's merged per-rank
    timeline: the job must set ``HOROVOD_TIMELINE`` (a path under its working directory) in
    its ``env``. While it runs, the report covers what its ranks recorded so far. The files
    are read as the job's account's: a symlink, FIFO, device, another account's file or one
    larger than the service reads is a 409 naming the file.
    """
    report = await run_in_threadpool(job_scaling, manager, job)
    if report is None:
        raise HTTPException(
            404, f"job {job.id} has no timeline with collectives (set HOROVOD_TIMELINE in its env)"
        )
    return report


@router.post(
    "/{job_id}/cancel", response_model=JobRecord, summary="Cancel a job", responses=JOB_RESPONSES
)
def cancel_job(job: OwnedJob, manager: ManagerDep) -> JobRecord:
    """Cancel a job: queued jobs leave the queue, running ones get SIGTERM then SIGKILL.

    Cancelling a finished job changes nothing and returns it as it is.
    """
    return manager.cancel(job.id)


@router.delete(
    "/{job_id}",
    status_code=204,
    summary="Delete a finished job",
    responses={**JOB_RESPONSES, 409: {"description": "The job has not finished"}},
)
def delete_job(job: OwnedJob, manager: ManagerDep) -> Response:
    """Remove a succeeded, failed or cancelled job and its logs (409 while it is active)."""
    if not job.state.terminal:
        raise HTTPException(409, f"job {job.id} is {job.state.value}; cancel it first")
    try:
        manager.delete(job.id)
    except StoreUnavailable:
        raise  # a 503 with Retry-After (the app's handler), not a 409
    except HoraError as e:
        raise HTTPException(409, str(e)) from None
    return Response(status_code=204)

