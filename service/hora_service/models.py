"""Typed records the service stores and answers with (control plane).

:class:`JobRecord` is what ``GET /v1/jobs/{id}`` returns and what the manager hands around;
the spec inside it is the frozen :class:`hora.spec.JobSpec` validated at the edge.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hora.env import RankEnv
from hora.spec import JobInfo, JobSpec, SlotInfo, Transition
from pydantic import BaseModel, ConfigDict, Field, field_serializer

# environment values the API never shows: a session's engine connection key would let whoever
# reads it (an admin, a log) run code in the owner's engines
SECRET_ENV = (RankEnv.var("engine_connection"),)
HIDDEN = "(hidden)"

# the wire models the client shares live in hora.spec; importable here as before
__all__ = ["HIDDEN", "SECRET_ENV", "JobRecord", "MetricsSnapshot", "SlotInfo", "Transition", "User"]


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
        limits: their own job limits by kind (``memory``, ``pids``, ``cpus``), as written;
            a kind not there: the service's setting (:mod:`hora_service.runtimes.limits`).
    """

    model_config = ConfigDict(frozen=True)

    id: int = 0
    name: str
    is_admin: bool = False
    gpu_quota: int | None = None
    os_uid: int | None = None
    idle_timeout_s: float | None = None
    limits: dict[str, str] = Field(default_factory=dict)


class JobRecord(JobInfo):
    """A job as stored: its spec, where it is in its lifecycle, and how its ranks ended.

    The wire model :class:`hora.spec.JobInfo` (what the client reads) with the service's
    own fields; ``created_at`` is always set here.

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
            :mod:`hora_service.sessions.session_manager`).
        container_id: the container of the current attempt (docker runtime), else None.
        queue: while it waits (queued, retrying, or held back while starting), its place
            and structured reason; only ``GET /v1/jobs/{id}`` fills it (``GET /v1/queue``
            lists them all).
        preflight: the communication preflight rank 0 logged at ``hora.torch.init()``
            (a session's: at ``%dist_start``; :mod:`hora_service.jobs.preflight`); only
            ``GET /v1/jobs/{id}`` fills it.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    created_at: datetime
    user_id: int | None = None
    container_id: str | None = None
    preflight: dict[str, Any] | None = None

    @field_serializer("spec")
    def _hide_secrets(self, spec: JobSpec) -> dict[str, Any]:
        data = spec.model_dump(mode="json")
        for name in SECRET_ENV:
            if name in data["env"]:
                data["env"][name] = HIDDEN
        return data


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
    slot_kind: str = "gpu"
    queue_wait: list[tuple[str, str, float, int]] = Field(
        default_factory=list,
        description="(user, priority, seconds, count): queue waits of first attempts",
    )
    slot_hours: dict[str, float] = Field(
        default_factory=dict, description="user -> slot-hours held (GPU-hours on GPUs)"
    )
    waiting: list[tuple[str, str, str, int]] = Field(
        default_factory=list,
        description="(state, kind, reason kind, count) of waiting jobs and sessions",
    )
    waiting_longest_s: list[tuple[str, str, float]] = Field(
        default_factory=list, description="(user, priority, seconds) of the longest wait now"
    )
    preflight_bandwidth_gbps: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="node -> collective path -> GB/s of the last preflight (filled by preflight)",
    )
