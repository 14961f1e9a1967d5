"""Recovery after a restart: re-adopting the attempts an earlier run of the service left.

Ranks still alive are adopted again, attempts a queueing runtime (Slurm) still holds stay
``queued`` there (a queued job with a container id was handed to that runtime: it is adopted,
never submitted again), and attempts caught while starting are failed (then retried per
policy); the queue is read back from the store; what any other
attempt of this service left on the machine (cgroups, processes, private temporary directories)
is reaped (:mod:`hora_service.runtimes.strays`).
"""

from __future__ import annotations

import logging
import time

from hora.errors import HoraError
from hora.spec import JobSpec, JobState, RuntimeName

from hora_service.jobs.attempt import Attempt, runs_outside
from hora_service.jobs.elastic_slots import ElasticSlots
from hora_service.jobs.launch import Launch
from hora_service.jobs.state import ManagerState
from hora_service.runtimes import RankProcess, strays
from hora_service.runtimes.elastic_run import ElasticRun
from hora_service.scheduling.scheduler import Pending

log = logging.getLogger(__name__)


class Recovery:
    """Re-adopting, finishing or failing attempts found at start.

    Args:
        state: the manager's state (the queue and the attempts it fills).
        launch: how an attempt's plan is made and its containment found.
        elastic: an elastic job's slots (offered again to its re-adopted driver).
    """

    def __init__(self, state: ManagerState, launch: Launch, elastic: ElasticSlots) -> None:
        self.state = state
        self.launch = launch
        self.elastic = elastic

    def recover(self) -> None:
        """Re-adopt, finish or fail the attempts an earlier run of the service left behind."""
        store = self.state.open_store()
        now = time.time()
        cancelling = store.cancel_requested()
        self.state.dropped |= store.dropped_sessions()  # removed once their engines are gone
        grace = self.state.settings.kill_grace_s
        # a queued job with a container (a Slurm job) was handed over: its runtime queues it
        handed = [j for j in store.jobs_in((JobState.queued,)) if j.container_id]
        for job in [*store.jobs_in((JobState.starting, JobState.running)), *handed]:
            plan = self.launch.plan(job, job.attempt, job.slots, self.state.settings.work_root, 0)
            ranks = self.state.runtime(job.spec.runtime).adopt(plan)
            started = job.started_at.timestamp() if job.started_at else now
            timeout = job.spec.timeout_s
            attempt = Attempt(
                job.id, job.user, plan, ranks, started, started + timeout if timeout else None,
                kind=job.kind, created=job.created_at.timestamp(),
            )  # fmt: skip
            if plan.driver and job.elastic is not None:  # its membership, read on from the log
                g = job.spec.gpus_per_worker
                attempt.elastic = ElasticRun(job.elastic, plan.paths.log(0), g)
                self.elastic.reoffer(plan)
            self.state.attempts[job.id] = attempt
            if job.id in cancelling:
                attempt.stop(JobState.cancelled, "cancelled by the user", now, grace, False)
            elif job.park is not None and job.park.phase == "parking":  # committed: stop them
                attempt.stop(JobState.parked, job.park.reason, now, grace, retry=False)
            elif job.state != JobState.running and self._held(job.spec.runtime, ranks):
                attempt.held = True  # still in the runtime's queue, or started meanwhile
                attempt.held_why = job.reason if job.state == JobState.queued else None
            elif job.state != JobState.running:
                reason = "the service stopped while the job was starting"
                attempt.stop(JobState.failed, reason, now, grace, retry=True)
        for job_id, user, need, priority, spec_json, retry_at in store.pending_rows():
            if job_id in self.state.attempts:  # handed to its runtime's queue: adopted above
                continue
            spec = JobSpec.model_validate_json(spec_json)
            self.state.pending[job_id] = (
                Pending(job_id, user, 0 if runs_outside(spec) else need, priority, spec.timeout_s),
                retry_at,
            )
        self.state.dirty = True
        known = {(a.job_id, a.plan.attempt) for a in self.state.attempts.values()}
        try:  # what attempts no one owns any more left
            strays.reap(self.launch.contained(), known)
        except OSError as e:  # the containment asked for is unusable: the first start says so
            log.warning("cannot look for what ended attempts left: %s", e)
        if self.state.attempts or self.state.pending:
            log.info(
                "recovered %d active and %d queued job(s)",
                len(self.state.attempts),
                len(self.state.pending),
            )

    def _held(self, runtime: RuntimeName, ranks: list[RankProcess]) -> bool:
        """A starting job a queueing runtime (Slurm) took: re-adopted, never started twice."""
        try:
            queues = self.state.runtime(runtime).queues
        except HoraError:
            return False
        return queues and bool(ranks) and all(r.container_id is not None for r in ranks)
