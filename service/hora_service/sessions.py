"""Sessions: a notebook's interactive engines, scheduled and started like jobs (control plane).

A session is a gang of N slots for ipyparallel engines that connect to the notebook kernel's
controller. It is stored and scheduled as a job of kind ``session`` (same queue, priority,
per-user quota, backfill; a slot is never in two holders) and started by the same runtimes,
as the owner's OS account, in the same containment and with the same rank environment and GPU
binding as a job's ranks. Each rank runs ``python -m hora.engines._child session-engine``,
which reads the controller's engine connection info (validated here as
:class:`EngineConnection`) from its environment; nothing passes through a shell.

What a job lacks is a **lease**: the kernel heartbeats its session (``POST
/v1/sessions/{id}/heartbeat``, also while queued); a session whose kernel has not been heard
for ``lease_s`` is withdrawn (queued) or stopped (running), so a kernel killed with -9 frees
its slots within the lease. And an **idle timeout**: with each heartbeat the kernel says how
long its engines have been idle, and the service watches the engines' CPU time itself (a
session counts as idle from the earlier of the kernel's word and the last time its engines
computed, so a kernel that always reports zero keeps nothing); the answer carries a warning
``idle_warn_s`` before the timeout, and at the timeout the engines are stopped and the slots
freed. The reason is kept
on the session, for the notebook's next ``%%distributed`` cell to show. The timeout is the
session's own ``idle_timeout_s``, else its user's (``hora user set NAME --idle-timeout S``),
else the service's ``session_idle_timeout_s``, never more than ``session_idle_timeout_max_s``
(see :func:`effective_idle_timeout`).

:class:`SessionManager` keeps the heartbeat times in memory (a restarted service gives every
session a fresh lease) and checks them at the end of every monitor pass of the job manager.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Literal

from hora.env import RankEnv
from hora.errors import HoraError, SpecError
from hora.spec import (
    IMAGE_PATTERN,
    JobSpec,
    JobState,
    Priority,
    RuntimeName,
    SessionInfo,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Connection

from hora_service.manager import JobManager
from hora_service.models import JobRecord, User
from hora_service.queueview import IdleOf, job_queue
from hora_service.settings import Settings
from hora_service.store import Store
from hora_service.users import check_idle_timeout

if TYPE_CHECKING:
    from hora_service.noderoute import NodeRoute

log = logging.getLogger(__name__)

CONNECTION_VAR = RankEnv.var("engine_connection")
Port = Annotated[int, Field(ge=1, le=65535)]
INLINE_MPL = "module://matplotlib_inline.backend_inline"
BUSY_SAMPLE_S = 2.0  # how often the engines' CPU time is read


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


class SessionAddress(BaseModel):
    """Where a kernel's controller listens for the engines of a session on ``runtime``."""

    runtime: RuntimeName
    address: str = Field(description="an address of the service's machine the engines reach")
    source: str = Field(description="how the service chose it")


def _host(interface: str) -> str:
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
    host = _host(interface)
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


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (binding it succeeds).

    Example:
        >>> is_local_address("127.0.0.1"), is_local_address("198.51.100.7")
        (True, False)
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


class Heartbeat(BaseModel):
    """What the kernel says with each heartbeat: how long its engines have been idle."""

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


@dataclass
class Lease:
    """A session's heartbeat clock (in memory; a restarted service starts it afresh).

    ``active`` is when the kernel says its engines last ran something; ``busy`` when the
    service last saw them compute (their CPU time grew, see :meth:`SessionManager.check`).
    The idle time is counted from the earlier of the two, so a kernel that always says
    "not idle" keeps nothing: only engines that compute do.
    """

    lease_s: float
    idle_timeout_s: float | None
    heard: float
    active: float
    ended: str | None = None
    busy: float = -1.0
    cpu: float | None = None  # the engines' CPU seconds at ``cpu_at``
    cpu_at: float = 0.0

    def __post_init__(self) -> None:
        if self.busy < 0:
            self.busy = self.heard

    def idle_since(self) -> float:
        """When the engines were last active, by the kernel's word and the service's eye."""
        return min(self.active, self.busy)


def effective_idle_timeout(
    requested: float | None, user_s: float | None, default_s: float | None, max_s: float | None
) -> float | None:
    """The idle timeout a new session gets: its own, else its user's, else the default.

    Whichever applies is capped by the admin's ``max_s``; with a maximum set no session idles
    forever (no timeout at all becomes ``max_s``). A session that asks for more than ``max_s``
    is refused rather than silently cut short.

    Args:
        requested: the session request's ``idle_timeout_s`` (None: not given).
        user_s: the user's idle timeout (None: none set).
        default_s: the service's ``session_idle_timeout_s`` (None: no idle timeout).
        max_s: the service's ``session_idle_timeout_max_s`` (None: no maximum).

    Returns:
        Seconds, or None for no idle timeout.

    Raises:
        SpecError: ``requested`` is not positive and finite, or passes ``max_s`` (field
            ``idle_timeout_s``).

    Example:
        >>> effective_idle_timeout(None, 900.0, 3600.0, None)  # the user's
        900.0
        >>> effective_idle_timeout(None, 900.0, 3600.0, 600.0)  # capped by the admin
        600.0
    """
    requested = check_idle_timeout("idle_timeout_s", requested)
    if requested is not None and max_s is not None and requested > max_s:
        raise SpecError("idle_timeout_s", f"at most {max_s:g}s on this service")
    chosen = next((t for t in (requested, user_s, default_s) if t is not None), None)
    if max_s is not None:
        chosen = max_s if chosen is None else min(chosen, max_s)
    return chosen


def fmt_s(seconds: float) -> str:
    """A duration for people.

    Example:
        >>> fmt_s(42), fmt_s(300), fmt_s(5400)
        ('42s', '5 min', '1.5 h')
    """
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SessionManager:
    """Creates sessions, keeps their leases, withdraws dead and idle ones (module docstring).

    Args:
        manager: the job manager that stores, schedules and starts sessions as jobs.
        settings: lease, idle timeout and warning lead from the service settings.
    """

    def __init__(self, manager: JobManager, settings: Settings) -> None:
        self.manager = manager
        self.settings = settings
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._loaded = False
        self._route: NodeRoute | None = None
        manager.hooks.append(self.check)

    def _node_route(self) -> NodeRoute:
        with self._lock:
            if self._route is None:
                from hora_service.noderoute import NodeRoute  # only where Slurm is used
                from hora_service.runtimes.slurm import SlurmRuntime

                slurm = SlurmRuntime.from_settings(self.settings)
                self._route = NodeRoute(slurm.address_towards_nodes)
            return self._route

    def _load(self) -> None:
        if self._loaded:
            return
        now = time.time()
        for job_id, (lease, idle) in self.manager.open_store().session_terms().items():
            self._leases.setdefault(job_id, Lease(lease, idle, now, now))
        self._loaded = True

    def create(self, user: str, req: SessionRequest) -> SessionInfo:
        """Queue a session for ``user``.

        Raises:
            SpecError: it can never run here (too many slots, over the quota, no such
                runtime, an image without docker; the field is named), or its idle timeout
                passes the service's ``session_idle_timeout_max_s``.
        """
        s = self.settings
        host = _host(req.connection.interface)
        if req.runtime == RuntimeName.slurm and not is_local_address(host):
            raise SpecError(
                "connection.interface",
                f"{host} is not an address of the service's machine, where the kernel's "
                "controller must run",
            )
        owner = self.manager.open_store().user_by_name(user)
        idle = effective_idle_timeout(
            req.idle_timeout_s,
            owner.idle_timeout_s if owner is not None else None,
            s.session_idle_timeout_s,
            s.session_idle_timeout_max_s,
        )
        backend = "nccl" if self.manager.inventory[0].kind == "gpu" else "gloo"
        spec = session_spec(req, backend, str(s.session_python or sys.executable))
        lease = s.session_lease_s

        def terms(store: Store, conn: Connection, job_id: int) -> None:
            store.add_session(conn, job_id, lease, idle)

        record, _ = self.manager.submit_or_find(user, spec, kind="session", also=terms)
        now = time.time()
        with self._lock:
            self._load()
            self._leases[record.id] = Lease(lease, idle, now, now)
        log.info("session %d of %s: %d engine(s) queued", record.id, user, req.workers)
        return self.view(record)

    def address(self, runtime: RuntimeName) -> SessionAddress:
        """Where a kernel's controller must listen for the engines of a ``runtime`` session.

        The loopback, except on Slurm: the admin's ``slurm_session_address``, else the
        address this machine reaches the first Slurm node from.

        Slurm is asked at most once a while (:mod:`hora_service.noderoute`).

        Raises:
            SpecError: Slurm's nodes cannot be asked or reached (field ``runtime``).
        """
        if runtime != RuntimeName.slurm:
            return SessionAddress(runtime=runtime, address="127.0.0.1", source="loopback")
        if self.settings.slurm_session_address is not None:
            configured = self.settings.slurm_session_address
            return SessionAddress(runtime=runtime, address=configured, source="the admin's")
        node, address = self._node_route().get()
        return SessionAddress(runtime=runtime, address=address, source=f"the route to {node}")

    def heartbeat(self, job: JobRecord, beat: Heartbeat) -> SessionInfo:
        """Renew the lease and note the engines' idle time; answer with the session."""
        now = time.time()
        with self._lock:
            self._load()
            lease = self._leases.get(job.id)
            if lease is not None and not job.state.terminal:
                lease.heard = now
                # the kernel knows when its engines last ran a cell (a kernel that wants to
                # keep its slots can always say 0: the idle timeout is a courtesy, the lease
                # is what frees a dead kernel's slots)
                lease.active = now - beat.idle_s
        return self.view(self.manager.get(job.id) or job)

    def delete(self, job: JobRecord) -> SessionInfo:
        """Withdraw a queued session or stop a running one, and delete it.

        The answer is the session as it stood; from then on it is a 404 and in no list (its
        engines stop, then its record and logs are removed).
        """
        reason = "withdrawn by the user" if job.state == JobState.queued else "stopped by the user"
        with self._lock:
            self._leases.pop(job.id, None)
        return self.view(self.manager.drop_session(job.id, reason))

    def check(self, now: float) -> None:
        """Withdraw sessions whose lease ran out, stop idle ones (called by the monitor)."""
        with self._lock:
            self._load()
            leases = list(self._leases.items())
        for job_id, lease in leases:
            self._watch(job_id, lease, now)
        with self._lock:
            due = [(i, why) for i, lease in self._leases.items() if (why := _due(lease, now))]
        for job_id, why in due:
            job = self.manager.get(job_id)
            with self._lock:
                self._leases.pop(job_id, None)
            if job is None or job.state.terminal:
                continue
            log.info("session %d: %s", job_id, why)
            try:
                self.manager.cancel(job_id, reason=why)
            except HoraError as e:  # deleted meanwhile
                log.debug("session %d: %s", job_id, e)

    def _watch(self, job_id: int, lease: Lease, now: float) -> None:
        """Sample the engines' CPU time; a session that computes is busy now.

        Busy means more than ``session_busy_cpu`` of a core per engine since the last sample
        (idle ipyparallel engines use a small fraction of that on heartbeats). A session not
        running (queued, starting) or whose CPU time cannot be read counts as busy: the
        kernel's word is all there is then.
        """
        if now - lease.cpu_at < BUSY_SAMPLE_S:
            return
        used = self.manager.cpu_seconds(job_id)
        job = self.manager.get(job_id) if used is not None else None
        if used is None or job is None or lease.cpu is None:
            lease.busy = now
        else:
            share = self.settings.session_busy_cpu * job.spec.workers
            if used - lease.cpu > share * (now - lease.cpu_at):
                lease.busy = now
        lease.cpu, lease.cpu_at = used, now

    def view(
        self, job: JobRecord, now: float | None = None, viewer: User | None = None
    ) -> SessionInfo:
        """The session as the API answers it, with its queue place while queued.

        ``viewer`` (default: the session's owner) sees the idle time of the sessions holding
        slots only where they are their own, or as an admin.
        """
        now = time.time() if now is None else now
        with self._lock:
            lease = self._leases.get(job.id)
        idle = idle_left = warning = None
        if lease is not None and job.state == JobState.running:
            idle = max(0.0, now - lease.idle_since())
            if lease.idle_timeout_s is not None:
                idle_left = max(0.0, lease.idle_timeout_s - idle)
                if idle_left <= self.settings.session_idle_warn_s:
                    warning = (
                        f"engines idle for {fmt_s(idle)}: session {job.id} stops in "
                        f"{fmt_s(idle_left)} unless a %%distributed cell runs"
                    )
        who = viewer or User(name=job.user)
        queue = job_queue(self.manager, job, self.idle_seen_by(who, now))  # Slurm's word too
        return SessionInfo(
            id=job.id, user=job.user, name=job.spec.name, state=job.state,
            workers=job.spec.workers, slots=job.slots, reason=job.reason,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            lease_s=lease.lease_s if lease else self.settings.session_lease_s,
            idle_timeout_s=lease.idle_timeout_s if lease else None,
            idle_s=idle, stop_in_s=idle_left, warning=warning, queue=queue,
        )  # fmt: skip

    def idle_of(self, job_id: int, now: float | None = None) -> float | None:
        """Seconds session ``job_id``'s engines have been idle (None: not a known session)."""
        now = time.time() if now is None else now
        with self._lock:
            lease = self._leases.get(job_id)
        return max(0.0, now - lease.idle_since()) if lease is not None else None

    def idle_seen_by(self, viewer: User | None, now: float | None = None) -> IdleOf:
        """:meth:`idle_of` as ``viewer`` may see it: not other users' sessions (but an admin).

        Example:
            >>> job_queue(manager, job, sessions.idle_seen_by(user, now))  # doctest: +SKIP
        """
        now = time.time() if now is None else now

        def idle(job_id: int) -> float | None:
            if viewer is not None and not viewer.is_admin:
                owner = self.manager.get(job_id)
                if owner is None or owner.user != viewer.name:
                    return None
            return self.idle_of(job_id, now)

        return idle


def _due(lease: Lease, now: float) -> str | None:
    """Why a session must end now, or None.

    Example:
        >>> _due(Lease(30, None, heard=0, active=0), 31)
        'the kernel stopped heartbeating (no word for 31s; lease 30s): session ended, slots freed'
    """
    silent = now - lease.heard
    if silent > lease.lease_s:
        return (
            f"the kernel stopped heartbeating (no word for {fmt_s(silent)}; "
            f"lease {fmt_s(lease.lease_s)}): session ended, slots freed"
        )
    idle = now - lease.idle_since()
    if lease.idle_timeout_s is not None and idle > lease.idle_timeout_s:
        return f"idle for {fmt_s(idle)}: engines stopped and slots freed"
    return None


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)
