"""Admission: the checks a submission passes, and the commands on a job.

A spec that can never run here (too many slots, over quota, an unavailable runtime, a
working directory outside the work root) or over the service's limits is refused at the
edge; an admitted job is written and queued. Cancel, hand off and delete act on one job.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from hora.errors import HoraError, SpecError
from hora.spec import JobKind, JobSpec, JobState, ParkInfo, RuntimeName, SlotKind
from sqlalchemy import Connection

from hora_service.jobs.attempt import runs_outside
from hora_service.jobs.state import ManagerState
from hora_service.models import JobRecord, User
from hora_service.runtimes.elastic_run import python
from hora_service.runtimes.paths import JobPaths
from hora_service.store.db import Store, StoreUnavailable
from hora_service.store.journal import Write
from hora_service.users.quotas import OverLimit, spec_bytes


class Admission:
    """Submitting, checking, cancelling, handing off and deleting jobs.

    Args:
        state: the manager's state (the store, the queue, the attempts).
    """

    def __init__(self, state: ManagerState) -> None:
        self.state = state

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
        kind: JobKind = JobKind.job,
        also: Callable[[Store, Connection, int], None] | None = None,
        account: User | None = None,
    ) -> tuple[JobRecord, bool]:
        """Queue a job; with a submission id this user used before, find that job instead.

        ``kind`` is ``session`` for a notebook's engines
        (:mod:`hora_service.sessions.session_manager`);
        ``also`` writes what goes with the new row, in the same transaction;
        ``account``: the user as the request read it (its quota is not read again).

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
        store = self.state.open_store()
        self.check(user, spec, kind, account)
        self._check_limits(user, spec)
        # the check and the insert are one write transaction; a store that cannot take it
        # within the timeout answers StoreUnavailable (a 503 with Retry-After), never a hang
        note = self.state.bounds.submit_note(spec)
        with store.tx(self.state.settings.store_write_timeout_s) as conn:
            if spec.submission_id is not None:
                existing = store.job_by_submission(conn, user, spec.submission_id)
                if existing is not None:
                    found = store.get(existing, conn)
                    assert found is not None
                    return found, False
            now = time.time()
            job_id = store.insert_job(conn, user, spec, now, kind, note)
            if also is not None:
                also(store, conn, job_id)
            record = store.get(job_id, conn)
            assert record is not None
        self.state.forget(job_id)  # a new job changes every page it belongs to
        self.state.enqueue(job_id, user, spec, None)
        return record, True

    def _check_limits(self, user: str, spec: JobSpec) -> None:
        size, most = spec_bytes(spec), self.state.settings.max_spec_bytes
        if size > most:
            raise OverLimit("spec", f"the job spec is {size} bytes; the limit is {most}", 413)
        queued = self.state.settings.max_queued_jobs_per_user
        if queued is not None:
            with self.state.lock:
                waiting = self.state.pending.waiting(user)
            if waiting >= queued:
                raise OverLimit(
                    "queued_jobs",
                    f"you have {waiting} jobs waiting in the queue; the limit is {queued}",
                    429,
                )

    def check(
        self, user: str, spec: JobSpec, kind: JobKind = JobKind.job, account: User | None = None
    ) -> None:
        """Refuse a spec that can never run on this service (see :meth:`submit`).

        ``account``: the user ``user`` as the request read it (else the quotas are read).
        """
        total, need = len(self.state.inventory), spec.total_gpus
        unit = "GPUs" if self.state.slot_kind == SlotKind.gpu else "slots"
        field = "workers" if spec.gpus_per_worker == 1 else "gpus_per_worker"
        if need > total and not runs_outside(spec):
            raise SpecError(
                field,
                f"asks for {need} {unit} ({spec.workers} workers x {spec.gpus_per_worker}); "
                f"this cluster has {total}",
            )
        quota = self.state.quota_of(user, account)
        if quota is not None and need > quota:
            raise SpecError(field, f"asks for {need} {unit}; your quota is {quota}")
        self._check_elastic(spec, total, unit)
        who = self.state.users.run_as_of(user) if self.state.user_mode == "multi" else None
        if spec.image is not None and spec.runtime not in (RuntimeName.docker, RuntimeName.slurm):
            raise SpecError("image", "an image is used only by the docker runtime")
        self.state.runtime(spec.runtime).check(spec)
        driver = self.driver_python(spec)
        workdir = self.workdir(spec, user)
        self.state.bounds.start_check(spec, workdir, who, driver, kind, reuse=True)

    def driver_python(self, spec: JobSpec) -> str | None:
        """The Python an elastic job's driver runs with (None for other jobs)."""
        if spec.elastic is None:
            return None
        return str(self.state.settings.session_python or python())

    def _check_elastic(self, spec: JobSpec, total: int, unit: str) -> None:
        """Refuse an elastic job that can never run here, naming the field."""
        e = spec.elastic
        if e is None:
            return
        if spec.runtime != RuntimeName.local:
            raise SpecError("elastic", "elastic jobs run on the local runtime only for now")
        if self.state.slot_kind == SlotKind.gpu:
            raise SpecError("elastic", "elastic jobs run on CPU slots only for now")
        most = e.max_workers * spec.gpus_per_worker
        if most > total:
            raise SpecError(
                "elastic.max_workers",
                f"{e.max_workers} workers x {spec.gpus_per_worker} need {most} {unit}; "
                f"this cluster has {total}",
            )

    def workdir(self, spec: JobSpec, user: str | None = None) -> Path:
        """The ranks' working directory (see :meth:`hora_service.jobs.bounds.Bounds.workdir`).

        Raises:
            SpecError: it escapes the work root or is not an existing directory.
        """
        return self.state.bounds.workdir(spec, user)

    def cancel(self, job_id: int, reason: str = "cancelled by the user") -> JobRecord:
        """Cancel a job; a no-op on a finished one. Running ranks get SIGTERM, then SIGKILL.

        Raises:
            HoraError: there is no such job.
        """
        with self.state.lock:
            job = self.state.record(job_id)
            if job is None:
                raise HoraError(f"job {job_id} not found")
            now = time.time()
            if job_id in self.state.pending or job.state == JobState.parked:
                self.state.pending.pop(job_id, None)
                self.state.set_state(job_id, JobState.cancelled, now, reason, finished_at=now)
            elif job_id in self.state.attempts:
                self.state.attempts[job_id].stop(
                    JobState.cancelled, reason, now, self.state.settings.kill_grace_s, retry=False
                )
                self.state.write(Write(job_id, None, now, None, {"cancel_requested": 1}))
            self.state.dirty = True
        self.state.wake.set()
        found = self.state.record(job_id)
        assert found is not None
        return found

    def park(self, session_id: int, reason: str, park: ParkInfo) -> None:
        """Record a session's committed snapshot and stop its engines; it ends ``parked``.

        A session still queued (asked to resume, not started) is parked at once.

        Raises:
            HoraError: the session is neither running nor queued.
        """
        with self.state.lock:
            now = time.time()
            attempt = self.state.attempts.get(session_id)
            if session_id in self.state.pending:
                del self.state.pending[session_id]
                parked = park.model_copy(update={"phase": "parked"})  # no engines to stop
                self.state.set_state(session_id, JobState.parked, now, reason, park=parked)
            elif attempt and attempt.kind == JobKind.session and attempt.stop_state is None:
                self.state.write(Write(session_id, None, now, None, {"park": park}))
                attempt.stop(JobState.parked, reason, now, self.state.settings.kill_grace_s, False)
            else:
                raise HoraError(f"session {session_id} is not running")
            self.state.dirty = True
        self.state.wake.set()

    def requeue(
        self, session_id: int, user: str, spec: JobSpec, reason: str, park: ParkInfo
    ) -> None:
        """Queue a parked session again with ``spec`` (its engines resume from ``park``)."""
        with self.state.lock:
            now = time.time()
            fields = {"spec": spec, "need": spec.total_gpus, "park": park, "retry_at": None}
            self.state.write(Write(session_id, JobState.queued, now, reason, fields))
        self.state.enqueue(session_id, user, spec, None)

    def set_park(self, session_id: int, park: ParkInfo | None) -> None:
        """Record (None: forget) a session's snapshot without changing its state."""
        with self.state.lock:
            self.state.write(Write(session_id, None, time.time(), None, {"park": park}))

    def handoff(self, session_id: int, user: str, spec: JobSpec) -> JobRecord:
        """Submit ``spec`` for ``user`` and give it the running session's slots.

        The session is stopped; once its processes are gone the job starts on its slots,
        before the next scheduling pass (no queued job can take them in between).

        Raises:
            HoraError: the session is not running.
            SpecError: the job needs more slots than the session holds, or cannot run here.
        """
        with self.state.lock:
            attempt = self.state.attempts.get(session_id)
            if attempt is None or attempt.kind != JobKind.session or attempt.stop_state is not None:
                raise HoraError(f"session {session_id} is not running; submit the job instead")
            have, field = len(attempt.plan.slots), "workers"
            if spec.total_gpus > have:
                raise SpecError(field, f"asks for {spec.total_gpus} slots; the session has {have}")
            job, _ = self.submit_or_find(user, spec)
            self.state.handoffs[session_id] = job.id
        self.cancel(session_id, reason=f"stopped: its slots were handed to job {job.id}")
        return job

    def drop_session(self, job_id: int, reason: str) -> JobRecord:
        """Stop a session and delete it: gone from every read at once.

        Its row and logs go once its engines have (the monitor's pass removes them; a
        restart finds it again, :meth:`Store.dropped_sessions`).

        Returns:
            The session as it stood when it was deleted.

        Raises:
            HoraError: there is no such job.
        """
        job = self.cancel(job_id, reason=reason)
        self.state.open_store().drop_session(job_id)
        with self.state.lock:
            self.state.dropped.add(job_id)
            self.state.forget(job_id)
            self.remove_dropped()
        return job

    def remove_dropped(self) -> None:
        """Remove the rows and logs of dropped sessions whose engines are gone (lock held)."""
        for job_id in sorted(self.state.dropped):
            if job_id in self.state.attempts or job_id in self.state.pending:
                continue
            try:
                self.delete(job_id)
            except HoraError:  # its end is not recorded yet: a later pass
                continue
            self.state.dropped.discard(job_id)

    def delete(self, job_id: int) -> None:
        """Remove a finished job and its logs.

        Raises:
            HoraError: the job is still active.
            StoreUnavailable: the store has not taken the job's end yet.
        """
        store = self.state.open_store()
        with self.state.lock:
            job = self.state.record(job_id)
            if job is None:
                return
            if not job.state.terminal:
                raise HoraError(f"job {job_id} is {job.state.value}; cancel it first")
            if self.state.journal.pending(job_id):  # its end is not recorded yet: keep the row
                why = self.state.journal.error
                raise StoreUnavailable(f"job {job_id}'s end is not recorded yet ({why})")
            store.delete_job(job_id)
            self.state.forget(job_id)
        shutil.rmtree(JobPaths.job_dir_of(self.state.settings.logs_dir, job_id), ignore_errors=True)

    def log_path(self, job_id: int, rank: int, attempt: int) -> Path:
        """The log file of one rank of one attempt (built from integers only).

        Raises:
            SpecError: a negative rank or attempt.
        """
        if rank < 0:
            raise SpecError("rank", "must be >= 0")
        if attempt < 0:
            raise SpecError("attempt", "must be >= 0")
        return JobPaths.of(self.state.settings.logs_dir, job_id, attempt).log(rank)

    def preflight_path(self, job_id: int, attempt: int) -> Path:
        """The preflight's figures of one attempt (``preflight.json``, built from integers)."""
        return JobPaths.of(self.state.settings.logs_dir, job_id, attempt).preflight
