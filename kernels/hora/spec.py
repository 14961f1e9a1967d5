"""The one typed job description (data plane; shared by CLI, client, magics and service).

REST bodies, ``hora submit`` arguments and the Python client all become a :class:`JobSpec`,
validated once at the edge; later stages (scheduler, runtimes) receive this frozen object.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hora.kinds import JobKind as JobKind
from hora.kinds import RuntimeName as RuntimeName
from hora.kinds import SlotKind as SlotKind

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ARGV = 1024
MAX_ARG_LEN = 16384
NAME_MAX = 255  # bytes in one path component (Linux)


def error_message(err: Any) -> str:
    """What one of pydantic's validation errors says, without its prefix ``Value error,``.

    A validator's own sentence is the whole message (the field is named beside it).

    Example:
        >>> error_message({"type": "value_error", "msg": "Value error, got 2",
        ...                "ctx": {"error": ValueError("got 2")}})
        'got 2'
        >>> error_message({"type": "missing", "msg": "Field required"})
        'Field required'
    """
    cause = (err.get("ctx") or {}).get("error") if err.get("type") == "value_error" else None
    return str(cause) if isinstance(cause, ValueError) else str(err.get("msg", ""))


def _utf8(value: str, what: str) -> str:
    r"""``value`` if it is text a process can receive: encodable UTF-8 without NUL bytes.

    Example:
        >>> _utf8("\ud800", "command[0]")
        Traceback (most recent call last):
        ...
        ValueError: command[0] is not valid UTF-8 text (a lone surrogate)
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 text (a lone surrogate)") from None
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL byte")
    return value


class Priority(StrEnum):
    """Queue priority; higher runs first, FIFO within a priority."""

    low = "low"
    normal = "normal"
    high = "high"


PRIORITY_RANK = {Priority.low: 0, Priority.normal: 1, Priority.high: 2}


# what an image reference may contain (Docker's grammar is checked by the service); the schema
# says so too, so a NUL or a space is refused by the schema and the service alike
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"


class ElasticSpec(BaseModel):
    """An elastic job's size: it runs with between ``min_workers`` and ``max_workers`` workers.

    The service starts it with what is free in that range (at least ``min_workers`` at once),
    replaces a worker that dies while the others keep their processes, and grows it when
    slots free up; the training script uses ``hora.torch.elastic`` (see docs/elastic.md).

    Example:
        >>> ElasticSpec(min_workers=2, max_workers=4).max_workers
        4
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_workers: Annotated[int, Field(ge=1, le=1024)]
    max_workers: Annotated[int, Field(ge=1, le=1024)]

    @field_validator("max_workers")
    @classmethod
    def _not_below_min(cls, v: int, info: ValidationInfo) -> int:
        low = info.data.get("min_workers")
        if low is not None and v < low:
            raise ValueError(f"must be at least min_workers ({low}), got {v}")
        return v


class JobSpec(BaseModel):
    """What a user asks to run: ``workers`` processes of ``command``, each with its GPUs.

    Example:
        >>> JobSpec(command=["python", "train.py"], workers=2).total_gpus
        2
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[
        str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._ -]*$")
    ] = "job"
    command: Annotated[
        list[str],
        Field(
            min_length=1,
            max_length=MAX_ARGV,
            # the program may not be empty (later arguments may): say so in the schema too
            json_schema_extra={"prefixItems": [{"type": "string", "minLength": 1}]},
        ),
    ]
    # before workers, which is checked against it: an elastic job's workers is its minimum
    elastic: ElasticSpec | None = None
    workers: Annotated[int, Field(ge=1, le=1024)] = 1
    gpus_per_worker: Annotated[int, Field(ge=1, le=16)] = 1
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: Annotated[str | None, Field(max_length=4096)] = None
    submit_dir: Annotated[
        str | None,
        Field(
            max_length=4096,
            description="the absolute directory the job was submitted from (as sbatch's "
            "SLURM_SUBMIT_DIR; hora submit and the client fill it in): the ranks' working "
            "directory when working_dir is not given and it lies under the work root",
        ),
    ] = None
    priority: Priority = Priority.normal
    max_retries: Annotated[int, Field(ge=0, le=100)] = 0
    timeout_s: Annotated[float | None, Field(gt=0, le=30 * 24 * 3600, allow_inf_nan=False)] = None
    runtime: RuntimeName = RuntimeName.local
    image: Annotated[str | None, Field(max_length=512, pattern=IMAGE_PATTERN)] = None
    submission_id: Annotated[
        str | None, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _elastic_workers(cls, data: Any) -> Any:
        # an elastic job needs min_workers to start: that is its workers (its gang)
        if isinstance(data, dict) and data.get("elastic") is not None and "workers" not in data:
            elastic = data["elastic"]
            low = elastic.get("min_workers") if isinstance(elastic, dict) else None
            low = elastic.min_workers if isinstance(elastic, ElasticSpec) else low
            if isinstance(low, int) and not isinstance(low, bool):
                data = {**data, "workers": low}
        return data

    @model_validator(mode="before")
    @classmethod
    def _image_means_docker(cls, data: Any) -> Any:
        # an image given without a runtime means the docker runtime, whatever the entry point
        # (CLI, client, REST, magics); an image with another runtime is refused at admission
        if isinstance(data, dict) and data.get("image") is not None and "runtime" not in data:
            data = {**data, "runtime": RuntimeName.docker}
        return data

    @field_validator("workers")
    @classmethod
    def _workers_of_elastic(cls, v: int, info: ValidationInfo) -> int:
        elastic = info.data.get("elastic")
        if elastic is not None and v != elastic.min_workers:
            raise ValueError(
                f"an elastic job's size is its elastic range ({elastic.min_workers}.."
                f"{elastic.max_workers}); leave workers out, or set it to elastic.min_workers "
                f"(got {v})"
            )
        return v

    @field_validator("command")
    @classmethod
    def _check_command(cls, v: list[str]) -> list[str]:
        if not v[0]:
            raise ValueError("the first element (the program) must not be empty")
        for i, arg in enumerate(v):
            if len(arg) > MAX_ARG_LEN:
                raise ValueError(f"argument {i} is longer than {MAX_ARG_LEN} characters")
            _utf8(arg, f"argument {i}")
        return v

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError("at most 256 environment variables")
        for k, val in v.items():
            if not ENV_NAME.match(k):
                shown = k.encode("utf-8", "backslashreplace").decode()
                raise ValueError(f"{shown!r} is not a valid environment variable name")
            if len(val) > MAX_ARG_LEN:
                raise ValueError(f"value of {k} is longer than {MAX_ARG_LEN} characters")
            _utf8(val, f"value of {k}")
        return v

    @field_validator("working_dir", "submit_dir")
    @classmethod
    def _check_dir(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        _utf8(v, str(info.field_name))
        if any(len(part.encode()) > NAME_MAX for part in v.split("/")):
            raise ValueError(f"a component of {info.field_name} is longer than {NAME_MAX} bytes")
        if info.field_name == "submit_dir" and not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v

    @property
    def total_gpus(self) -> int:
        """GPUs (or CPU slots) the job needs at once: ``workers * gpus_per_worker``."""
        return self.workers * self.gpus_per_worker


class JobState(StrEnum):
    """Lifecycle of a job: queued -> starting -> running -> succeeded | failed | cancelled.

    ``retrying`` sits between a failed attempt and the next one. ``parked`` is a session's
    only: its engines' state is on disk, it holds no slots, and resuming queues it again.
    """

    queued = "queued"
    starting = "starting"
    running = "running"
    retrying = "retrying"
    parked = "parked"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for succeeded, failed and cancelled."""
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class Transition(BaseModel):
    """One state change of a job, with when and why (service and client)."""

    model_config = ConfigDict(frozen=True)

    state: JobState
    at: datetime
    reason: str | None = None


class MembershipChange(BaseModel):
    """One change of an elastic job's membership: when, the size after it, and why."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    at: datetime
    size: int = Field(description="workers in the world after the change")
    reason: str
    generation: int | None = Field(
        default=None, description="the world's generation (None: a change of slots only)"
    )
    slots: int | None = Field(default=None, description="slots the job held after the change")


class ElasticMember(BaseModel):
    """One worker of an elastic job's current world."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker: str = Field(description="the worker id (w0, w1, ...; never reused)")
    rank: int
    pid: int


class ElasticInfo(BaseModel):
    """An elastic job's size now and how its membership changed (``GET /v1/jobs/{id}``).

    Example:
        >>> ElasticInfo(min_workers=2, max_workers=4, size=3).label
        '3/2..4'
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    min_workers: int
    max_workers: int
    size: int = Field(default=0, description="workers in the current world (0 before one)")
    slots: int = Field(default=0, description="slots the job holds now")
    generation: int = 0
    members: list[ElasticMember] = Field(default_factory=list)
    history: list[MembershipChange] = Field(default_factory=list)

    @property
    def label(self) -> str:
        """``size/min..max``, as ``hora jobs`` shows it."""
        return f"{self.size}/{self.min_workers}..{self.max_workers}"


class SlotInfo(BaseModel):
    """One schedulable GPU (or CPU slot) and the job holding it (``GET /v1/gpus``).

    A parked session holds no slot; ``GET /v1/gpus`` lists each after the slots, with
    ``kind`` ``parked``, no ``index``, since when and its snapshot's size.
    """

    index: int | None
    kind: SlotKind = Field(description="gpu or cpu (parked: a parked session, holding none)")
    name: str
    job_id: int | None = None
    user: str | None = None
    holder_kind: str | None = Field(
        default=None,
        description="job or session; service or kernel: held outside this service (holder)",
    )
    holder: str | None = Field(
        default=None,
        description="who holds it outside this service (another hora service, a notebook's "
        "kernel-local engines), as the machine's lease says",
    )
    node: str | None = Field(default=None, description="the Slurm node of a cluster GPU")
    slurm_job: str | None = Field(default=None, description="the Slurm job holding it")
    parked_at: datetime | None = Field(default=None, description="a parked session's: since")
    snapshot_bytes: int | None = Field(default=None, description="a parked session's snapshot")


class HolderInfo(BaseModel):
    """A job or session holding slots, as a queued session is shown it (service and kernel)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    id: int
    user: str
    slots: list[int]
    since: datetime
    idle_s: float | None = None
    ends_at: datetime | None = None
    what: str | None = Field(
        default=None,
        description="a holder outside this service (kind service or kernel, id its pid), "
        "in words",
    )


class QueueInfo(BaseModel):
    """Where a queued session stands: its place, the holders, an estimate where one exists."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    position: int
    need: int
    free: int
    holders: list[HolderInfo]
    estimate_at: datetime | None = None
    reason: str
    why: WaitReason | None = None


class ReasonKind(StrEnum):
    """Why a queued job or session waits (the ``kind`` of a :class:`WaitReason`).

    A client must accept kinds it does not know (a newer service or runtime may add some):
    :class:`WaitReason` keeps ``kind`` a plain string and always carries ``text``.
    """

    slots = "slots"  # not enough free slots now (asked, free, total, holders, estimate)
    quota = "quota"  # the user's own jobs and sessions hold their GPU quota
    running_limit = "running_limit"  # the user runs max_running_jobs_per_user already
    priority = "priority"  # it would fit, but a job ahead of it holds a reservation
    gang = "gang"  # more slots than any node has (refused at submission on one machine)
    image = "image"  # its container image is being pulled
    backoff = "backoff"  # a failed attempt; the next one starts at retry_at
    runtime = "runtime"  # the runtime's own pending reason (e.g. Slurm's squeue %r)


class WaitReason(BaseModel):
    """A structured reason for a wait: ``kind``, the figures behind it, and ``text`` for people.

    Example:
        >>> WaitReason(kind="slots", text="waiting for 2 slot(s); 1 of 4 free", asked=2).asked
        2
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    text: str
    asked: int | None = None
    free: int | None = None
    total: int | None = None
    holders: list[HolderInfo] = Field(default_factory=list)
    estimate_at: datetime | None = None
    limit: int | None = None
    used: int | None = None
    ahead: int | None = Field(default=None, description="the job ahead that holds a reservation")
    ahead_priority: str | None = None
    retry_at: datetime | None = None
    image: str | None = None
    source: str | None = Field(default=None, description="who gave the reason: e.g. slurm")
    detail: str | None = Field(default=None, description="the source's own words")


class QueueEntry(BaseModel):
    """One queued job or session in the queue view (``GET /v1/queue``), in queue order.

    Another user's entry shows no name, id or reason to a non-admin: only that it is there.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    position: int
    id: int | None = None
    kind: JobKind = JobKind.job
    user: str | None = None
    name: str | None = None
    need: int
    priority: str
    queued_at: datetime | None = None
    reason: WaitReason | None = None


QueueInfo.model_rebuild()


class ParkedRank(BaseModel):
    """One rank's part of a parked session's snapshot: its file, size, checksum and names."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank: Annotated[int, Field(ge=0, le=1023)]
    bytes: Annotated[int, Field(ge=0)]
    crc32: Annotated[int, Field(ge=0, le=2**32 - 1)]
    names: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list)
    dropped: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, description="names left out, each with its type"
    )


class ParkInfo(BaseModel):
    """A session's snapshot: where, how big, since when and why it was parked.

    ``phase`` is ``parking`` (written, the engines are being stopped), ``parked`` (the
    session holds no slots) or ``resuming`` (asked for slots again; the snapshot is kept
    until the kernel restored it).

    Example:
        >>> ParkInfo(phase="parked", parked_at=datetime(2026, 1, 1), reason="idle", bytes=1,
        ...          world=2, directory="/w/.hora-parked/session-3-ab").world
        2
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    phase: str
    parked_at: datetime
    reason: str
    bytes: int = Field(description="the snapshot's size on disk, as the service measured it")
    world: int = Field(description="the number of engines it was parked with")
    elastic: bool = Field(default=False, description="the state can resume at another size")
    directory: str
    ranks: list[ParkedRank] = Field(default_factory=list)
    expires_at: datetime | None = None


class ParkTicket(BaseModel):
    """The service's answer to a park's start: where the ranks write, and the room left."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ticket: str
    directory: str
    quota_bytes: int | None = None
    used_bytes: int = 0


class ParkCommit(BaseModel):
    """What the kernel sends once every rank wrote its part (``POST .../park/commit``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ticket: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    ranks: Annotated[list[ParkedRank], Field(min_length=1, max_length=1024)]
    elastic: bool = False


class JobInfo(BaseModel):
    """A job as the service reports it: the one wire model of a job, for client and service.

    The client reads ``GET /v1/jobs`` answers into it (fields it does not know are kept);
    the service's stored record, ``hora_service.models.JobRecord``, extends it with its own
    fields (``user_id``, ``container_id``) and hides secrets when it answers.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    id: int
    user: str
    spec: JobSpec
    state: JobState
    attempt: int = 0
    reason: str | None = None
    exit_codes: dict[int, int | None] = {}
    slots: list[int] = []
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    transitions: list[Transition] = []
    kind: JobKind = JobKind.job  # or session: a notebook's engines, scheduled with the jobs
    queue: QueueInfo | None = None  # while it waits: its place and structured reason
    elastic: ElasticInfo | None = None  # an elastic job's size and membership history
    park: ParkInfo | None = None  # a session's snapshot while it is parked (or resuming)

    @field_validator("exit_codes", mode="before")
    @classmethod
    def _codes_by_rank(cls, v: Any) -> Any:
        # accept a list indexed by rank as well as a {rank: code} mapping
        return dict(enumerate(v)) if isinstance(v, list) else v

    @property
    def name(self) -> str:
        """The job's name from its spec."""
        return self.spec.name


class SessionInfo(BaseModel):
    """A session as ``/v1/sessions`` answers it: the one wire model, for service and kernel.

    A session is a notebook's engines, scheduled as a job of kind ``session``; its states
    are a job's, so :attr:`ended` is :attr:`JobState.terminal`.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int
    user: str
    name: str
    state: JobState
    workers: int
    slots: list[int]
    reason: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    lease_s: float
    idle_timeout_s: float | None = None
    idle_s: float | None = None
    stop_in_s: float | None = Field(None, description="seconds left before the idle timeout")
    warning: str | None = None
    queue: QueueInfo | None = None
    preflight: dict[str, Any] | None = Field(
        default=None, description="what %dist_start's preflight measured (GET /v1/sessions/ID)"
    )
    park: ParkInfo | None = None
    park_requested: str | None = Field(
        default=None, description="why the service asks the kernel to park the session now"
    )

    @property
    def ended(self) -> bool:
        """The session is over (its engines are gone or going)."""
        return self.state.terminal
