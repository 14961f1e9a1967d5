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

import logging
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from hora.errors import HoraError, SpecError
from hora.net import is_local_address
from hora.session_wire import (
    EngineConnection,
    EngineReplacement,
    Heartbeat,
    SessionAddress,
    SessionRequest,
    check_interface,
    host_of,
)
from hora.spec import JobKind, JobState, RuntimeName, SessionInfo, SlotKind
from sqlalchemy import Connection

from hora_service.manager import JobManager
from hora_service.models import JobRecord, User
from hora_service.observability.queueview import IdleOf, job_queue
from hora_service.sessions.park_manager import ParkManager
from hora_service.sessions.session_spec import (
    CONNECTION_VAR,
    SessionRecord,
    check_controller,
    session_spec,
)
from hora_service.settings import Settings
from hora_service.store.db import Store
from hora_service.users.registry import check_idle_timeout

__all__ = [
    "CONNECTION_VAR", "EngineConnection", "EngineReplacement", "Heartbeat", "Lease",
    "SessionAddress", "SessionManager", "SessionRecord", "SessionRequest", "check_interface",
    "effective_idle_timeout", "fmt_s", "is_local_address", "session_spec",
]  # fmt: skip

if TYPE_CHECKING:
    from hora_service.runtimes.slurm_route import NodeRoute

log = logging.getLogger(__name__)
BUSY_SAMPLE_S = 2.0  # how often the engines' CPU time is read


@dataclass
class Lease:
    """A session's heartbeat clock (in memory; a restarted service starts it afresh).

    ``active`` is when the kernel says its engines last ran something; ``busy`` when the
    service last saw them compute (their CPU time grew, see :meth:`SessionManager.check`).
    The idle time is counted from the earlier of the two, so a kernel that always says
    "not idle" keeps nothing: only engines that compute do. A kernel that said "a cell runs"
    (``idle_s`` 0) is taken at its word until its next heartbeat: between heartbeats only the
    service's eye can make a running cell idle.
    """

    lease_s: float
    idle_timeout_s: float | None
    heard: float
    active: float
    ended: str | None = None
    busy: float = -1.0
    cpu: float | None = None  # the engines' CPU seconds at ``cpu_at``
    cpu_at: float = 0.0
    running: bool = False  # the kernel's last word: a cell runs now

    def __post_init__(self) -> None:
        if self.busy < 0:
            self.busy = self.heard

    def idle_since(self, now: float) -> float:
        """When the engines were last active, by the kernel's word and the service's eye."""
        return min(now if self.running else self.active, self.busy)


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
        self.parks = ParkManager(manager, settings, self.idle_of, self._end_lease, self._renew)

    def _end_lease(self, job_id: int) -> None:
        with self._lock:
            self._leases.pop(job_id, None)

    def _renew(self, job_id: int) -> None:
        """A fresh lease for a session asked for again (a parked one resumed)."""
        terms = self.manager.open_store().session_terms().get(job_id)
        now = time.time()
        lease_s, idle = terms if terms is not None else (self.settings.session_lease_s, None)
        with self._lock:
            self._leases[job_id] = Lease(lease_s, idle, now, now)

    def _node_route(self) -> NodeRoute:
        with self._lock:
            if self._route is None:
                from hora_service.runtimes.slurm import SlurmRuntime
                from hora_service.runtimes.slurm_route import NodeRoute  # only where Slurm is used

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
        if req.runtime == RuntimeName.slurm:
            check_controller(self.settings, host_of(req.connection.interface))
        owner = self.manager.open_store().user_by_name(user)
        idle = effective_idle_timeout(
            req.idle_timeout_s,
            owner.idle_timeout_s if owner is not None else None,
            s.session_idle_timeout_s,
            s.session_idle_timeout_max_s,
        )
        backend = "nccl" if self.manager.inventory[0].kind == SlotKind.gpu else "gloo"
        spec = session_spec(req, backend, str(s.session_python or sys.executable))
        lease = s.session_lease_s

        def terms(store: Store, conn: Connection, job_id: int) -> None:
            store.add_session(conn, job_id, lease, idle)

        record, _ = self.manager.submit_or_find(user, spec, kind=JobKind.session, also=terms)
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

        Slurm is asked at most once a while (:mod:`hora_service.runtimes.slurm_route`).

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
                lease.running = beat.idle_s == 0
        return self.view(self.manager.get(job.id) or job)

    def delete(self, job: JobRecord) -> SessionInfo:
        """Delete a session: withdrawn if queued, stopped if running, its snapshot gone if parked.

        The answer is the session as it stood; from then on it is a 404 and in no list (its
        engines stop, then its record and logs are removed).
        """
        reason = {
            JobState.queued: "withdrawn by the user",
            JobState.parked: "ended by the user; its snapshot was deleted",
        }.get(job.state, "stopped by the user")
        with self._lock:
            self._leases.pop(job.id, None)
        ended = self.manager.drop_session(job.id, reason)
        self.parks.dropped(job)
        return self.view(ended)

    def check(self, now: float) -> None:
        """Withdraw sessions whose lease ran out, stop idle ones (called by the monitor)."""
        with self._lock:
            self._load()
            leases = list(self._leases.items())
        for job_id, lease in leases:
            self._watch(job_id, lease, now)
        with self._lock:
            due = [(i, d) for i, lease in self._leases.items() if (d := _due(lease, now))]
        for job_id, (why, idle) in due:
            job = self.manager.get(job_id)
            if job is not None and not job.state.terminal and idle:
                if self.settings.session_idle_action == "park":
                    if self.parks.ask(job_id, why, "idle", now):
                        continue  # its kernel parks it (or says why it cannot: then it stops)
                    why = f"{why}; the kernel did not park the session"
                why = f"{why}: engines stopped and slots freed"
            with self._lock:
                self._leases.pop(job_id, None)
            if job is None or job.state.terminal:
                continue
            log.info("session %d: %s", job_id, why)
            if not idle and self.parks.lease_ran_out(job_id):
                continue  # a resume whose kernel went silent: parked again, snapshot kept
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
            idle = max(0.0, now - lease.idle_since(now))
            if lease.idle_timeout_s is not None:
                idle_left = max(0.0, lease.idle_timeout_s - idle)
                if idle_left <= self.settings.session_idle_warn_s:
                    parks = self.settings.session_idle_action == "park"
                    what = "is parked (its variables kept)" if parks else "stops"
                    warning = (
                        f"engines idle for {fmt_s(idle)}: session {job.id} {what} in "
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
            idle_s=idle, stop_in_s=idle_left, warning=warning, queue=queue, park=job.park,
            park_requested=self.parks.asked(job.id) if job.state == JobState.running else None,
        )  # fmt: skip

    def idle_of(self, job_id: int, now: float | None = None) -> float | None:
        """Seconds session ``job_id``'s engines have been idle (None: not a known session)."""
        now = time.time() if now is None else now
        with self._lock:
            lease = self._leases.get(job_id)
        return max(0.0, now - lease.idle_since(now)) if lease is not None else None

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


def _due(lease: Lease, now: float) -> tuple[str, bool] | None:
    """Why a session must end (or be parked) now, and whether for idleness; or None.

    Example:
        >>> _due(Lease(30, None, heard=0, active=0), 31)[0]
        'the kernel stopped heartbeating (no word for 31s; lease 30s): session ended, slots freed'
        >>> _due(Lease(30, 60, heard=100, active=0), 100)
        ('idle for 100s', True)
    """
    silent = now - lease.heard
    if silent > lease.lease_s:
        return (
            f"the kernel stopped heartbeating (no word for {fmt_s(silent)}; "
            f"lease {fmt_s(lease.lease_s)}): session ended, slots freed"
        ), False
    idle = now - lease.idle_since(now)
    if lease.idle_timeout_s is not None and idle > lease.idle_timeout_s:
        return f"idle for {fmt_s(idle)}", True
    return None


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)
