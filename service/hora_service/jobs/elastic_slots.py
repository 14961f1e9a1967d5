"""Elastic jobs' slots: growing into spare slots, shrinking for a job of higher priority.

An elastic job's driver reads its slot file; the service writes there what it may use
(:func:`hora_service.runtimes.elastic_run.write_hosts`) and watches which worker processes run
(:func:`hora_service.runtimes.elastic_run.workers`, what the kernel shows, never what the job
prints).
Slots freed by a shrink are released once no more workers run than the slots the job keeps;
workers beyond what a job holds that outlive ``elastic_shrink_timeout_s`` are stopped. Any
number of shrinks may be under way at once: slots a shrink will free count for the jobs
queued first, and further shrinks start for the jobs behind them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace

from hora.spec import PRIORITY_RANK, JobSpec
from hora.words import count

from hora_service.jobs.attempt import Attempt
from hora_service.jobs.state import ManagerState
from hora_service.models import JobRecord
from hora_service.runtimes import AttemptPlan
from hora_service.runtimes.base import prepare_run_dir
from hora_service.runtimes.core import read_pid
from hora_service.runtimes.elastic_run import ElasticRun, stop_workers, workers, write_hosts
from hora_service.runtimes.runfiles import UntrustedRunFile
from hora_service.scheduling.scheduler import Pending
from hora_service.store.journal import Write

WATCH_S = 1.0  # how often a shrinking (or over-full) elastic attempt's workers are looked at
IDLE_WATCH_S = 5.0  # how often those of one that holds what it runs are

log = logging.getLogger(__name__)


class ElasticSlots:
    """Offering, growing, shrinking and releasing elastic jobs' slots.

    Args:
        state: the manager's state (the attempts, the leases, the usage).
    """

    def __init__(self, state: ManagerState) -> None:
        self.state = state

    def shrink_for(self, waiting: Sequence[Pending], free: int, now: float) -> None:
        """Shrink lower-priority elastic jobs (down to their min) so that the queue's head fits.

        ``waiting`` is in queue order. Slots that shrinks under way will free count first
        (for the jobs queued first); a job they do not cover starts shrinks of its own, from
        jobs not shrinking yet. The first job that shrinking cannot make fit ends the pass:
        nobody is disturbed for it or for the jobs behind it.
        """
        runs = [a for a in self.state.attempts.values()
                if a.elastic is not None and a.stop_state is None]  # fmt: skip
        if not runs:
            return  # nothing to shrink: no need to look at the queue
        coming = free + sum(
            len(a.plan.slots) - a.elastic.target
            for a in runs if a.elastic is not None and a.elastic.target is not None
        )  # fmt: skip
        for head in waiting:
            if self._room_in_quota(head.user) < head.need:
                continue  # it waits for its user's own jobs, not for slots
            if head.need <= coming:
                coming -= head.need
                continue
            cuts = self._cuts(head, head.need - coming, runs)
            if cuts is None:
                return
            for a, keep in cuts:
                assert a.elastic is not None
                coming += len(a.plan.slots) - keep
                why = f"shrinking to {keep} slot(s): job {head.id} of higher priority needs them"
                a.elastic.shrink(keep, why, now)
                self.offer(a.plan, keep)
                self.state.write(Write(a.job_id, None, now, None, {"elastic": a.elastic.info}))
            coming -= head.need

    def _cuts(
        self, head: Pending, short: int, runs: list[Attempt]
    ) -> list[tuple[Attempt, int]] | None:
        """Which elastic jobs keep how many slots so that ``short`` more are free for ``head``.

        Jobs of lower priority not already shrinking, lowest priority and newest first,
        each down to its min; None when all of them together cannot give ``short``.
        """
        lower = sorted(
            (a for a in runs if a.elastic is not None and a.elastic.target is None
             and PRIORITY_RANK[a.plan.spec.priority] < head.priority),
            key=lambda a: (PRIORITY_RANK[a.plan.spec.priority], -a.started),
        )  # fmt: skip
        cuts = []
        for a in lower:
            spec = a.plan.spec
            assert spec.elastic is not None
            g = spec.gpus_per_worker
            give = min(len(a.plan.slots) - spec.elastic.min_workers * g, -(-short // g) * g)
            if give > 0 and short > 0:
                cuts.append((a, len(a.plan.slots) - give))
                short -= give
        return None if short > 0 else cuts

    def watch(self, attempt: Attempt, now: float) -> None:
        """Read the driver's report (to show), then act on the workers the kernel shows.

        Only a running attempt's workers are acted on (a stopping one is being killed). A
        shrink is released once no more workers run than the slots it keeps; workers beyond
        what the job may hold that outlived ``elastic_shrink_timeout_s`` are stopped.
        """
        run = attempt.elastic
        assert run is not None
        if run.read():
            self.state.write(Write(attempt.job_id, None, now, None, {"elastic": run.info}))
        if attempt.stop_state is not None or now < run.next_look:
            return
        busy = run.target is not None or run.over_since is not None
        run.next_look = now + (WATCH_S if busy else IDLE_WATCH_S)
        seen = self._workers(attempt)
        if seen is None:
            return
        bound = self.state.settings.elastic_shrink_timeout_s
        extra = run.excess(seen, len(attempt.plan.slots), now, bound)
        if extra and attempt.plan.container is not None:
            stopped = stop_workers(extra, attempt.plan.container)
            log.warning("job %d: stopped worker process(es) %s after %.0f s beyond its slots",
                        attempt.job_id, stopped, bound)  # fmt: skip
            run.stopped(stopped, now)
            self.state.write(Write(attempt.job_id, None, now, None, {"elastic": run.info}))
            seen = [pid for pid in seen if pid not in stopped]
        if run.released(seen):
            self._release(attempt, now)

    def _workers(self, attempt: Attempt) -> list[int] | None:
        """The attempt's workers as the kernel shows them; None while that cannot be told."""
        box = attempt.plan.container
        try:
            shim = read_pid(attempt.plan.paths, 0)
        except UntrustedRunFile:
            return None
        return None if shim is None or box is None else workers(box, shim)

    def _release(self, attempt: Attempt, now: float) -> None:
        """A shrink is done: the slots its workers left are free."""
        run = attempt.elastic
        assert run is not None and run.target is not None
        plan, keep = attempt.plan, run.target
        gone = ", ".join(map(str, plan.slots[keep:]))
        attempt.count(self.state.usage, now)
        attempt.plan = replace(plan, slots=plan.slots[:keep])
        run.target = None
        run.granted(keep, f"gave back slot(s) {gone}", now)
        self.state.write(Write(attempt.job_id, None, now, None,
                          {"slots": list(attempt.plan.slots), "elastic": run.info}))  # fmt: skip
        self.state.dirty = True

    def _room(self, user: str, spec: JobSpec, held: int, spare: list[int]) -> int:
        """Slots an elastic job holding ``held`` may take from ``spare`` (whole workers)."""
        assert spec.elastic is not None
        g = spec.gpus_per_worker
        room = min(spec.elastic.max_workers * g - held, len(spare))
        return max(0, min(room, self._room_in_quota(user)) // g * g)

    def _room_in_quota(self, user: str) -> int:
        """Slots ``user``'s jobs may still take under their quota."""
        quota = self.state.quota_of(user)
        if quota is None:
            return len(self.state.inventory)
        return quota - sum(
            len(a.plan.slots) for a in self.state.attempts.values() if a.user == user
        )

    def grow(self, spare: list[int], now: float) -> None:
        """Offer spare slots to running elastic jobs, oldest first; the world grows at a commit."""
        for attempt in sorted(self.state.attempts.values(), key=lambda a: a.started):
            run = attempt.elastic
            if run is None or run.target is not None or attempt.stop_state is not None:
                continue
            if not spare:
                break
            plan = attempt.plan
            take = self._room(attempt.user, plan.spec, len(plan.slots), spare)
            if take == 0:
                continue
            extra, spare[:] = self._leased(spare[:take], plan.spec), spare[take:]
            if not extra:
                continue
            attempt.count(self.state.usage, now)
            attempt.plan = plan = replace(plan, slots=plan.slots + tuple(extra))
            try:
                self.offer(plan)
            except OSError as e:  # the slots stay held; the next write of the file offers them
                log.warning("job %d: cannot offer slots %s: %s", attempt.job_id, extra, e)
            g = plan.spec.gpus_per_worker
            names = ", ".join(map(str, extra))
            run.granted(len(plan.slots), f"slot(s) {names} freed: room for "
                        f"{count(len(plan.slots) // g, 'worker')}", now)  # fmt: skip
            self.state.write(Write(attempt.job_id, None, now, None,
                              {"slots": list(plan.slots), "elastic": run.info}))  # fmt: skip

    def widen(
        self, job: JobRecord, slots: tuple[int, ...], spare: list[int] | None
    ) -> tuple[int, ...]:
        """An elastic job starts with what is free (``spare``), up to its max."""
        if job.spec.elastic is None or not spare:
            return slots
        take = self._room(job.user, job.spec, len(slots), spare)
        slots, spare[:] = slots + tuple(self._leased(spare[:take], job.spec)), spare[take:]
        return slots

    def _leased(self, extra: list[int], spec: JobSpec) -> list[int]:
        """The slots of ``extra`` whose leases this service takes now, in whole workers."""
        lost = self.state.leases.take(extra)
        self.state.foreign.update(lost)
        kept = [s for s in extra if s not in lost]
        return kept[: len(kept) // spec.gpus_per_worker * spec.gpus_per_worker]

    def reoffer(self, plan: AttemptPlan) -> None:
        """Offer a re-adopted driver the slots the store says it holds.

        A shrink or a grant the service was making when it stopped is undone (a shrink starts
        again if a job still waits for the slots).
        """
        try:
            self.offer(plan)
        except OSError as e:
            log.warning("job %d: cannot rewrite its slot file: %s", plan.job_id, e)

    def run_for(self, job: JobRecord, plan: AttemptPlan, now: float) -> ElasticRun | None:
        """The membership of a new attempt's elastic driver (None: not an elastic job)."""
        if not plan.driver:
            return None
        return ElasticRun.begin(job.spec, plan.paths.log(0), len(plan.slots), now, job.elastic)

    def offer(self, plan: AttemptPlan, slots: int | None = None) -> None:
        """Write an elastic driver's slot file: one worker per whole set of ``slots`` slots."""
        if not plan.driver:
            return
        prepare_run_dir(plan)
        gid = plan.run_as.gid if plan.run_as is not None else os.getegid()
        n = len(plan.slots) if slots is None else slots
        write_hosts(plan.paths.elastic_hosts, n // plan.spec.gpus_per_worker, gid)
