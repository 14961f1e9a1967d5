"""The bodies the kernel and the service exchange about a notebook session (data plane).

:class:`SessionRequest` (what ``POST /v1/sessions`` carries, with the controller's
:class:`EngineConnection`), :class:`ResumeRequest` (``POST /v1/sessions/{id}/resume``),
:class:`ParkBegin` and :class:`ParkAbort` (a park's start and its abandon), the
:class:`Heartbeat` and an :class:`EngineReplacement`. The kernel builds and sends them, the
service validates what it receives with the same classes (a bad body: a 422 naming the field).
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hora.errors import SpecError
from hora.spec import IMAGE_PATTERN, Priority, RuntimeName, SessionInfo, error_message

Port = Annotated[int, Field(ge=1, le=65535)]
Body = TypeVar("Body", bound=BaseModel)
ABORT_WHY_MAX = 2000  # the longest reason a park's abort carries


def body(model: type[Body], **fields: Any) -> Body:
    """``model`` made from ``fields``, checked as the service checks what it receives.

    Raises:
        SpecError: a field is invalid; ``field`` names it (as the service's 422 would).

    Example:
        >>> body(Heartbeat, idle_s=-1)
        Traceback (most recent call last):
        ...
        hora.errors.SpecError: idle_s: Input should be greater than or equal to 0
    """
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "request"
        raise SpecError(field, error_message(err)) from None


def wire(model: BaseModel) -> dict[str, Any]:
    """The JSON body of ``model``: the fields it was given (the service fills in the rest).

    Example:
        >>> wire(body(Heartbeat, idle_s=2))
        {'idle_s': 2.0}
    """
    return model.model_dump(mode="json", exclude_unset=True)


class EngineConnection(BaseModel):
    """The controller's engine connection info (``ipcontroller-engine.json``), checked.

    The controller is the kernel's, on this machine: on its loopback (``tcp://127.0.0.1``)
    where the engines run here, or on an address of this machine the Slurm nodes reach for
    a ``slurm`` session (see :func:`check_interface`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    ssh: Literal[""] = ""
    interface: Annotated[str, Field(pattern=r"^tcp://(localhost|[0-9]{1,3}(\.[0-9]{1,3}){3})$")]
    registration: Port
    control: Port
    mux: Port
    task: Port
    iopub: Port
    hb_ping: Port
    hb_pong: Port
    broadcast: Annotated[list[Port], Field(max_length=64)] = Field(default_factory=list)
    key: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,128}$")]
    location: Annotated[str, Field(max_length=253, pattern=r"^[A-Za-z0-9._-]*$")] = ""
    pack: Literal["json", "pickle", "msgpack"] = "json"
    unpack: Literal["json", "pickle", "msgpack"] = "json"
    signature_scheme: Literal["hmac-sha256", "hmac-sha512", "hmac-md5"] = "hmac-sha256"
    # the controller's CurveZMQ public key (Z85: printable ASCII) when curve is on
    curve_serverkey: Annotated[str | None, Field(max_length=64, pattern=r"^[!-~]*$")] = None


class SessionRequest(BaseModel):
    """What ``POST /v1/sessions`` carries: how many engines, and how they reach the kernel.

    Example:
        >>> SessionRequest(workers=2, connection=conn).workers  # doctest: +SKIP
        2
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[
        str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._ -]*$")
    ] = "notebook"
    workers: Annotated[int, Field(ge=1, le=1024)] = 2
    gpus_per_worker: Annotated[int, Field(ge=1, le=16)] = 1
    connection: EngineConnection
    backend: Literal["nccl", "gloo"] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 60.0
    # how long the engines wait for each other at the rendezvous (engines on Slurm nodes
    # start at different times); the kernel's --start-timeout
    start_timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 60.0
    threads: Annotated[int, Field(ge=1, le=256)] = 1
    idle_timeout_s: Annotated[float | None, Field(gt=0, le=30 * 24 * 3600)] = None
    priority: Priority = Priority.normal
    runtime: RuntimeName = RuntimeName.local
    image: Annotated[str | None, Field(max_length=512, pattern=IMAGE_PATTERN)] = None
    # the kernel's file where a world re-formed during a cell meets (engines.world): engines
    # on this machine, as the kernel's user, read it; a path the engines cannot use is ignored
    world_file: Annotated[str | None, Field(max_length=1024, pattern=r"^/[^\x00]*$")] = None

    @model_validator(mode="after")
    def _reachable(self) -> SessionRequest:
        check_interface(self.runtime, self.connection.interface)
        if self.world_file is not None and self.runtime != RuntimeName.local:
            raise ValueError(
                f"world_file: only engines of a local session share the kernel's files, "
                f"not those of a {self.runtime.value} session"
            )
        return self


class ResumeRequest(BaseModel):
    """What ``POST /v1/sessions/{id}/resume`` carries: the new kernel's controller.

    ``workers`` (default: as many as it was parked with) may differ only for elastic state.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    connection: EngineConnection
    workers: Annotated[int | None, Field(ge=1, le=1024)] = None
    world_file: Annotated[str | None, Field(max_length=1024, pattern=r"^/[^\x00]*$")] = None


class ParkBegin(BaseModel):
    """What ``POST /v1/sessions/{id}/park`` carries: the estimated size, and who parks.

    ``cause``: the user asked (``%dist_park``) or the kernel exits (``HORA_PARK_ON_EXIT``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bytes: Annotated[int, Field(ge=0)] = 0
    cause: Literal["user", "exit"] = "user"


class ParkAbort(BaseModel):
    """What ``POST /v1/sessions/{id}/park/abort`` carries: the park given up, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ticket: Annotated[str | None, Field(pattern=r"^[0-9a-f]{16}$")] = None
    why: Annotated[str, Field(max_length=ABORT_WHY_MAX)] = ""


class SessionAddress(BaseModel):
    """Where a kernel's controller listens for the engines of a session on ``runtime``."""

    runtime: RuntimeName
    address: str = Field(description="an address of the service's machine the engines reach")
    source: str = Field(description="how the service chose it")


def host_of(interface: str) -> str:
    """The address of a ``tcp://ADDRESS`` interface."""
    return interface.removeprefix("tcp://")


def check_interface(runtime: RuntimeName, interface: str) -> None:
    """Check that a session's engines can reach the controller at ``interface``, and only there.

    Engines of a ``local`` or ``docker`` session run on this machine: their controller must
    listen on the loopback. Engines of a ``slurm`` session run on other nodes, which cannot
    reach 127.0.0.1 (ipyparallel's default, the engines would wait in vain): their controller
    listens on an address of this machine (the service checks that it is one).

    Raises:
        ValueError: the address does not fit the runtime (the message names the field).

    Example:
        >>> check_interface(RuntimeName.local, "tcp://127.0.0.1")
        >>> check_interface(RuntimeName.slurm, "tcp://10.250.0.1")
    """
    host = host_of(interface)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(f"connection.interface: {host} is not an IPv4 address") from None
    if runtime == RuntimeName.slurm and loopback:
        raise ValueError(
            "connection.interface: engines on Slurm nodes cannot reach a controller on the "
            "loopback; it must listen on an address of this machine the nodes reach "
            "(GET /v1/session-address?runtime=slurm names it)"
        )
    if runtime != RuntimeName.slurm and not loopback:
        raise ValueError(
            f"connection.interface: the engines of a {runtime.value} session run on this "
            "machine and connect to the kernel's controller on 127.0.0.1 only"
        )


class Heartbeat(BaseModel):
    """What the kernel says with each heartbeat: how long its engines have been idle.

    ``idle_s`` is 0 while a cell runs; the service takes that word until the next heartbeat
    (and still counts engines idle whose CPU time does not grow).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    idle_s: Annotated[float, Field(ge=0, le=365 * 24 * 3600)] = 0.0


class EngineReplacement(BaseModel):
    """What ``POST /v1/sessions/{id}/replace`` carries: which dead engine, and where it meets.

    The surviving engines rebuild their process group around a new store on ``master_port``
    (on this machine; the kernel chose it); the new engine of ``rank`` joins them there.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: Annotated[int, Field(ge=0, le=1023)]
    master_port: Annotated[int, Field(ge=1024, le=65535)]


class SessionList(BaseModel):
    """What ``GET /v1/sessions`` answers: the user's sessions, newest first."""

    items: list[SessionInfo]
    total: int
