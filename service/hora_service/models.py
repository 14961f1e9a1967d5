"""Typed records the service stores and answers with (control plane).

:class:`JobRecord` is what ``GET /v1/jobs/{id}`` returns and what the manager hands around;
the spec inside it is the frozen :class:`hora.spec.JobSpec` validated at the edge.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hora.spec import JobSpec, JobState
from pydantic import BaseModel, ConfigDict, Field, field_serializer

# environment values the API never shows: a session's engine connection key would let whoever
# reads it (an admin, a log) run code in the owner's engines
SECRET_ENV = ("HORA_ENGINE_CONNECTION",)
HIDDEN = "(hidden)"


class User(BaseModel):
    """A user of the service; tokens are stored only as SHA-256 hashes.

    Attributes:
        id: stable and never reused: jobs belong to it, so a later user who takes a removed
            user's name does not inherit their jobs.
        name: the login name, unique among current users.
        is_admin: sees and acts on every job.
        gpu_quota: most slots this user's running jobs may hold; None: the default.
        os_uid: the OS account this user's jobs run as (multi-user mode).
        idle_timeout_s: idle timeout of this user's new sessions when a session asks for
            none; None: the service's ``session_idle_timeout_s``.
    """

    model_config = ConfigDict(frozen=True)

    id: int = 0
    name: str
    is_admin: bool = False
    gpu_quota: int | None = None
    os_uid: int | None = None
    idle_timeout_s: float | None = None


class Transition(BaseModel):
    """One state change of a job, with when and why."""

    model_config = ConfigDict(frozen=True)

    state: JobState
    at: datetime
    reason: str | None = None


class JobRecord(BaseModel):
    """A job as stored: its spec, where it is in its lifecycle, and how its ranks ended.

    Attributes:
        id: the job's id (positive, increasing).
        user: who submitted it.
        spec: what was asked.
        state: current state.
        attempt: current attempt (0 before the first start, 1 for the first run).
        reason: a human reason for failure or cancellation.
        exit_codes: rank -> exit code of the current attempt (None while running).
        slots: GPU (or CPU slot) indices held while starting or running.
        created_at: submission time (UTC).
        started_at: when the current attempt started running.
        finished_at: when it reached a terminal state.
        transitions: every state change, oldest first.
        user_id: the stable id of the user who submitted it.
        kind: ``job``, or ``session`` for a notebook's interactive engines (see
            :mod:`hora_service.sessions`).
        container_id: the container of the current attempt (docker runtime), else None.
    """

    model_config = ConfigDict(frozen=True)

    id: int
    user: str
    spec: JobSpec
    state: JobState
    attempt: int = 0
    reason: str | None = None
    exit_codes: dict[int, int | None] = Field(default_factory=dict)
    slots: list[int] = Field(default_factory=list)
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    transitions: list[Transition] = Field(default_factory=list)
    user_id: int | None = None
    container_id: str | None = None
    kind: str = "job"

    @field_serializer("spec")
    def _hide_secrets(self, spec: JobSpec) -> dict[str, Any]:
        data = spec.model_dump(mode="json")
        for name in SECRET_ENV:
            if name in data["env"]:
                data["env"][name] = HIDDEN
        return data


class SlotInfo(BaseModel):
    """One schedulable GPU (or CPU slot) and the job holding it."""

    index: int
    kind: str = Field(description="gpu or cpu")
    name: str
    job_id: int | None = None
    user: str | None = None
    holder_kind: str | None = Field(default=None, description="job or session")


class MetricsSnapshot(BaseModel):
    """Numbers behind ``/metrics`` (rendered by :mod:`hora_service.api.prometheus`)."""

    jobs_by_state: dict[str, int]
    queue_length: int
    slots_total: int
    slots_allocated: int
    schedule_latency_p50_s: float | None = None
    schedule_latency_p99_s: float | None = None
    schedule_latency_sum_s: float = 0.0
    schedule_latency_count: int = 0
    schedule_pass_seconds: float = 0.0
    store_pending_writes: int = Field(
        default=0, description="job state changes waiting for the store to take them"
    )
