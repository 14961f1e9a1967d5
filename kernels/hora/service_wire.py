"""The job service's answers outside ``/v1/sessions`` that the client reads (data plane).

:class:`Health` (``GET /healthz``), :class:`JobList` (``GET /v1/jobs``; generic in the job
model: the service lists its ``JobRecord``, a :class:`hora.spec.JobInfo` with the service's
own fields, and the client reads ``JobList[JobInfo]``) and :class:`JobScaling`
(``GET /v1/jobs/{id}/scaling``). The service declares its routes with these classes and the
client parses their answers with them, so each body has one definition (the sessions' bodies
are :mod:`hora.session_wire`'s).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel, Field

from hora.scaling import RankProfile
from hora.spec import JobInfo

Job = TypeVar("Job", bound=JobInfo)


class Health(BaseModel):
    """The answer of ``/healthz``."""

    status: str = Field(description="ok or degraded")
    version: str
    reason: str | None = Field(default=None, description="why it is degraded")


class JobList(BaseModel, Generic[Job]):
    """One page of jobs, newest first."""

    items: list[Job]
    total: int
    limit: int
    offset: int
    next_offset: int | None = Field(
        default=None,
        description="where the next page starts (null after the last); a page may hold "
        "fewer than limit jobs when it reaches the service's max_page_bytes",
    )


class JobScaling(BaseModel):
    """A job's scaling report from its timeline (:mod:`hora.scaling` defines each figure)."""

    timeline: str = Field(description="the merged trace file it was computed from")
    ranks: list[RankProfile]
    slowest: int = Field(description="the rank with the most compute + transfer")
    why: str = Field(description="compute or communication, and by how much")
    efficiency: float = Field(description="the median rank's compute / the slowest wall time")
    preflight_busbw_gbps: float | None = None
    notes: list[str] = []
    rows: list[dict[str, int | str]] = Field(
        description="the table as %%distributed --profile shows it (column -> cell)"
    )
    verdict: str
