"""The job manager's state and its journaled writes, which every collaborator is handed.

:class:`ManagerState` holds what the manager knows (slots, queue, attempts, caches, the
journal, the store), opens the store, and records every change: to the store when it takes
it, else to the journal (:mod:`hora_service.store.journal`), retried on later passes of the monitor.
The collaborators of :class:`~hora_service.manager.JobManager` (admission, launch, monitor,
recovery, elastic slots, the read views) each receive it; none holds state of another.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable

from hora.inventory import Slot, inventory
from hora.kinds import HolderKind
from hora.leases import LeaseDir, LeaseHolder, default_dir
from hora.spec import PRIORITY_RANK, JobSpec, JobState, RuntimeName

from hora_service import identity, runtimes
from hora_service.jobs.attempt import Attempt, runs_outside
from hora_service.jobs.bounds import Bounds
from hora_service.jobs.leases import DataDirLock, SlotLeases
from hora_service.jobs.pending import PendingQueue
from hora_service.jobs.preflight_book import PreflightBook
from hora_service.models import JobRecord, User
from hora_service.runtimes import Runtime
from hora_service.runtimes.containment import Containment, instance_id
from hora_service.runtimes.core import allowed_env
from hora_service.scheduling.reasons import ReasonBoard
from hora_service.scheduling.scheduler import Pending
from hora_service.settings import Settings
from hora_service.store.db import Store, is_unavailable
from hora_service.store.journal import Journal, Write
from hora_service.users.registry import Users
from hora_service.users.usage import Usage

log = logging.getLogger(__name__)

LATENCY_WINDOW = 1000
CACHE_MAX = 50_000
PAGES_MAX = 1024
STOP_JOIN_S = 30.0
RETRY_WRITE_S = 0.25  # how long one pass of the monitor waits for the store's write lock


class ManagerState:
    """The job manager's state, its store and its journaled writes, which every role uses.

    Its fields are the manager's data; the lock (:attr:`lock`) guards the queue
    (:attr:`pending`), the attempts (:attr:`attempts`) and what a monitor pass changes.

    Args:
        settings: the service settings.
        runtimes: runtimes by name to use instead of building them from the registry.
    """

    def __init__(self, settings: Settings, runtimes: dict[str, Runtime] | None = None) -> None:
        self.settings = settings
        self.store: Store | None = None
        self.inventory: list[Slot] = inventory(settings.gpus, settings.cpu_slots)
        self.slot_kind = self.inventory[0].kind
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.pending = PendingQueue()
        self.attempts: dict[int, Attempt] = {}
        self.dirty = True
        self.runtimes: dict[RuntimeName, Runtime] = {
            RuntimeName(k): v for k, v in (runtimes or {}).items()
        }
        self.base_env = allowed_env(os.environ, settings.job_env_passthrough)
        self.users = Users(
            identity.resolve_mode(settings.user_mode), self.open_store, settings.work_root,
            settings.disk_bytes,
        )  # fmt: skip
        self.bounds = Bounds(settings, self.users, self.base_env, len(self.inventory))
        self.containment: Containment | None = None
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.last_pass_s = 0.0
        # job id -> (record, its JSON); dropped on every write to the job (see forget)
        self.cache: dict[int, tuple[JobRecord, bytes]] = {}
        self.cache_lock = threading.Lock()
        self.generation = 0  # moves on at every write to the jobs table
        self.pages: dict[tuple[object, ...], tuple[int, list[int], int]] = {}
        self.journal = Journal()  # state changes the store has not taken yet
        self._quota_memo: dict[str, int] = {}
        # during a monitor pass: (its thread, the quotas read in it, once read)
        self.pass_quotas: tuple[int, dict[str, int] | None] | None = None
        # called with the time at the end of every monitor pass (sessions' leases, idle culling)
        self.hooks: list[Callable[[float], None]] = []
        self.waits = ReasonBoard()  # reasons runtimes post for jobs they hold back
        for given in self.runtimes.values():
            given.waits = self.waits
        self.usage = Usage()  # queue waits and slot-hours by user, for /metrics
        self.preflight = PreflightBook()  # the jobs' preflight figures, for pages and /metrics
        self.handoffs: dict[int, int] = {}  # session id -> the job that takes its slots
        # the machine's leases of this service's slots, and who else holds free ones
        me = {"kind": HolderKind.service.value, "url": settings.url,
              "instance": instance_id(settings.data_dir)}  # fmt: skip
        lease_dir = LeaseDir(settings.lease_dir or default_dir())
        self.leases = SlotLeases(lease_dir, self.inventory, me)
        self.foreign: dict[int, LeaseHolder] = {}  # slot -> its holder (last pass)
        self.data_lock = DataDirLock(settings.data_dir, settings.url)
        self.dropped: set[int] = set()  # sessions their owners deleted, rows not removed yet

    def open_store(self) -> Store:
        """Open (and migrate) the SQLite store if it is not open yet."""
        if self.store is None:
            self.make_dirs()
            self.store = Store(self.settings.db_path)
        return self.store

    def make_dirs(self) -> None:
        """Make the data and log directories (the service's alone, mode 0700)."""
        for d in (self.settings.data_dir, self.settings.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o700)  # the service's alone: jobs never read the store or others' logs

    def close_store(self) -> None:
        """Close the store's connections."""
        if self.store is not None:
            self.store.close()
            self.store = None

    # users ------------------------------------------------------------------------------

    @property
    def user_mode(self) -> str:
        """The user mode in effect: ``multi``, ``single`` or ``shared``."""
        return self.users.mode

    def quota_of(self, user: str, account: User | None = None) -> int | None:
        """Most slots ``user``'s jobs and sessions may hold (None: no limit).

        ``account``: ``user``'s row as a request already read it (the users are not read
        again); a row of another user is ignored.
        """
        if account is not None and account.name == user:
            own = account.gpu_quota
            return own if own is not None else self.settings.user_gpu_quota
        return self.quotas().get(user, self.settings.user_gpu_quota)

    def quota_table(self) -> Callable[[str], int | None]:
        """:meth:`quota_of` for many users at once: the users are read once, here."""
        quotas, default = self.quotas(), self.settings.user_gpu_quota
        return lambda user: quotas.get(user, default)

    def forget(self, job_id: int) -> None:
        """Drop a job's cached read; every cached page goes too (the generation moves on)."""
        with self.cache_lock:
            self.generation += 1
            self.cache.pop(job_id, None)

    def enqueue(self, job_id: int, user: str, spec: JobSpec, due: float | None) -> None:
        """Queue a job (``due``: not before then) and wake the monitor."""
        need = 0 if runs_outside(spec) else spec.total_gpus
        pending = Pending(job_id, user, need, PRIORITY_RANK[spec.priority], spec.timeout_s)
        with self.lock:
            self.pending[job_id] = (pending, due)
            self.dirty = True
        self.wake.set()

    def set_state(
        self, job_id: int, state: JobState, now: float, reason: str | None, **fields: object
    ) -> None:
        """Record a job's new state (and ``fields``) as :meth:`write` does."""
        self.write(Write(job_id, state, now, reason, fields))

    def write(self, write: Write) -> bool:
        """Record a change: now if the store takes it, else from the journal on a later pass.

        Returns:
            True once it is in the store.
        """
        self.journal.add(write)
        self.forget(write.job_id)
        if len(self.journal) > 1:
            return False  # earlier writes are still waiting; this one goes after them
        return self.flush(RETRY_WRITE_S)

    def flush(self, timeout_s: float) -> bool:
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
            self.forget(job_id)
        return True

    def record(self, job_id: int) -> JobRecord | None:
        """One job from the store with its journaled changes (the monitor's truth)."""
        record = self.open_store().get(job_id)
        return None if record is None else self.journal.overlay(record)

    def quotas(self) -> dict[str, int]:
        """User -> their own GPU quota, for the users that have one (one query a pass).

        While the store cannot be read, the last answer stands. Within one monitor pass the
        users are read once (on the pass's own thread; a request reads them afresh).
        """
        memo = self.pass_quotas
        in_pass = memo is not None and memo[0] == threading.get_ident()
        if memo is not None and in_pass and memo[1] is not None:
            return memo[1]
        try:
            users = self.open_store().users()
        except Exception as e:
            if not is_unavailable(e):
                raise
            return self._quota_memo
        self._quota_memo = {u.name: u.gpu_quota for u in users if u.gpu_quota is not None}
        if in_pass:
            self.pass_quotas = (threading.get_ident(), self._quota_memo)
        return self._quota_memo

    def runtime(self, name: RuntimeName) -> Runtime:
        """The runtime ``name``, built from the registry the first time it is asked for.

        Raises:
            HoraError: the runtime is not available here.
        """
        if name not in self.runtimes:
            self.runtimes[name] = runtimes.create(name, self.settings)
            self.runtimes[name].waits = self.waits
        return self.runtimes[name]
