"""The job manager: the service's one owner of job state (control plane).

It validates submissions against this machine (slots, quota, runtime, working directory),
keeps the queue, and runs **one monitor loop** that moves every job through its lifecycle
(``queued -> starting -> running -> succeeded | failed | cancelled``, ``retrying`` between
attempts): it polls ranks, enforces ``timeout_s``, escalates SIGTERM to SIGKILL after the
grace period, retries failed attempts with exponential backoff, and runs the scheduling pass
(:func:`hora_service.scheduler.schedule`) whenever something changed. Submissions and
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
with an environment built from an allow-list (:func:`~hora_service.runtimes.local.allowed_env`).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hora.env import new_rdzv_secret
from hora.errors import HoraError, SpecError
from hora.net import free_port
from hora.spec import PRIORITY_RANK, JobSpec, JobState
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from hora_service import identity, runtimes
from hora_service.bounds import Bounds
from hora_service.elastic import HOSTS_FILE, ElasticRun, driver_argv, python, write_hosts
from hora_service.inventory import Slot, inventory
from hora_service.jobpreflight import PreflightBook, PreflightFigures
from hora_service.journal import Journal, Write
from hora_service.models import JobRecord, MetricsSnapshot, SlotInfo, User
from hora_service.quotas import OverLimit, spec_bytes, within_running_limit
from hora_service.reasons import ReasonBoard
from hora_service.runtimes import AttemptPlan, Exit, RankProcess, Runtime
from hora_service.runtimes.base import RankStatus, first_failure, prepare_run_dir, rank_status
from hora_service.runtimes.containment import Containment, detect
from hora_service.runtimes.local import allowed_env
from hora_service.scheduler import INF, Holding, Pending, queue_order, reserve, schedule
from hora_service.settings import Settings
from hora_service.store import Store, StoreUnavailable, is_unavailable
from hora_service.usage import Usage
from hora_service.users import Users

log = logging.getLogger(__name__)

LATENCY_WINDOW = 1000
CACHE_MAX = 50_000
PAGES_MAX = 1024
STOP_JOIN_S = 30.0
RETRY_WRITE_S = 0.25  # how long one pass of the monitor waits for the store's write lock


@dataclass
class Attempt:
    """One running attempt: its ranks, and how it is being stopped, if it is."""

    job_id: int
    user: str
    plan: AttemptPlan
    ranks: list[RankProcess]
    started: float
    deadline: float | None
    stop_state: JobState | None = None
    stop_reason: str | None = None
    kill_at: float = INF
    retriable: bool = True
    codes: list[RankStatus] = field(default_factory=list)
    clearing_since: float | None = None
    stuck_reported: bool = False
    kind: str = "job"
    held: bool = False  # its runtime's own queue still holds it (Slurm): recorded ``starting``
    created: float = 0.0  # when the job was submitted (its queue wait ends when it runs)
    elastic: ElasticRun | None = None  # an elastic job's membership, read from its driver
    counted: float | None = None  # its slot-seconds are in the usage up to then (None: none)
    # a session's dead engines, kept (their slots too) until the kernel asks for new ones
    lost: dict[int, str] = field(default_factory=dict)

    def count(self, usage: Usage, now: float) -> None:
        """Add the slot-seconds held since the last count (slots change in an elastic job)."""
        usage.held(self.user, len(self.plan.slots), now - (self.counted or self.started))
        self.counted = now

    def stop(self, state: JobState, reason: str, now: float, grace: float, retry: bool) -> None:
        """Begin stopping every rank: SIGTERM now, SIGKILL at ``now + grace``."""
        # a cancel may replace a failure already being stopped (the user's word is final and
        # a cancelled job is not retried); nothing replaces a cancel
        if self.stop_state is not None and self.stop_state != JobState.failed:
            return
        self.stop_state, self.stop_reason, self.retriable = state, reason, retry
        self.kill_at = min(self.kill_at, now + grace)
        for rank in self.ranks:
            rank.signal(signal.SIGTERM)


def _box_of(ranks: list[RankProcess]) -> dict[str, object]:
    """The ``container_id`` field of a job record: its ranks' container (or Slurm job)."""
    boxes = {r.container_id for r in ranks if r.container_id is not None}
    return {"container_id": next(iter(sorted(boxes)), None)}


@dataclass(frozen=True)
class Holder:
    """Who holds slots now, as a queued request is shown it."""

    id: int
    kind: str
    user: str
    slots: tuple[int, ...]
    since: float
    ends_at: float | None
    stopping: bool = False  # its processes are being stopped: the slots are draining


@dataclass(frozen=True)
class QueueView:
    """Where a queued job or session stands: its place, the slots, who holds them, when.

    Attributes:
        position: 1 for the next to be considered (priority, then age); 0 once it left.
        need: slots it asks for; free: slots free now.
        holders: the jobs and sessions holding slots, oldest first.
        estimate: when enough slots should be free (UNIX time); None when nothing holding
            them has a time limit.
        over_quota: it waits for its user's own jobs and sessions to end.
    """

    position: int
    need: int
    free: int
    holders: tuple[Holder, ...]
    estimate: float | None
    over_quota: bool


def _outside(spec: JobSpec) -> bool:
    """The job runs on resources its runtime owns (Slurm's nodes), not the service's slots."""
    return spec.runtime.value == "slurm"


def describe(rank: int, status: RankStatus, note: str | None = None) -> str:
    """A human reason for one rank's failure, with what the runtime noted about it.

    Example:
        >>> describe(1, 3), describe(0, -9)
        ('rank 1 exited with code 3', 'rank 0 was killed by SIGKILL')
        >>> describe(0, Exit.lost, "its container is gone")
        'rank 0 ended without recording its exit status: its container is gone'
    """
    if note:
        if status is Exit.lost:
            return f"rank {rank} ended without recording its exit status: {note}"
        return f"{describe(rank, status)} ({note})"
    if status is Exit.lost:
        return f"rank {rank} ended while the service was down; its exit status is unknown"
    assert isinstance(status, int)
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {status}"


class JobManager:
    """Owns the store, the slots and the monitor loop (see the module docstring).

    Args:
        settings: the service settings.
        runtimes: runtimes by name to use instead of building them from the registry
            (tests pass one whose ranks report scripted states).

    Example:
        >>> mgr = JobManager(Settings(data_dir=tmp_path, gpus="0", cpu_slots=2))  # doctest: +SKIP
        >>> mgr.start(); token = mgr.create_user("ann")  # doctest: +SKIP
        >>> mgr.submit("ann", JobSpec(command=["python", "-c", "pass"]))  # doctest: +SKIP
    """

    def __init__(self, settings: Settings, runtimes: dict[str, Runtime] | None = None) -> None:
        self.settings = settings
        self.store: Store | None = None
        self.inventory: list[Slot] = inventory(settings.gpus, settings.cpu_slots)
        self._kind = self.inventory[0].kind
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: dict[int, tuple[Pending, float | None]] = {}
        self._attempts: dict[int, Attempt] = {}
        self._dirty = True
        self._runtimes: dict[str, Runtime] = dict(runtimes or {})
        self._base_env = allowed_env(os.environ, settings.job_env_passthrough)
        self.users = Users(
            identity.resolve_mode(settings.user_mode), self.open_store, settings.work_root,
            settings.disk_bytes,
        )  # fmt: skip
        self.bounds = Bounds(settings, self.users, self._base_env, len(self.inventory))
        self._containment: Containment | None = None
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._latency_sum = 0.0
        self._latency_count = 0
        self._last_pass_s = 0.0
        # job id -> (record, its JSON); dropped on every write to the job (see _forget)
        self._cache: dict[int, tuple[JobRecord, bytes]] = {}
        self._cache_lock = threading.Lock()
        self._generation = 0  # moves on at every write to the jobs table
        self._pages: dict[tuple[object, ...], tuple[int, list[int], int]] = {}
        self.journal = Journal()  # state changes the store has not taken yet
        self._quota_memo: dict[str, int] = {}
        # called with the time at the end of every monitor pass (sessions' leases, idle culling)
        self.hooks: list[Callable[[float], None]] = []
        self.waits = ReasonBoard()  # reasons runtimes post for jobs they hold back
        for given in self._runtimes.values():
            given.waits = self.waits
        self.usage = Usage()  # queue waits and slot-hours by user, for /metrics
        self.preflight = PreflightBook()  # the jobs' preflight figures, for pages and /metrics
        self._handoffs: dict[int, int] = {}  # session id -> the job that takes its slots

    # lifecycle --------------------------------------------------------------------------

    def open_store(self) -> Store:
        """Open (and migrate) the SQLite store if it is not open yet."""
        if self.store is None:
            for d in (self.settings.data_dir, self.settings.logs_dir):
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o700)  # the service's alone: jobs never read the store or others' logs
            self.store = Store(self.settings.db_path)
        return self.store

    def close_store(self) -> None:
        """Close the store's connections."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def start(self) -> None:
        """Open the store, recover jobs from an earlier run, start the monitor loop.

        Raises:
            HoraError: single-user mode over a store with several users (their jobs would
                all run as this service's account without anyone having opted in).
        """
        self.users.check_start(self.settings.db_path)
        root = self.settings.work_root
        if self.user_mode == "multi" and root.is_dir() and not root.stat().st_mode & 0o001:
            log.warning(
                "multi-user mode, but the work root %s cannot be entered by other accounts: "
                "jobs (which run as their users' accounts) will not reach their working "
                "directories; set HORA_WORK_ROOT to a directory they can enter",
                root,
            )
        self.users.make_homes_private()
        with self._lock:
            self._recover()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="hora-monitor", daemon=True)
        self._thread.start()
        log.info("job manager started: %d %s slot(s)", len(self.inventory), self._kind)

    def stop(self) -> None:
        """Stop the monitor loop and close the store; running jobs keep running.

        The next :meth:`start` re-adopts them.
        """
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_JOIN_S)
            self._thread = None
        if len(self.journal):
            with self._lock:
                self._flush(timeout_s=5.0)
            if len(self.journal):
                log.error(
                    "stopping with %d state change(s) the store did not take (%s); the next "
                    "start reads how the jobs ended from their ranks' exit files",
                    len(self.journal), self.journal.error,
                )  # fmt: skip
        self.close_store()

    def shutdown_jobs(self, timeout: float | None = None) -> None:
        """Cancel every active job and wait (bounded) until their processes are gone."""
        with self._lock:
            for job_id in list(self._attempts):
                self.cancel(job_id, reason="cancelled: the service is shutting down")
        deadline = time.monotonic() + (timeout or self.settings.kill_grace_s + 10.0)
        while self._attempts and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.05)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("monitor pass failed")
            self._wake.wait(self._next_wait())
            self._wake.clear()

    def _next_wait(self) -> float:
        wait = self.settings.monitor_interval_s
        if not self._attempts and not len(self.journal):
            due = [t for _, t in self._pending.values() if t is not None]
            wait = max(wait, min(due) - time.time()) if due else 5.0
        return max(0.0, min(wait, 5.0))

    # users ------------------------------------------------------------------------------

    def create_user(
        self,
        name: str,
        admin: bool = False,
        quota: int | None = None,
        uid: int | None = None,
        make_account: bool = False,
        idle_timeout_s: float | None = None,
    ) -> str:
        """Create a user and return their token (see :meth:`hora_service.users.Users.create`)."""
        return self.users.create(name, admin, quota, uid, make_account, idle_timeout_s)

    def remove_user(self, name: str) -> bool:
        """Delete a user; their token stops working at once. False if there was none."""
        return self.users.remove(name)

    def user_for_token(self, token: str) -> User | None:
        """The user a bearer token belongs to, or None."""
        return self.users.for_token(token)

    def list_users(self) -> list[User]:
        """Every user."""
        return self.users.all()

    @property
    def user_mode(self) -> str:
        """The user mode in effect: ``multi``, ``single`` or ``shared``."""
        return self.users.mode

    # jobs -------------------------------------------------------------------------------

    def submit(self, user: str, spec: JobSpec) -> JobRecord:
        """Queue a job (or return the one this user submitted with the same submission id).

        Raises:
            SpecError: see :meth:`submit_or_find`.
        """
        return self.submit_or_find(user, spec)[0]

    def submit_or_find(
        self,
        user: str,
        spec: JobSpec,
        kind: str = "job",
        also: Callable[[Store, Connection, int], None] | None = None,
    ) -> tuple[JobRecord, bool]:
        """Queue a job; with a submission id this user used before, find that job instead.

        ``kind`` is ``session`` for a notebook's engines (:mod:`hora_service.sessions`);
        ``also`` writes what goes with the new row, in the same transaction.

        Returns:
            The job, and True when it was created by this call.

        Raises:
            SpecError: the job can never run here (more slots than exist or than the user's
                quota, an unavailable runtime, an image without the docker runtime, a working
                directory outside the work root); ``field`` names the field.
            OverLimit: the spec is larger than ``max_spec_bytes`` (413) or the user has
                ``max_queued_jobs_per_user`` jobs waiting already (429).
            StoreUnavailable: the store could not take the write in time (busy, full).
            sqlalchemy.exc.OperationalError: the same, as SQLite reported it.
        """
        store = self.open_store()
        self.check(user, spec)
        self._check_limits(user, spec)
        # the check and the insert are one write transaction; a store that cannot take it
        # within the timeout answers StoreUnavailable (a 503 with Retry-After), never a hang
        with store.tx(self.settings.store_write_timeout_s) as conn:
            if spec.submission_id is not None:
                existing = store.job_by_submission(conn, user, spec.submission_id)
                if existing is not None:
                    found = store.get(existing, conn)
                    assert found is not None
                    return found, False
            now = time.time()
            job_id = store.insert_job(conn, user, spec, now, kind)
            if also is not None:
                also(store, conn, job_id)
            record = store.get(job_id, conn)
            assert record is not None
        self._forget(job_id)  # a new job changes every page it belongs to
        self._enqueue(job_id, user, spec, None)
        return record, True

    def _check_limits(self, user: str, spec: JobSpec) -> None:
        size, most = spec_bytes(spec), self.settings.max_spec_bytes
        if size > most:
            raise OverLimit("spec", f"the job spec is {size} bytes; the limit is {most}", 413)
        queued = self.settings.max_queued_jobs_per_user
        if queued is not None:
            with self._lock:
                waiting = sum(1 for p, _ in self._pending.values() if p.user == user)
            if waiting >= queued:
                raise OverLimit(
                    "queued_jobs",
                    f"you have {waiting} jobs waiting in the queue; the limit is {queued}",
                    429,
                )

    def check(self, user: str, spec: JobSpec) -> None:
        """Refuse a spec that can never run on this service (see :meth:`submit`)."""
        total, need = len(self.inventory), spec.total_gpus
        unit = "GPUs" if self._kind == "gpu" else "slots"
        field = "workers" if spec.gpus_per_worker == 1 else "gpus_per_worker"
        if need > total and not _outside(spec):
            raise SpecError(
                field,
                f"asks for {need} {unit} ({spec.workers} workers x {spec.gpus_per_worker}); "
                f"this cluster has {total}",
            )
        quota = self._quotas().get(user, self.settings.user_gpu_quota)
        if quota is not None and need > quota:
            raise SpecError(field, f"asks for {need} {unit}; your quota is {quota}")
        self._check_elastic(spec, total, unit)
        who = self.users.run_as_of(user) if self.user_mode == "multi" else None
        if spec.image is not None and spec.runtime.value not in ("docker", "slurm"):
            raise SpecError("image", "an image is used only by the docker runtime")
        self._runtime(spec.runtime.value).check(spec)
        self.bounds.preflight(spec, self.workdir(spec, user), who, self._driver_python(spec))

    def _driver_python(self, spec: JobSpec) -> str | None:
        """The Python an elastic job's driver runs with (None for other jobs)."""
        if spec.elastic is None:
            return None
        return str(self.settings.session_python or python())

    def _check_elastic(self, spec: JobSpec, total: int, unit: str) -> None:
        """Refuse an elastic job that can never run here, naming the field."""
        e = spec.elastic
        if e is None:
            return
        if spec.runtime.value != "local":
            raise SpecError("elastic", "elastic jobs run on the local runtime only for now")
        if self._kind == "gpu":
            raise SpecError("elastic", "elastic jobs run on CPU slots only for now")
        most = e.max_workers * spec.gpus_per_worker
        if most > total:
            raise SpecError(
                "elastic.max_workers",
                f"{e.max_workers} workers x {spec.gpus_per_worker} need {most} {unit}; "
                f"this cluster has {total}",
            )

    def workdir(self, spec: JobSpec, user: str | None = None) -> Path:
        """The ranks' working directory (see :meth:`hora_service.bounds.Bounds.workdir`).

        Raises:
            SpecError: it escapes the work root or is not an existing directory.
        """
        return self.bounds.workdir(spec, user)

    def get(self, job_id: int) -> JobRecord | None:
        """One job as the monitor knows it (with changes the store has yet to take), or None."""
        hit = self._cache.get(job_id)
        if hit is not None:
            return hit[0]
        return self._load([job_id]).get(job_id, (None, b""))[0]

    def list_jobs(
        self, user: str | None, state: JobState | None, limit: int, offset: int
    ) -> tuple[list[JobRecord], int]:
        """A page of jobs (``user=None``: everyone's), newest first, and the total."""
        page, total = self._page(user, state, limit, offset)
        return [record for record, _ in page], total

    def list_json(self, user: str | None, state: JobState | None, limit: int, offset: int) -> bytes:
        """The same page as :meth:`list_jobs`, as the JSON body of ``GET /v1/jobs``.

        Each job's JSON is serialised once and cached until the job changes, and a page's ids
        and total are reused until the next write, so a busy list endpoint costs dictionary
        lookups and a join of bytes. A page ends early when it would pass
        ``max_page_bytes``; ``next_offset`` is where the next page starts (null at the end).
        """
        page, total = self._page(user, state, limit, offset)
        bodies: list[bytes] = []
        size = 0
        for _, body in page:  # a page stops before max_page_bytes (always one job at least)
            if bodies and size + len(body) + 1 > self.settings.max_page_bytes:
                break
            bodies.append(body)
            size += len(body) + 1
        after = offset + len(bodies)
        more = "null" if after >= total else str(after)
        items = b",".join(bodies)
        tail = f'],"total":{total},"limit":{limit},"offset":{offset},"next_offset":{more}}}'
        return b'{"items":[' + items + tail.encode()

    def _page(
        self, user: str | None, state: JobState | None, limit: int, offset: int
    ) -> tuple[list[tuple[JobRecord, bytes]], int]:
        key = (user, state, limit, offset)
        generation = self._generation
        memo = self._pages.get(key)
        if memo is not None and memo[0] == generation:
            ids, total = memo[1], memo[2]
        else:  # a page read is reused until the next write to any job
            ids, total = self.open_store().list_ids(user, state, limit, offset)
            with self._cache_lock:
                if len(self._pages) > PAGES_MAX:
                    self._pages.clear()
                self._pages[key] = (generation, ids, total)
        found = {i: hit for i in ids if (hit := self._cache.get(i)) is not None}
        if len(found) < len(ids):
            found.update(self._load([i for i in ids if i not in found]))
        return [found[i] for i in ids if i in found], total

    def _load(self, ids: list[int]) -> dict[int, tuple[JobRecord, bytes]]:
        """Read jobs from the store and cache them unless one changed meanwhile."""
        generation = self._generation
        records = self.open_store().records(ids)
        if len(self.journal):
            records = {i: self.journal.overlay(r) for i, r in records.items()}
        loaded = {i: (record, record.model_dump_json().encode()) for i, record in records.items()}
        with self._cache_lock:
            if generation == self._generation:  # no write since the read began
                if len(self._cache) + len(loaded) > CACHE_MAX:
                    self._cache.clear()
                self._cache.update(loaded)
        return loaded

    def _forget(self, job_id: int) -> None:
        with self._cache_lock:
            self._generation += 1
            self._cache.pop(job_id, None)

    def cancel(self, job_id: int, reason: str = "cancelled by the user") -> JobRecord:
        """Cancel a job; a no-op on a finished one. Running ranks get SIGTERM, then SIGKILL.

        Raises:
            HoraError: there is no such job.
        """
        with self._lock:
            job = self._record(job_id)
            if job is None:
                raise HoraError(f"job {job_id} not found")
            now = time.time()
            if job_id in self._pending:
                del self._pending[job_id]
                self._set_state(job_id, JobState.cancelled, now, reason, finished_at=now)
            elif job_id in self._attempts:
                self._attempts[job_id].stop(
                    JobState.cancelled, reason, now, self.settings.kill_grace_s, retry=False
                )
                self._write(Write(job_id, None, now, None, {"cancel_requested": 1}))
            self._dirty = True
        self._wake.set()
        found = self._record(job_id)
        assert found is not None
        return found

    def handoff(self, session_id: int, user: str, spec: JobSpec) -> JobRecord:
        """Submit ``spec`` for ``user`` and give it the running session's slots.

        The session is stopped; once its processes are gone the job starts on its slots,
        before the next scheduling pass (no queued job can take them in between).

        Raises:
            HoraError: the session is not running.
            SpecError: the job needs more slots than the session holds, or cannot run here.
        """
        with self._lock:
            attempt = self._attempts.get(session_id)
            if attempt is None or attempt.kind != "session" or attempt.stop_state is not None:
                raise HoraError(f"session {session_id} is not running; submit the job instead")
            have, field = len(attempt.plan.slots), "workers"
            if spec.total_gpus > have:
                raise SpecError(field, f"asks for {spec.total_gpus} slots; the session has {have}")
            job, _ = self.submit_or_find(user, spec)
            self._handoffs[session_id] = job.id
        self.cancel(session_id, reason=f"stopped: its slots were handed to job {job.id}")
        return job

    def delete(self, job_id: int) -> None:
        """Remove a finished job and its logs.

        Raises:
            HoraError: the job is still active.
            StoreUnavailable: the store has not taken the job's end yet.
        """
        store = self.open_store()
        with self._lock:
            job = self._record(job_id)
            if job is None:
                return
            if not job.state.terminal:
                raise HoraError(f"job {job_id} is {job.state.value}; cancel it first")
            if self.journal.pending(job_id):  # its end is not recorded yet: keep the row
                why = self.journal.error
                raise StoreUnavailable(f"job {job_id}'s end is not recorded yet ({why})")
            store.delete_job(job_id)
            self._forget(job_id)
        shutil.rmtree(self.settings.logs_dir / str(int(job_id)), ignore_errors=True)

    def log_path(self, job_id: int, rank: int, attempt: int) -> Path:
        """The log file of one rank of one attempt (built from integers only).

        Raises:
            SpecError: a negative rank or attempt.
        """
        if rank < 0:
            raise SpecError("rank", "must be >= 0")
        if attempt < 0:
            raise SpecError("attempt", "must be >= 0")
        return self.settings.logs_dir / str(int(job_id)) / str(int(attempt)) / f"rank{rank}.log"

    def slots(self) -> list[SlotInfo]:
        """Every slot and the job (and user) holding it."""
        with self._lock:
            held = {s: a for a in self._attempts.values() for s in a.plan.slots}
        return [
            SlotInfo(
                index=s.index,
                kind=s.kind,
                name=s.name,
                job_id=held[s.index].job_id if s.index in held else None,
                user=held[s.index].user if s.index in held else None,
                holder_kind=held[s.index].kind if s.index in held else None,
            )
            for s in self.inventory
        ]

    def cpu_seconds(self, job_id: int) -> float | None:
        """CPU seconds the running attempt of ``job_id`` has used (None: none, or unknown)."""
        with self._lock:
            attempt = self._attempts.get(job_id)
        if attempt is None:
            return None
        try:
            runtime = self._runtime(attempt.plan.spec.runtime.value)
        except HoraError:
            return None
        return runtime.cpu_seconds(attempt.plan)

    def cluster_slots(self) -> list[SlotInfo]:
        """The Slurm cluster's GPUs and their holders (none unless ``slurm_conf`` is set)."""
        if self.settings.slurm_conf is None:
            return []
        with self._lock:
            holders = {
                r.container_id.removeprefix("slurm:"): (a.job_id, a.user, a.kind)
                for a in self._attempts.values()
                for r in a.ranks[:1]
                if r.container_id and r.container_id.startswith("slurm:")
            }
        from hora_service.runtimes.slurm import SlurmRuntime  # only where Slurm is used

        runtime = self._runtime("slurm")
        return runtime.cluster_slots(holders) if isinstance(runtime, SlurmRuntime) else []

    def queue_view(self, job_id: int, now: float | None = None) -> QueueView:
        """Where queued ``job_id`` stands (position 0 when it is not queued)."""
        now = time.time() if now is None else now
        with self._lock:
            order = sorted((p for p, _ in self._pending.values()), key=queue_order)
            mine = [i for i, p in enumerate(order) if p.id == job_id]
            attempts = sorted(self._attempts.values(), key=lambda a: a.started)
            held = sum(len(a.plan.slots) for a in attempts)
            owner = order[mine[0]].user if mine else None
            used = sum(len(a.plan.slots) for a in attempts if a.user == owner)
        free = len(self.inventory) - held
        holders = tuple(
            Holder(a.job_id, a.kind, a.user, a.plan.slots, a.started, a.deadline) for a in attempts
        )
        if not mine:
            return QueueView(0, 0, free, holders, None, False)
        job = order[mine[0]]
        quota = self._quotas().get(job.user, self.settings.user_gpu_quota)
        slots = [Holding(h.id, h.user, h.slots, h.ends_at or INF) for h in holders]
        shadow = reserve(job, free, slots, now).shadow
        return QueueView(
            mine[0] + 1, job.need, free, holders, shadow if shadow < INF else None,
            quota is not None and used + job.need > quota,
        )  # fmt: skip

    def queue_snapshot(self) -> tuple[list[tuple[Pending, float | None]], tuple[Holder, ...]]:
        """The queued jobs (with their retry time) and the holders, oldest first, at once."""
        with self._lock:
            pending = list(self._pending.values())
            attempts = sorted(self._attempts.values(), key=lambda a: a.started)
        holders = tuple(
            Holder(
                a.job_id, a.kind, a.user, a.plan.slots, a.started, a.deadline,
                a.stop_state is not None,
            )  # fmt: skip
            for a in attempts
        )
        return pending, holders

    def quota_of(self, user: str) -> int | None:
        """Most slots ``user``'s jobs and sessions may hold (None: no limit)."""
        return self._quotas().get(user, self.settings.user_gpu_quota)

    def metrics(self) -> MetricsSnapshot:
        """Jobs by state, queue length, slots, and submit-to-running latency."""
        counts = self.open_store().count_by_state()
        now = time.time()
        with self._lock:
            lat = sorted(self._latencies)
            allocated = sum(len(a.plan.slots) for a in self._attempts.values())
            running: dict[str, float] = {}
            for a in self._attempts.values():
                held = len(a.plan.slots) * max(0.0, now - (a.counted or a.started))
                running[a.user] = running.get(a.user, 0.0) + held
        return MetricsSnapshot(
            slot_kind=self._kind,
            queue_wait=self.usage.wait_rows(),
            slot_hours=self.usage.slot_hours(running),
            jobs_by_state=counts,
            queue_length=counts.get("queued", 0) + counts.get("retrying", 0),
            slots_total=len(self.inventory),
            slots_allocated=allocated,
            schedule_latency_p50_s=statistics.median(lat) if lat else None,
            schedule_latency_p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            schedule_latency_sum_s=self._latency_sum,
            schedule_latency_count=self._latency_count,
            schedule_pass_seconds=self._last_pass_s,
            store_pending_writes=len(self.journal),
            preflight_bandwidth_gbps=self.preflight.by_node(),
        )

    # the monitor loop -------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """One pass of the monitor loop: poll ranks, stop, finish, retry, schedule."""
        with self._lock:
            now = time.time() if now is None else now
            if len(self.journal):
                self._flush(RETRY_WRITE_S)
            for attempt in list(self._attempts.values()):
                self._poll(attempt, now)
            # nothing new starts until the store has taken what already happened
            due = any(t is not None and t <= now for _, t in self._pending.values())
            if (self._dirty or due) and not len(self.journal):
                self._dirty = False
                self._schedule(now)
            for hook in self.hooks:
                hook(now)

    def _poll(self, attempt: Attempt, now: float) -> None:
        grace = self.settings.kill_grace_s
        attempt.codes = [rank_status(r) for r in attempt.ranks]
        if attempt.held and attempt.stop_state is None:
            if any(r.pending_reason is not None for r in attempt.ranks):
                return
            if Exit.lost not in attempt.codes:  # it runs, or ran between two passes
                self._running(attempt)
        run = attempt.elastic
        if run is not None and run.read():
            self._write(Write(attempt.job_id, None, now, None, {"elastic": run.info}))
        shrinking = run is not None and run.target is not None and attempt.stop_state is None
        if shrinking and run is not None and run.released():
            self._release(attempt, now)
        if attempt.stop_state is None:
            codes = self._keep_engines(attempt, now)
            failed = first_failure(codes)
            self._watch_preflight(attempt, now)
            if failed is not None:
                first, status = failed
                why = describe(first, status, attempt.ranks[first].note)
                if attempt.plan.driver:  # rank 0 is hora run's driver; its log says why
                    why = f"the elastic driver ({why}; rank 0's log says why)"
                why = self.bounds.explain(
                    self._runtime(attempt.plan.spec.runtime.value), attempt.plan, first, why, status
                )
                attempt.stop(JobState.failed, why, now, grace, retry=True)
            elif attempt.deadline is not None and now > attempt.deadline:
                timeout = attempt.plan.spec.timeout_s or 0
                attempt.stop(JobState.failed, f"timed out after {timeout:g}s", now, grace, False)
            elif all(c == 0 for c in attempt.codes):
                if self._cleared(attempt, now):
                    self._finish(attempt, JobState.succeeded, None, now)
                return
        if attempt.stop_state is None:
            return
        if all(c is not Exit.running for c in attempt.codes):
            if self._cleared(attempt, now):
                self._finish(attempt, attempt.stop_state, attempt.stop_reason, now)
        elif now >= attempt.kill_at:
            self._runtime(attempt.plan.spec.runtime.value).clear(attempt.plan)
            for rank, code in zip(attempt.ranks, attempt.codes, strict=True):
                if code is Exit.running:
                    rank.signal(signal.SIGKILL)

    def _keep_engines(self, attempt: Attempt, now: float) -> list[RankStatus]:
        """Note a session's newly dead engines; the codes with those kept counted as running.

        A session whose runtime can start one engine again (:meth:`Runtime.replace_rank`)
        keeps running with a dead engine, and its slot, until the kernel asks for a new one
        (:meth:`replace_engine`); the lease and the idle timeout still end it. Once no
        engine is left, or on another runtime, a death ends the session as it ends a job.
        """
        if attempt.kind != "session":
            return attempt.codes
        if not self._runtime(attempt.plan.spec.runtime.value).replaces_ranks:
            return attempt.codes
        dead = {r: c for r, c in enumerate(attempt.codes) if r not in attempt.lost and c != 0
                and c is not Exit.running}  # fmt: skip
        if len(dead) + len(attempt.lost) >= len(attempt.codes):
            return attempt.codes  # no engine left: the session ends
        if dead:
            for rank, code in sorted(dead.items()):
                attempt.lost[rank] = why = describe(rank, code, attempt.ranks[rank].note)
                event = f"engine {why}; its slot is kept for the new engine the notebook asks for"
                log.warning("session %d: %s", attempt.job_id, event)
                self._write(Write(attempt.job_id, JobState.running, now, event, event=True))
        return [Exit.running if r in attempt.lost else c for r, c in enumerate(attempt.codes)]

    def replace_engine(self, session_id: int, rank: int, master_port: int) -> JobRecord:
        """Start a new engine for ``rank`` of a running session whose engine died.

        It meets the surviving engines at the store on ``master_port`` (the kernel's
        choice: its surviving engines host it there).

        Raises:
            HoraError: the session is not running, or that rank's engine is (409).
            SpecError: no such rank, or the session's runtime cannot (field named; 422).
        """
        with self._lock:
            attempt = self._attempts.get(session_id)
            if attempt is None or attempt.kind != "session" or attempt.stop_state is not None:
                raise HoraError(f"session {session_id} is not running")
            if not 0 <= rank < len(attempt.ranks):
                last = len(attempt.ranks) - 1
                raise SpecError("rank", f"session {session_id} has ranks 0..{last}")
            now = time.time()
            attempt.codes = [rank_status(r) for r in attempt.ranks]
            self._keep_engines(attempt, now)
            if rank not in attempt.lost:
                raise HoraError(f"rank {rank}'s engine of session {session_id} is running")
            runtime = self._runtime(attempt.plan.spec.runtime.value)
            try:
                new = runtime.replace_rank(attempt.plan, rank, self._base_env, master_port)
            except OSError as e:
                raise HoraError(f"could not start a new engine for rank {rank}: {e}") from None
            attempt.ranks[rank] = new
            del attempt.lost[rank]
            event = f"rank {rank}: new engine started (asked by the notebook; port {master_port})"
            self._write(Write(session_id, JobState.running, now, event, event=True))
        self._wake.set()
        found = self._record(session_id)
        assert found is not None
        return found

    def _watch_preflight(
        self, attempt: Attempt, now: float, force: bool = False
    ) -> PreflightFigures | None:
        """Name the attempt's preflight in its events once rank 0 logged it; its figures.

        A job's ranks log it at ``hvd.init()`` when asked (``preflight_env``); a session's
        rank 0 engine when ``%dist_start`` measures (unless ``--no-preflight``).
        """
        if not attempt.plan.preflight_env and attempt.kind != "session":
            return None
        plan = attempt.plan
        ended = [c for r, c in enumerate(attempt.codes) if r not in attempt.lost]
        force = force or any(c is not Exit.running for c in ended)
        found = self.preflight.poll(attempt.job_id, plan.attempt, plan.log_path(0), now, force)
        if found is not None:
            self._write(Write(attempt.job_id, JobState.running, now, found.event(), event=True))
        return self.preflight.known(attempt.job_id, plan.attempt)

    def _cleared(self, attempt: Attempt, now: float) -> bool:
        """Every rank has ended: kill what is left of the attempt; True once nothing is.

        Until then the attempt keeps its slots (a leftover process may hold a GPU); one that
        cannot be emptied within ``clear_timeout_s`` is logged as stuck, and still held.
        """
        try:
            runtime = self._runtime(attempt.plan.spec.runtime.value)
        except HoraError:  # it never started (no such runtime here): only its cgroup is left
            box = attempt.plan.container
            try:
                empty = box is None or box.clear()
            except OSError as e:
                log.warning("job %d: cannot clear its cgroup: %s", attempt.job_id, e)
                empty = False
        else:
            empty = runtime.clear(attempt.plan)
        if empty:
            return True
        if attempt.clearing_since is None:
            attempt.clearing_since = now
        elif now - attempt.clearing_since > self.settings.clear_timeout_s:
            if not attempt.stuck_reported:
                attempt.stuck_reported = True
                log.error(
                    "job %d attempt %d: processes are left after %.0fs of killing; its slots "
                    "%s stay held until they are gone",
                    attempt.job_id, attempt.plan.attempt, now - attempt.clearing_since,
                    list(attempt.plan.slots),
                )  # fmt: skip
        return False

    def _finish(self, attempt: Attempt, state: JobState, reason: str | None, now: float) -> None:
        """The attempt's processes are all gone: free its slots and record the outcome."""
        del self._attempts[attempt.job_id]
        self._dirty = True
        attempt.count(self.usage, now)
        figures = self._watch_preflight(attempt, now, force=True)  # every rank has ended
        self.preflight.done(attempt.job_id, attempt.plan.attempt)
        if figures is not None and state == JobState.failed:
            reason = figures.explain(reason or "")  # a crossed threshold names its rank
        heir = self._handoffs.pop(attempt.job_id, None)
        if heir in self._pending:  # the session's slots go straight to the job it handed to
            self._launch(heir, attempt.plan.slots[: self._pending[heir][0].need])
        codes = {r: (c if isinstance(c, int) else None) for r, c in enumerate(attempt.codes)}
        spec = attempt.plan.spec
        if (
            state == JobState.failed
            and attempt.retriable
            and attempt.plan.attempt <= spec.max_retries
        ):
            delay = self.settings.retry_backoff_s * 2 ** (attempt.plan.attempt - 1)
            self._set_state(
                attempt.job_id, JobState.retrying, now, reason,
                exit_codes=codes, slots=[], retry_at=now + delay,
            )  # fmt: skip
            self._enqueue(attempt.job_id, attempt.user, spec, now + delay)
            return
        self._set_state(
            attempt.job_id, state, now, reason, exit_codes=codes, slots=[], finished_at=now
        )

    def _schedule(self, now: float) -> None:
        t0 = time.perf_counter()
        ready = [p for p, due in self._pending.values() if due is None or due <= now]
        running = collections.Counter(a.user for a in self._attempts.values())
        ready = within_running_limit(ready, running, self.settings.max_running_jobs_per_user)
        # jobs whose runtime owns its resources (slurm) take none of the service's slots
        outside = [p for p in ready if p.need == 0]
        ready = [p for p in ready if p.need > 0]
        held = {s for a in self._attempts.values() for s in a.plan.slots}
        free = [s.index for s in self.inventory if s.index not in held]
        holding = [
            Holding(a.job_id, a.user, a.plan.slots, a.deadline if a.deadline else INF)
            for a in self._attempts.values()
        ]
        used: dict[str, int] = {}
        for a in self._attempts.values():
            used[a.user] = used.get(a.user, 0) + len(a.plan.slots)
        quotas = self._quotas()
        default = self.settings.user_gpu_quota
        limit = None if default is None and not quotas else lambda u: quotas.get(u, default)
        placements = schedule(ready, free, holding, now, limit, used)
        self._last_pass_s = time.perf_counter() - t0
        placed = {s for p in placements for s in p.slots}
        # slots nobody waits for: elastic jobs grow into them (up to their max_workers)
        spare = [s for s in free if s not in placed] if len(placements) == len(ready) else []
        for placement in placements:
            self._launch(placement.job_id, placement.slots, spare)
        for p in outside:
            self._launch(p.id, ())
        if spare:
            self._grow(spare, now)
        elif len(placements) < len(ready):
            waiting = sorted((p for p in ready if p.id not in {x.job_id for x in placements}),
                             key=queue_order)  # fmt: skip
            self._shrink_for(waiting[0], len(free) - len(placed), now)

    def _shrink_for(self, head: Pending, free: int, now: float) -> None:
        """Shrink lower-priority elastic jobs (down to their min) so that ``head`` fits."""
        runs = [a for a in self._attempts.values() if a.elastic is not None]
        if any(a.elastic.target is not None for a in runs if a.elastic is not None):
            return  # a shrink is under way: its slots come first
        if self._room_in_quota(head.user) < head.need:
            return  # it waits for its user's own jobs, not for slots
        lower = sorted(
            (a for a in runs if a.stop_state is None
             and PRIORITY_RANK[a.plan.spec.priority] < head.priority),
            key=lambda a: (PRIORITY_RANK[a.plan.spec.priority], -a.started),
        )  # fmt: skip
        short, cuts = head.need - free, []
        for a in lower:
            spec = a.plan.spec
            assert spec.elastic is not None
            g = spec.gpus_per_worker
            give = min(len(a.plan.slots) - spec.elastic.min_workers * g, -(-short // g) * g)
            if give > 0 and short > 0:
                cuts.append((a, len(a.plan.slots) - give))
                short -= give
        if short > 0:
            return  # shrinking would not let it start: nobody is disturbed
        for a, keep in cuts:
            assert a.elastic is not None
            why = f"shrinking to {keep} slot(s): job {head.id} of higher priority needs them"
            a.elastic.shrink(keep, why, now)
            self._offer(a.plan, keep)
            self._write(Write(a.job_id, None, now, None, {"elastic": a.elastic.info}))

    def _release(self, attempt: Attempt, now: float) -> None:
        """A shrink is done: the slots its workers left are free."""
        run = attempt.elastic
        assert run is not None and run.target is not None
        plan, keep = attempt.plan, run.target
        gone = ", ".join(map(str, plan.slots[keep:]))
        attempt.count(self.usage, now)
        attempt.plan = replace(plan, slots=plan.slots[:keep])
        run.target = None
        run.granted(keep, f"gave back slot(s) {gone}", now)
        self._write(Write(attempt.job_id, None, now, None,
                          {"slots": list(attempt.plan.slots), "elastic": run.info}))  # fmt: skip
        self._dirty = True

    def _room(self, user: str, spec: JobSpec, held: int, spare: list[int]) -> int:
        """Slots an elastic job holding ``held`` may take from ``spare`` (whole workers)."""
        assert spec.elastic is not None
        g = spec.gpus_per_worker
        room = min(spec.elastic.max_workers * g - held, len(spare))
        return max(0, min(room, self._room_in_quota(user)) // g * g)

    def _room_in_quota(self, user: str) -> int:
        """Slots ``user``'s jobs may still take under their quota."""
        quota = self.quota_of(user)
        if quota is None:
            return len(self.inventory)
        return quota - sum(len(a.plan.slots) for a in self._attempts.values() if a.user == user)

    def _grow(self, spare: list[int], now: float) -> None:
        """Offer spare slots to running elastic jobs, oldest first; the world grows at a commit."""
        for attempt in sorted(self._attempts.values(), key=lambda a: a.started):
            run = attempt.elastic
            if run is None or run.target is not None or attempt.stop_state is not None:
                continue
            if not spare:
                break
            plan = attempt.plan
            take = self._room(attempt.user, plan.spec, len(plan.slots), spare)
            if take == 0:
                continue
            extra, spare[:] = spare[:take], spare[take:]
            attempt.count(self.usage, now)
            attempt.plan = plan = replace(plan, slots=plan.slots + tuple(extra))
            try:
                self._offer(plan)
            except OSError as e:  # the slots stay held; the next write of the file offers them
                log.warning("job %d: cannot offer slots %s: %s", attempt.job_id, extra, e)
            g = plan.spec.gpus_per_worker
            names = ", ".join(map(str, extra))
            run.granted(len(plan.slots), f"slot(s) {names} freed: room for "
                        f"{len(plan.slots) // g} workers", now)  # fmt: skip
            self._write(Write(attempt.job_id, None, now, None,
                              {"slots": list(plan.slots), "elastic": run.info}))  # fmt: skip

    def _widen(
        self, job: JobRecord, slots: tuple[int, ...], spare: list[int] | None
    ) -> tuple[int, ...]:
        """An elastic job starts with what is free (``spare``), up to its max."""
        if job.spec.elastic is None or not spare:
            return slots
        take = self._room(job.user, job.spec, len(slots), spare)
        slots, spare[:] = slots + tuple(spare[:take]), spare[take:]
        return slots

    def _reoffer(self, plan: AttemptPlan) -> None:
        """Offer a re-adopted driver the slots the store says it holds.

        A shrink or a grant the service was making when it stopped is undone (a shrink starts
        again if a job still waits for the slots).
        """
        try:
            self._offer(plan)
        except OSError as e:
            log.warning("job %d: cannot rewrite its slot file: %s", plan.job_id, e)

    def _elastic_run(self, job: JobRecord, plan: AttemptPlan, now: float) -> ElasticRun | None:
        if not plan.driver:
            return None
        return ElasticRun.begin(job.spec, plan.log_path(0), len(plan.slots), now, job.elastic)

    def _offer(self, plan: AttemptPlan, slots: int | None = None) -> None:
        """Write an elastic driver's slot file: one worker per whole set of ``slots`` slots."""
        if not plan.driver:
            return
        prepare_run_dir(plan)
        gid = plan.run_as.gid if plan.run_as is not None else os.getegid()
        n = len(plan.slots) if slots is None else slots
        write_hosts(plan.run_dir / HOSTS_FILE, n // plan.spec.gpus_per_worker, gid)

    def _launch(self, job_id: int, slots: tuple[int, ...], spare: list[int] | None = None) -> None:
        job = self._record(job_id)
        entry = self._pending.pop(job_id)
        if job is None:
            return
        n = job.attempt + 1
        now = time.time()
        slots = self._widen(job, slots, spare)
        starting = Write(
            job_id, JobState.starting, now, None,
            {"attempt": n, "slots": list(slots), "exit_codes": {}, "retry_at": None,
             "cancel_requested": 0, "container_id": None},
        )  # fmt: skip
        if not self._write(starting):
            # no process starts before the store knows (a restart must not start it twice)
            self.journal.discard(starting)
            self._pending[job_id] = entry
            self._dirty = True
            return
        try:  # the user's limits come from the store: a sick store starts nothing
            plan = self._plan(job, n, slots, self.settings.work_root, 0)
        except SQLAlchemyError as e:
            log.warning("job %d: the store cannot be read (%s); it waits to start", job_id, e)
            self._pending[job_id] = entry
            self._dirty = True
            return
        retry = True
        try:
            who = self.users.run_as(job.user_id) if self.user_mode == "multi" else None
            workdir = self.workdir(job.spec, job.user)
            plan = self._plan(job, n, slots, workdir, free_port(), who)
            try:
                self.bounds.preflight(job.spec, workdir, who, self._driver_python(job.spec))
            except SpecError:
                retry = False  # the job's account cannot start it: a retry would not either
                raise
            runtime = self._runtime(job.spec.runtime.value)
            self._offer(plan)
            ranks = runtime.start(plan, self._base_env)
        except (OSError, HoraError) as e:
            reason = f"could not start the ranks: {e}"
            log.warning("job %d: %s", job_id, reason)
            # whatever did start is killed and cleared before the slots are free
            self._attempts[job_id] = attempt = Attempt(
                job_id, job.user, plan, [], now, None, kind=job.kind
            )
            attempt.stop(JobState.failed, reason, now, 0.0, retry=retry)
            self._poll(attempt, now)
            return
        started = time.time()
        attempt = Attempt(
            job_id, job.user, plan, ranks, started, None, kind=job.kind,
            created=job.created_at.timestamp(), elastic=self._elastic_run(job, plan, started),
        )  # fmt: skip
        self._attempts[job_id] = attempt
        if runtime.queues and any(r.pending_reason is not None for r in ranks):
            attempt.held = True  # `starting` until the runtime's queue lets it run
            self._write(Write(job_id, None, attempt.started, None, _box_of(ranks)))
        else:
            self._running(attempt)

    def _running(self, attempt: Attempt) -> None:
        """Record ``attempt`` running from now: its time limit starts, its queue wait ends."""
        running = attempt.started = time.time()
        attempt.held = False
        timeout = attempt.plan.spec.timeout_s
        attempt.deadline = running + timeout if timeout else None
        more = {"elastic": attempt.elastic.info} if attempt.elastic is not None else {}
        self._set_state(
            attempt.job_id, JobState.running, running, None,
            started_at=running, **_box_of(attempt.ranks), **more,
        )  # fmt: skip
        if attempt.plan.attempt == 1:
            latency = running - attempt.created
            self._latencies.append(latency)
            self._latency_sum += latency
            self._latency_count += 1
            self.usage.started(attempt.user, attempt.plan.spec.priority.value, latency)

    def _plan(
        self,
        job: JobRecord,
        attempt: int,
        slots: Sequence[int],
        workdir: Path,
        port: int,
        run_as: identity.RunAs | None = None,
    ) -> AttemptPlan:
        if self._containment is None:
            self._containment = detect(self.settings.containment, self.settings.data_dir)
            log.info("attempts are contained by %s", self._containment.kind)
        run_dir = self.settings.logs_dir / str(job.id) / str(attempt)
        driver: tuple[str, ...] = ()
        sized = 0
        if job.spec.elastic is not None:
            sized = job.spec.elastic.max_workers * job.spec.gpus_per_worker
            workers = len(slots) // job.spec.gpus_per_worker
            driver = tuple(driver_argv(job.spec, workers, str(self._driver_python(job.spec))))
        return AttemptPlan(
            job_id=job.id,
            attempt=attempt,
            spec=job.spec,
            slots=tuple(slots),
            slot_kind=self._kind,
            run_dir=run_dir,
            workdir=workdir,
            master_port=port,
            run_as=run_as,
            container=self._containment.container(job.id, attempt),
            log_bytes=self.settings.log_bytes_per_attempt,
            # an elastic attempt's cgroup is sized for what it may grow to
            limits=self.bounds.limits(job.user, max(len(slots), sized)),
            umask=int(self.settings.job_umask, 8),
            preflight_env=self._preflight_env(job.kind),
            rdzv_secret=new_rdzv_secret(),
            private_network=self.settings.job_private_network and job.kind != "session",
            work_root=self.settings.work_root,
            tmp_paths=tuple(self.settings.job_tmp_paths),
            driver=driver,
        )

    def _preflight_env(self, kind: str) -> tuple[tuple[str, str], ...]:
        s = self.settings
        if kind == "job" and not s.job_preflight:
            return ()
        # a session's engines are measured by %dist_start, not at init: no HORA_PREFLIGHT
        env = [("HORA_PREFLIGHT", "1")] if kind == "job" else []
        if s.job_preflight_fail_below is not None:
            env.append(("HORA_PREFLIGHT_FAIL_BELOW", f"{s.job_preflight_fail_below:g}"))
        if s.job_preflight_baseline_dir is not None:
            env.append(("HORA_PREFLIGHT_BASELINE", str(s.job_preflight_baseline_dir)))
        return tuple(env)

    # recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        """Re-adopt, finish or fail the attempts an earlier run of the service left behind."""
        store = self.open_store()
        now = time.time()
        cancelling = store.cancel_requested()
        grace = self.settings.kill_grace_s
        for job in store.jobs_in((JobState.starting, JobState.running)):
            plan = self._plan(job, job.attempt, job.slots, self.settings.work_root, 0)
            ranks = self._runtime(job.spec.runtime.value).adopt(plan)
            started = job.started_at.timestamp() if job.started_at else now
            timeout = job.spec.timeout_s
            attempt = Attempt(
                job.id, job.user, plan, ranks, started, started + timeout if timeout else None,
                kind=job.kind, created=job.created_at.timestamp(),
            )  # fmt: skip
            if plan.driver and job.elastic is not None:  # its membership, read on from the log
                g = job.spec.gpus_per_worker
                attempt.elastic = ElasticRun(job.elastic, plan.log_path(0), g)
                self._reoffer(plan)
            self._attempts[job.id] = attempt
            if job.id in cancelling:
                attempt.stop(JobState.cancelled, "cancelled by the user", now, grace, False)
            elif job.state == JobState.starting and self._held(job.spec.runtime.value, ranks):
                attempt.held = True  # still in the runtime's queue, or started meanwhile
            elif job.state == JobState.starting:
                reason = "the service stopped while the job was starting"
                attempt.stop(JobState.failed, reason, now, grace, retry=True)
        for job_id, user, need, priority, spec_json, retry_at in store.pending_rows():
            spec = JobSpec.model_validate_json(spec_json)
            self._pending[job_id] = (
                Pending(job_id, user, 0 if _outside(spec) else need, priority, spec.timeout_s),
                retry_at,
            )
        self._dirty = True
        if self._attempts or self._pending:
            log.info(
                "recovered %d active and %d queued job(s)", len(self._attempts), len(self._pending)
            )

    # helpers ----------------------------------------------------------------------------

    def _held(self, runtime: str, ranks: list[RankProcess]) -> bool:
        """A starting job a queueing runtime (Slurm) took: re-adopted, never started twice."""
        try:
            queues = self._runtime(runtime).queues
        except HoraError:
            return False
        return queues and bool(ranks) and all(r.container_id is not None for r in ranks)

    def _enqueue(self, job_id: int, user: str, spec: JobSpec, due: float | None) -> None:
        need = 0 if _outside(spec) else spec.total_gpus
        pending = Pending(job_id, user, need, PRIORITY_RANK[spec.priority], spec.timeout_s)
        with self._lock:
            self._pending[job_id] = (pending, due)
            self._dirty = True
        self._wake.set()

    def _set_state(
        self, job_id: int, state: JobState, now: float, reason: str | None, **fields: object
    ) -> None:
        self._write(Write(job_id, state, now, reason, fields))

    def _write(self, write: Write) -> bool:
        """Record a change: now if the store takes it, else from the journal on a later pass.

        Returns:
            True once it is in the store.
        """
        self.journal.add(write)
        self._forget(write.job_id)
        if len(self.journal) > 1:
            return False  # earlier writes are still waiting; this one goes after them
        return self._flush(RETRY_WRITE_S)

    def _flush(self, timeout_s: float) -> bool:
        """Write every journaled change in one transaction; True when the journal is empty."""
        store = self.open_store()

        def apply(writes: list[Write]) -> None:
            with store.tx(timeout_s) as conn:
                for w in writes:
                    if w.state is not None and w.event:
                        store.add_transition(conn, w.job_id, w.state, w.at, w.reason)
                        continue
                    if w.state is None:
                        store.update_job(conn, w.job_id, **w.fields)
                        continue
                    store.update_job(conn, w.job_id, state=w.state, reason=w.reason, **w.fields)
                    store.add_transition(conn, w.job_id, w.state, w.at, w.reason)

        first_failure = self.journal.failing_since is None
        try:
            written = self.journal.flush(apply, time.time())
        except Exception as e:
            if not is_unavailable(e):
                raise
            if first_failure:
                log.warning(
                    "the store did not take a job state change (%s); the monitor keeps the "
                    "jobs' state in memory and retries on every pass", self.journal.error
                )  # fmt: skip
            return False
        if written and not first_failure:
            log.warning("the store took the %d job(s) whose changes waited", len(written))
        for job_id in written:
            self._forget(job_id)
        return True

    def _record(self, job_id: int) -> JobRecord | None:
        """One job from the store with its journaled changes (the monitor's truth)."""
        record = self.open_store().get(job_id)
        return None if record is None else self.journal.overlay(record)

    def _quotas(self) -> dict[str, int]:
        """User -> their own GPU quota, for the users that have one (one query a pass).

        While the store cannot be read, the last answer stands.
        """
        try:
            users = self.open_store().users()
        except Exception as e:
            if not is_unavailable(e):
                raise
            return self._quota_memo
        self._quota_memo = {u.name: u.gpu_quota for u in users if u.gpu_quota is not None}
        return self._quota_memo

    def _runtime(self, name: str) -> Runtime:
        if name not in self._runtimes:
            self._runtimes[name] = runtimes.create(name, self.settings)
            self._runtimes[name].waits = self.waits
        return self._runtimes[name]
