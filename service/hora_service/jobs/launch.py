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

from hora.env import RankEnv, new_rdzv_secret
from hora.errors import HoraError, SpecError
from hora.net import free_port
from hora.spec import JobKind, JobState
from sqlalchemy.exc import SQLAlchemyError

from hora_service import identity
from hora_service.jobs.admission import Admission
from hora_service.jobs.attempt import Attempt, container_of, held_reason
from hora_service.jobs.elastic_slots import ElasticSlots
from hora_service.jobs.state import ManagerState
from hora_service.models import JobRecord
from hora_service.runtimes import AttemptPlan, RankProcess
from hora_service.runtimes.containment import Containment, detect
from hora_service.runtimes.elastic_run import driver_argv
from hora_service.runtimes.paths import JobPaths
from hora_service.settings import Settings
from hora_service.store.journal import Write

log = logging.getLogger(__name__)


class Launch:
    """Starting attempts: the plan, the runtime, the record of running.

    Args:
        state: the manager's state (the queue, the attempts, the store).
        admission: the checks a job's account passes again at its start.
        elastic: an elastic job's slots (widened at its start, offered to its driver).
    """

    def __init__(self, state: ManagerState, admission: Admission, elastic: ElasticSlots) -> None:
        self.state = state
        self.admission = admission
        self.elastic = elastic

    def launch(
        self, job_id: int, slots: tuple[int, ...], spare: list[int] | None = None
    ) -> Attempt | None:
        """Start queued ``job_id`` on ``slots`` (an elastic one also takes from ``spare``).

        Returns:
            The attempt whose ranks could not start (being stopped, for the monitor to poll
            at once), else None.
        """
        job = self.state.record(job_id)
        entry = self.state.pending.pop(job_id)
        if job is None:
            return None
        n = job.attempt + 1
        now = time.time()
        slots = self.elastic.widen(job, slots, spare)
        starting = Write(
            job_id, JobState.starting, now, None,
            {"attempt": n, "slots": list(slots), "exit_codes": {}, "retry_at": None,
             "cancel_requested": 0, "container_id": None},
        )  # fmt: skip
        if not self.state.write(starting):
            # no process starts before the store knows (a restart must not start it twice)
            self.state.journal.discard(starting)
            self.state.pending[job_id] = entry
            self.state.dirty = True
            return None
        try:  # the user's limits come from the store: a sick store starts nothing
            plan = self.plan(job, n, slots, self.state.settings.work_root, 0)
        except SQLAlchemyError as e:
            log.warning("job %d: the store cannot be read (%s); it waits to start", job_id, e)
            self.state.pending[job_id] = entry
            self.state.dirty = True
            return None
        retry = True
        try:
            who = self.state.users.run_as(job.user_id) if self.state.user_mode == "multi" else None
            workdir = self.admission.workdir(job.spec, job.user)
            try:
                kept = self._checked(job, workdir, who)
            except SpecError:
                retry = False  # the job's account cannot start it: a retry would not either
                raise
            plan = self.plan(job, n, slots, workdir, free_port(), who, kept)
            runtime = self.state.runtime(job.spec.runtime)
            self.elastic.offer(plan)
            ranks = runtime.start(plan, self.state.base_env)
        except (OSError, HoraError) as e:
            reason = f"could not start the ranks: {e}"
            log.warning("job %d: %s", job_id, reason)
            # whatever did start is killed and cleared before the slots are free
            self.state.attempts[job_id] = attempt = Attempt(
                job_id, job.user, plan, [], now, None, kind=job.kind
            )
            attempt.stop(JobState.failed, reason, now, 0.0, retry=retry)
            return attempt
        self._started(job, plan, ranks, runtime.name if runtime.queues else None)
        return None

    def _started(
        self, job: JobRecord, plan: AttemptPlan, ranks: list[RankProcess], queue: str | None
    ) -> None:
        """The attempt's ranks were started: it runs, or waits in its runtime's ``queue``."""
        started = time.time()
        attempt = Attempt(
            job.id, job.user, plan, ranks, started, None, kind=job.kind,
            created=job.created_at.timestamp(), elastic=self.elastic.run_for(job, plan, started),
        )  # fmt: skip
        self.state.attempts[job.id] = attempt
        why = held_reason(ranks, queue) if queue is not None else None
        if why is not None:  # `queued`, with the runtime's reason, until its queue runs it
            attempt.held, attempt.held_why = True, why
            self.state.write(Write(job.id, JobState.queued, started, why, container_of(ranks)))
        else:
            self.running(attempt)

    def _checked(
        self, job: JobRecord, workdir: Path, who: identity.RunAs | None
    ) -> tuple[Path, ...]:
        """The launch's check as the job's account; what of ``/tmp`` its attempt keeps.

        Raises:
            SpecError: see :meth:`hora_service.jobs.bounds.Bounds.start_check`.
        """
        driver = self.admission.driver_python(job.spec)
        return self.state.bounds.start_check(job.spec, workdir, who, driver, job.kind)

    def running(self, attempt: Attempt) -> None:
        """Record ``attempt`` running from now: its time limit starts, its queue wait ends."""
        running = attempt.started = time.time()
        attempt.held = False
        timeout = attempt.plan.spec.timeout_s
        attempt.deadline = running + timeout if timeout else None
        more = {"elastic": attempt.elastic.info} if attempt.elastic is not None else {}
        self.state.set_state(
            attempt.job_id, JobState.running, running, None,
            started_at=running, **container_of(attempt.ranks), **more,
        )  # fmt: skip
        if attempt.plan.attempt == 1:
            latency = running - attempt.created
            self.state.latencies.append(latency)
            self.state.latency_sum += latency
            self.state.latency_count += 1
            self.state.usage.started(attempt.user, attempt.plan.spec.priority.value, latency)

    def plan(
        self,
        job: JobRecord,
        attempt: int,
        slots: Sequence[int],
        workdir: Path,
        port: int,
        run_as: identity.RunAs | None = None,
        kept: Sequence[Path] = (),
    ) -> AttemptPlan:
        """The plan of ``job``'s attempt ``attempt`` on ``slots`` (what its runtime starts)."""
        containment = self.contained()
        driver: tuple[str, ...] = ()
        sized = 0
        if job.spec.elastic is not None:
            sized = job.spec.elastic.max_workers * job.spec.gpus_per_worker
            workers = len(slots) // job.spec.gpus_per_worker
            driver = tuple(
                driver_argv(job.spec, workers, str(self.admission.driver_python(job.spec)))
            )
        return AttemptPlan(
            job_id=job.id,
            attempt=attempt,
            spec=job.spec,
            slots=tuple(slots),
            slot_kind=self.state.slot_kind,
            run_dir=JobPaths.of(self.state.settings.logs_dir, job.id, attempt).run_dir,
            workdir=workdir,
            master_port=port,
            run_as=run_as,
            container=containment.container(job.id, attempt),
            log_bytes=self.state.settings.log_bytes_per_attempt,
            # an elastic attempt's cgroup is sized for what it may grow to
            limits=self.state.bounds.limits(job.user, max(len(slots), sized)),
            umask=int(self.state.settings.job_umask, 8),
            preflight_env=preflight_env(self.state.settings, job.kind),
            rdzv_secret=new_rdzv_secret(),
            private_network=self.state.settings.job_private_network and job.kind != JobKind.session,
            work_root=self.state.settings.work_root,
            tmp_paths=tuple(kept),
            tmp_bytes=self.state.settings.job_tmp_bytes,
            driver=driver,
            # the rank shims hold the leases too: a restart of the service keeps them held
            # while the ranks run (an elastic job's slots change: the service alone holds them)
            leases=() if driver else self.state.leases.fds(slots),
        )

    def contained(self) -> Containment:
        """How attempts are contained here (detected once)."""
        if self.state.containment is None:
            self.state.containment = detect(
                self.state.settings.containment, self.state.settings.data_dir
            )
            log.info("attempts are contained by %s", self.state.containment.kind)
        return self.state.containment


def preflight_env(s: Settings, kind: str) -> tuple[tuple[str, str], ...]:
    """What a rank of a ``kind`` attempt is told of the preflight (settings ``s``)."""
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
