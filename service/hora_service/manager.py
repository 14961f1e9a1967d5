"""The job manager: the service's one owner of job state (control plane).

It validates submissions against this machine (slots, quota, runtime, working directory),
keeps the queue, and runs **one monitor loop** that moves every job through its lifecycle
(``queued -> starting -> running -> succeeded | failed | cancelled``, ``retrying`` between
attempts): it polls ranks, enforces ``timeout_s``, escalates SIGTERM to SIGKILL after the
grace period, retries failed attempts with exponential backoff, and runs the scheduling pass
(:func:`hora_service.scheduling.scheduler.schedule`) whenever something changed. Submissions and
cancellations wake the loop at once. :meth:`JobManager.tick` is one pass, public so that
tests can drive the loop step by step.

Durability: every transition is written to SQLite before and after processes start, and
each rank's shim leaves pid and exit files in its run directory. :meth:`JobManager.start`
re-adopts ranks still alive from an earlier run of the service, records how finished ones
ended, and fails (then retries per policy) attempts whose ranks vanished without a trace.
A slot is held until every process of the attempt holding it is gone: when an attempt
ends (success, failure, cancel, timeout), the runtime kills whatever is left in its process
container (:meth:`Runtime.clear`), and the slots are freed only once it reports the container
empty. Jobs run as their user's OS account in multi-user mode (:mod:`hora_service.identity`),
with an environment built from an allow-list (:func:`~hora_service.runtimes.core.allowed_env`).

The code is cut by role into :mod:`hora_service.jobs`. :class:`JobManager` owns one typed
state (:class:`~hora_service.jobs.state.ManagerState`: the store, the slots, the queue, the
attempts, the caches, the journaled writes) and hands it to collaborators that take what
they need as arguments: admission, the read views (jobs; slots, queue and metrics), elastic
slots, launch, recovery and the monitor loop. None inherits from another or reaches into
another's attributes; this module puts them together, delegates the manager's public
methods to them, and is where the rest of the service imports the manager and its types from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hora.inventory import Slot
from hora.spec import JobKind, JobSpec, JobState, ParkInfo
from sqlalchemy import Connection

from hora_service.jobs.admission import Admission
from hora_service.jobs.attempt import Attempt, Holder, QueueView, describe
from hora_service.jobs.bounds import Bounds
from hora_service.jobs.elastic_slots import ElasticSlots
from hora_service.jobs.launch import Launch
from hora_service.jobs.leases import SlotLeases
from hora_service.jobs.monitor import Monitor
from hora_service.jobs.preflight_book import PreflightBook
from hora_service.jobs.reads import Reads
from hora_service.jobs.recovery import Recovery
from hora_service.jobs.slots import SlotViews
from hora_service.jobs.state import (
    CACHE_MAX,
    LATENCY_WINDOW,
    PAGES_MAX,
    RETRY_WRITE_S,
    STOP_JOIN_S,
    ManagerState,
)
from hora_service.models import JobRecord, MetricsSnapshot, SlotInfo, User
from hora_service.runtimes import Runtime
from hora_service.scheduling.reasons import ReasonBoard
from hora_service.scheduling.scheduler import Pending
from hora_service.settings import Settings
from hora_service.store.db import Store
from hora_service.store.journal import Journal
from hora_service.users.registry import Users
from hora_service.users.usage import Usage

__all__ = [
    "CACHE_MAX",
    "LATENCY_WINDOW",
    "PAGES_MAX",
    "RETRY_WRITE_S",
    "STOP_JOIN_S",
    "Attempt",
    "Holder",
    "JobManager",
    "ManagerState",
    "QueueView",
    "describe",
]


class JobManager:
    """Owns the state and the monitor loop, through its collaborators (see the module docstring).

    Args:
        settings: the service settings.
        runtimes: runtimes by name to use instead of building them from the registry
            (tests pass one whose ranks report scripted states).

    Example:
        >>> mgr = JobManager(Settings(data_dir=tmp_path, gpus="0", cpu_slots=2))  # doctest: +SKIP
        >>> mgr.start(); token = mgr.users.create("ann")  # doctest: +SKIP
        >>> mgr.submit("ann", JobSpec(command=["python", "-c", "pass"]))  # doctest: +SKIP
    """

    def __init__(self, settings: Settings, runtimes: dict[str, Runtime] | None = None) -> None:
        self.state = state = ManagerState(settings, runtimes)
        self.reads = Reads(state)
        self.views = SlotViews(state)
        self.admission = Admission(state)
        self.elastic = ElasticSlots(state)
        self.launch = Launch(state, self.admission, self.elastic)
        self.recovery = Recovery(state, self.launch, self.elastic)
        self.monitor = Monitor(state, self.admission, self.elastic, self.launch, self.recovery)

    # the state's parts the rest of the service uses ---------------------------------------

    @property
    def settings(self) -> Settings:
        """The service settings."""
        return self.state.settings

    @property
    def store(self) -> Store | None:
        """The SQLite store, once open."""
        return self.state.store

    @property
    def inventory(self) -> list[Slot]:
        """The slots this service schedules."""
        return self.state.inventory

    @property
    def users(self) -> Users:
        """The service's users and their tokens."""
        return self.state.users

    @property
    def bounds(self) -> Bounds:
        """What a job may use and where it runs (limits, working directories, start checks)."""
        return self.state.bounds

    @property
    def journal(self) -> Journal:
        """The state changes the store has not taken yet."""
        return self.state.journal

    @property
    def hooks(self) -> list[Callable[[float], None]]:
        """Called with the time at the end of every monitor pass."""
        return self.state.hooks

    @property
    def waits(self) -> ReasonBoard:
        """The reasons runtimes post for jobs they hold back."""
        return self.state.waits

    @property
    def usage(self) -> Usage:
        """Queue waits and slot-hours by user, for ``/metrics``."""
        return self.state.usage

    @property
    def preflight(self) -> PreflightBook:
        """The jobs' preflight figures, for pages and ``/metrics``."""
        return self.state.preflight

    @property
    def leases(self) -> SlotLeases:
        """This service's part in the machine-wide slot leases."""
        return self.state.leases

    @property
    def user_mode(self) -> str:
        """The user mode in effect: ``multi``, ``single`` or ``shared``."""
        return self.state.user_mode

    def open_store(self) -> Store:
        """Open (and migrate) the SQLite store if it is not open yet."""
        return self.state.open_store()

    def close_store(self) -> None:
        """Close the store's connections."""
        self.state.close_store()

    def quota_of(self, user: str) -> int | None:
        """Most slots ``user``'s jobs and sessions may hold (None: no limit)."""
        return self.state.quota_of(user)

    def quota_table(self) -> Callable[[str], int | None]:
        """:meth:`quota_of` for many users at once: the users are read once, here."""
        return self.state.quota_table()

    # the monitor loop (hora_service.jobs.monitor) ---------------------------------------

    def start(self) -> None:
        """Hold the data directory, recover jobs, start the loop (:meth:`Monitor.start`)."""
        self.monitor.start()

    def stop(self) -> None:
        """Stop the loop and close the store; running jobs keep running (:meth:`Monitor.stop`)."""
        self.monitor.stop()

    def shutdown_jobs(self, timeout: float | None = None) -> None:
        """Cancel every active job and wait (bounded) until their processes are gone."""
        self.monitor.shutdown_jobs(timeout)

    def tick(self, now: float | None = None) -> None:
        """One pass of the monitor loop (:meth:`Monitor.tick`)."""
        self.monitor.tick(now)

    def replace_engine(self, session_id: int, rank: int, master_port: int) -> JobRecord:
        """Start a new engine for a dead rank of a session (:meth:`Monitor.replace_engine`)."""
        return self.monitor.replace_engine(session_id, rank, master_port)

    # reads (hora_service.jobs.reads) ----------------------------------------------------

    def get(self, job_id: int) -> JobRecord | None:
        """One job as the monitor knows it, or None (:meth:`Reads.get`)."""
        return self.reads.get(job_id)

    def records(self, ids: list[int]) -> dict[int, JobRecord]:
        """The jobs with these ids that exist, by id (:meth:`Reads.records`)."""
        return self.reads.records(ids)

    def list_jobs(
        self, user: str | None, state: JobState | None, limit: int, offset: int
    ) -> tuple[list[JobRecord], int]:
        """A page of jobs, newest first, and the total (:meth:`Reads.list_jobs`)."""
        return self.reads.list_jobs(user, state, limit, offset)

    def list_json(self, user: str | None, state: JobState | None, limit: int, offset: int) -> bytes:
        """The same page as the JSON body of ``GET /v1/jobs`` (:meth:`Reads.list_json`)."""
        return self.reads.list_json(user, state, limit, offset)

    # slots, queue, metrics (hora_service.jobs.slots) -------------------------------------

    def slots(self) -> list[SlotInfo]:
        """Every slot and who holds it (:meth:`SlotViews.slots`)."""
        return self.views.slots()

    def cpu_seconds(self, job_id: int) -> float | None:
        """CPU seconds the running attempt of ``job_id`` has used (None: none, or unknown)."""
        return self.views.cpu_seconds(job_id)

    def cluster_slots(self) -> list[SlotInfo]:
        """The Slurm cluster's GPUs and their holders (:meth:`SlotViews.cluster_slots`)."""
        return self.views.cluster_slots()

    def queue_view(self, job_id: int, now: float | None = None) -> QueueView:
        """Where queued ``job_id`` stands (:meth:`SlotViews.queue_view`)."""
        return self.views.queue_view(job_id, now)

    def blocked_head(self, now: float | None = None) -> tuple[Pending, int] | None:
        """The first queued request the free slots cannot take (:meth:`SlotViews.blocked_head`)."""
        return self.views.blocked_head(now)

    def session_holders(self) -> list[tuple[int, str, int, int]]:
        """``(id, user, priority, slots)`` of the running sessions not being stopped."""
        return self.views.session_holders()

    def session_jobs(self) -> list[JobRecord]:
        """The sessions queued, starting or running now (their records)."""
        return self.views.session_jobs()

    def queue_snapshot(self) -> tuple[list[tuple[Pending, float | None]], tuple[Holder, ...]]:
        """The queued jobs and the holders at once (:meth:`SlotViews.queue_snapshot`)."""
        return self.views.queue_snapshot()

    def metrics(self) -> MetricsSnapshot:
        """Jobs by state, queue length, slots, and submit-to-running latency."""
        return self.views.metrics()

    # submissions and the job commands (hora_service.jobs.admission) ------------------------

    def submit(self, user: str, spec: JobSpec) -> JobRecord:
        """Queue a job (:meth:`Admission.submit`)."""
        return self.admission.submit(user, spec)

    def submit_or_find(
        self,
        user: str,
        spec: JobSpec,
        kind: JobKind = JobKind.job,
        also: Callable[[Store, Connection, int], None] | None = None,
        account: User | None = None,
    ) -> tuple[JobRecord, bool]:
        """Queue a job, or find its earlier one (:meth:`Admission.submit_or_find`)."""
        return self.admission.submit_or_find(user, spec, kind, also, account)

    def check(self, user: str, spec: JobSpec, kind: JobKind = JobKind.job) -> None:
        """Refuse a spec that can never run on this service (:meth:`Admission.check`)."""
        self.admission.check(user, spec, kind)

    def workdir(self, spec: JobSpec, user: str | None = None) -> Path:
        """The ranks' working directory (:meth:`Admission.workdir`)."""
        return self.admission.workdir(spec, user)

    def cancel(self, job_id: int, reason: str = "cancelled by the user") -> JobRecord:
        """Cancel a job; a no-op on a finished one (:meth:`Admission.cancel`)."""
        return self.admission.cancel(job_id, reason)

    def park(self, session_id: int, reason: str, park: ParkInfo) -> None:
        """Record a session's snapshot and stop its engines (:meth:`Admission.park`)."""
        self.admission.park(session_id, reason, park)

    def requeue(
        self, session_id: int, user: str, spec: JobSpec, reason: str, park: ParkInfo
    ) -> None:
        """Queue a parked session again with ``spec`` (:meth:`Admission.requeue`)."""
        self.admission.requeue(session_id, user, spec, reason, park)

    def set_park(self, session_id: int, park: ParkInfo | None) -> None:
        """Record (None: forget) a session's snapshot without changing its state."""
        self.admission.set_park(session_id, park)

    def handoff(self, session_id: int, user: str, spec: JobSpec) -> JobRecord:
        """Submit ``spec`` and give it a running session's slots (:meth:`Admission.handoff`)."""
        return self.admission.handoff(session_id, user, spec)

    def drop_session(self, job_id: int, reason: str) -> JobRecord:
        """Stop a session and delete it (:meth:`Admission.drop_session`)."""
        return self.admission.drop_session(job_id, reason)

    def delete(self, job_id: int) -> None:
        """Remove a finished job and its logs (:meth:`Admission.delete`)."""
        self.admission.delete(job_id)

    def log_path(self, job_id: int, rank: int, attempt: int) -> Path:
        """The log file of one rank of one attempt (:meth:`Admission.log_path`)."""
        return self.admission.log_path(job_id, rank, attempt)

    def preflight_path(self, job_id: int, attempt: int) -> Path:
        """The preflight's figures of one attempt (:meth:`Admission.preflight_path`)."""
        return self.admission.preflight_path(job_id, attempt)
