"""The bodies of ``/v1/sessions`` and a session's job spec (control plane).

:class:`SessionRequest` (what ``POST /v1/sessions`` carries, with the controller's
:class:`EngineConnection`), :class:`ResumeRequest` (``POST /v1/sessions/{id}/resume``), the
heartbeat's and an engine replacement's bodies, and :func:`session_spec`, the job spec of N
engines that connect to the kernel's controller. :mod:`hora_service.sessions` re-exports them.
"""

from __future__ import annotations

import ipaddress
import sys
from typing import Annotated, Literal

from hora.env import RankEnv
from hora.errors import HoraError, SpecError
from hora.net import is_local_address
from hora.spec import IMAGE_PATTERN, JobSpec, Priority, RuntimeName, SessionInfo
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hora_service.settings import Settings

CONNECTION_VAR = RankEnv.var("engine_connection")
Port = Annotated[int, Field(ge=1, le=65535)]
INLINE_MPL = "module://matplotlib_inline.backend_inline"


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
    why: Annotated[str, Field(max_length=2000)] = ""


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
    listens on an address of this machine (checked by :meth:`SessionManager.create`).

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


def check_controller(settings: Settings, host: str) -> None:
    """A Slurm session's controller runs on this machine or on a node of the cluster.

    On a node: the kernel of a user's server that runs as a Slurm job (batchspawner).

    Raises:
        SpecError: ``host`` is neither (field ``connection.interface``).
    """
    if is_local_address(host):
        return
    from hora_service.runtimes.slurm import SlurmRuntime  # only where Slurm is used

    try:
        nodes = SlurmRuntime.from_settings(settings).node_addresses()
    except (HoraError, OSError):
        nodes = set()
    if host not in nodes:
        raise SpecError(
            "connection.interface",
            f"{host} is not an address of the service's machine or of a Slurm node, "
            "where the kernel's controller must run",
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


# the wire model lives in hora.spec, shared with the kernel; its old name here stays
SessionRecord = SessionInfo


def session_spec(req: SessionRequest, backend: str, python: str = sys.executable) -> JobSpec:
    """The job spec of a session: N engines that connect to the kernel's controller.

    Example:
        >>> session_spec(req, "gloo").command[-1]  # doctest: +SKIP
        'session-engine'
    """
    own = RankEnv(
        engine_connection=req.connection.model_dump_json(),
        backend=req.backend or backend,
        timeout=req.timeout_s,
        start_timeout=req.start_timeout_s,
        engine_world=req.world_file,
    )
    env = {
        **own.to_environ(),
        "OMP_NUM_THREADS": str(req.threads),
        "MPLBACKEND": INLINE_MPL,
    }
    # in a container the image's own python runs the engine (the image must have hora)
    exe = "python" if req.runtime == RuntimeName.docker else python
    return JobSpec(
        name=req.name,
        command=[exe, "-m", "hora.engines._child", "session-engine"],
        workers=req.workers,
        gpus_per_worker=req.gpus_per_worker,
        env=env,
        priority=req.priority,
        runtime=req.runtime,
        image=req.image,
    )
