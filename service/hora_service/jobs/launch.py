"""Launching: starting a placed job's attempt on its runtime.

The store learns that the job is ``starting`` before any process starts (a restart must
not start it twice); the attempt's plan (:class:`~hora_service.runtimes.AttemptPlan`) is
built from the job, its slots and the service's settings, and handed to the runtime. A
start that fails is stopped and cleared like any failed attempt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hora.env import RankEnv, new_rdzv_secret
from hora.errors import HoraError, SpecError
from hora.net import free_port
from hora.spec import JobKind, JobState
from sqlalchemy.exc import SQLAlchemyError

from hora_service import identity
from hora_service.elastic import driver_argv
from hora_service.jobs.admission import Admission
from hora_service.jobs.attempt import Attempt, container_of, held_reason
from hora_service.jobs.elastic_slots import ElasticSlots
from hora_service.journal import Write
from hora_service.models import JobRecord
from hora_service.runtimes import AttemptPlan, RankProcess
from hora_service.runtimes.containment import Containment, detect
from hora_service.runtimes.paths import JobPaths

log = logging.getLogger(__name__)


class Launch(ElasticSlots, Admission):
    """Starting attempts: the plan, the runtime, the record of running."""

    if TYPE_CHECKING:  # the monitor's (hora_service.jobs.monitor.Monitor)

        def _poll(self, attempt: Attempt, now: float) -> None: ...

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
            try:
                kept = self._checked(job, workdir, who)
            except SpecError:
                retry = False  # the job's account cannot start it: a retry would not either
                raise
            plan = self._plan(job, n, slots, workdir, free_port(), who, kept)
            runtime = self._runtime(job.spec.runtime)
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
        self._started(job, plan, ranks, runtime.name if runtime.queues else None)

    def _started(
        self, job: JobRecord, plan: AttemptPlan, ranks: list[RankProcess], queue: str | None
    ) -> None:
        """The attempt's ranks were started: it runs, or waits in its runtime's ``queue``."""
        started = time.time()
        attempt = Attempt(
            job.id, job.user, plan, ranks, started, None, kind=job.kind,
            created=job.created_at.timestamp(), elastic=self._elastic_run(job, plan, started),
        )  # fmt: skip
        self._attempts[job.id] = attempt
        why = held_reason(ranks, queue) if queue is not None else None
        if why is not None:  # `queued`, with the runtime's reason, until its queue runs it
            attempt.held, attempt.held_why = True, why
            self._write(Write(job.id, JobState.queued, started, why, container_of(ranks)))
        else:
            self._running(attempt)

    def _checked(
        self, job: JobRecord, workdir: Path, who: identity.RunAs | None
    ) -> tuple[Path, ...]:
        """The launch's check as the job's account; what of ``/tmp`` its attempt keeps.

        Raises:
            SpecError: see :meth:`hora_service.bounds.Bounds.start_check`.
        """
        driver = self._driver_python(job.spec)
        return self.bounds.start_check(job.spec, workdir, who, driver, job.kind)

    def _running(self, attempt: Attempt) -> None:
        """Record ``attempt`` running from now: its time limit starts, its queue wait ends."""
        running = attempt.started = time.time()
        attempt.held = False
        timeout = attempt.plan.spec.timeout_s
        attempt.deadline = running + timeout if timeout else None
        more = {"elastic": attempt.elastic.info} if attempt.elastic is not None else {}
        self._set_state(
            attempt.job_id, JobState.running, running, None,
            started_at=running, **container_of(attempt.ranks), **more,
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
        kept: Sequence[Path] = (),
    ) -> AttemptPlan:
        containment = self._contained()
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
            run_dir=JobPaths.of(self.settings.logs_dir, job.id, attempt).run_dir,
            workdir=workdir,
            master_port=port,
            run_as=run_as,
            container=containment.container(job.id, attempt),
            log_bytes=self.settings.log_bytes_per_attempt,
            # an elastic attempt's cgroup is sized for what it may grow to
            limits=self.bounds.limits(job.user, max(len(slots), sized)),
            umask=int(self.settings.job_umask, 8),
            preflight_env=self._preflight_env(job.kind),
            rdzv_secret=new_rdzv_secret(),
            private_network=self.settings.job_private_network and job.kind != JobKind.session,
            work_root=self.settings.work_root,
            tmp_paths=tuple(kept),
            tmp_bytes=self.settings.job_tmp_bytes,
            driver=driver,
            # the rank shims hold the leases too: a restart of the service keeps them held
            # while the ranks run (an elastic job's slots change: the service alone holds them)
            leases=() if driver else self.leases.fds(slots),
        )

    def _contained(self) -> Containment:
        """How attempts are contained here (detected once)."""
        if self._containment is None:
            self._containment = detect(self.settings.containment, self.settings.data_dir)
            log.info("attempts are contained by %s", self._containment.kind)
        return self._containment

    def _preflight_env(self, kind: str) -> tuple[tuple[str, str], ...]:
        s = self.settings
        if kind == JobKind.job and not s.job_preflight:
            return ()
        base = s.job_preflight_baseline_dir
        asked = RankEnv(
            # a session's engines are measured by %dist_start, not at init: no HORA_PREFLIGHT
            preflight="1" if kind == JobKind.job else None,
            preflight_fail_below=s.job_preflight_fail_below,
            preflight_baseline=str(base) if base is not None else None,
        )
        return tuple(asked.to_environ().items())
