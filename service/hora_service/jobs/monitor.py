"""The monitor loop: the one loop that moves every job through its lifecycle.

Each pass (:meth:`Monitor.tick`) retries the journal, polls every attempt's ranks, stops
failed and timed-out attempts (SIGTERM, then SIGKILL after the grace period), frees slots
once an attempt's processes are gone, retries or finishes jobs, and schedules the queue.
A session whose runtime can start one engine again keeps running past an engine's death
until the kernel asks for a new one (:meth:`Monitor.replace_engine`).
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Sequence

from hora.errors import EngineRunning, HoraError, SpecError
from hora.spec import JobKind, JobState

from hora_service.jobs.admission import Admission
from hora_service.jobs.attempt import Attempt, describe, held_reason
from hora_service.jobs.elastic_slots import ElasticSlots
from hora_service.jobs.launch import Launch
from hora_service.jobs.preflight_book import PreflightFigures
from hora_service.jobs.recovery import Recovery
from hora_service.jobs.state import RETRY_WRITE_S, STOP_JOIN_S, ManagerState
from hora_service.models import JobRecord
from hora_service.runtimes import Exit
from hora_service.runtimes.base import RankStatus, first_failure, rank_status
from hora_service.scheduling.scheduler import INF, Holding, Placement, schedule
from hora_service.store.journal import Write
from hora_service.users.quotas import within_running_limit

log = logging.getLogger(__name__)


class Monitor:
    """Starting and stopping the loop, and its passes.

    Args:
        state: the manager's state (each pass holds its lock).
        admission: the job commands (a shutdown cancels every job; deleted sessions go).
        elastic: elastic jobs' slots (watched, grown into spare slots, shrunk for the queue).
        launch: starting a placed job's attempt, and recording that it runs.
        recovery: re-adopting what an earlier run of the service left (at :meth:`start`).
    """

    def __init__(
        self,
        state: ManagerState,
        admission: Admission,
        elastic: ElasticSlots,
        launch: Launch,
        recovery: Recovery,
    ) -> None:
        self.state = state
        self.admission = admission
        self.elastic = elastic
        self.launch = launch
        self.recovery = recovery
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Hold the data directory, open the store, recover jobs, start the monitor loop.

        Raises:
            HoraError: another service runs on the data directory (naming its pid and URL);
                the lease directory cannot be used safely; single-user mode over a store
                with several users (their jobs would all run as this service's account
                without anyone having opted in); in multi-user mode, a work root the job
                accounts cannot enter.
        """
        self.state.make_dirs()
        self.state.data_lock.take()  # before anything reads the store or writes the config
        try:
            self.state.leases.dir.ready()
            self.state.users.check_start(self.state.settings.db_path)
            self.state.users.check_work_root()
        except BaseException:
            self.state.data_lock.release()
            raise
        self.state.users.make_homes_private()
        with self.state.lock:
            self.recovery.recover()
        self.state.stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="hora-monitor", daemon=True)
        self._thread.start()
        slots, kind = len(self.state.inventory), self.state.slot_kind
        log.info("job manager started: %d %s slot(s)", slots, kind)

    def stop(self) -> None:
        """Stop the monitor loop and close the store; running jobs keep running.

        The next :meth:`start` re-adopts them.
        """
        self.state.stopping.set()
        self.state.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_JOIN_S)
            self._thread = None
        if len(self.state.journal):
            with self.state.lock:
                self.state.flush(timeout_s=5.0)
            if len(self.state.journal):
                log.error(
                    "stopping with %d state change(s) the store did not take (%s); the next "
                    "start reads how the jobs ended from their ranks' exit files",
                    len(self.state.journal), self.state.journal.error,
                )  # fmt: skip
        self.state.close_store()
        self.state.leases.close()  # the ranks still running keep theirs (their shims hold them)
        self.state.data_lock.release()

    def shutdown_jobs(self, timeout: float | None = None) -> None:
        """Cancel every active job and wait (bounded) until their processes are gone."""
        with self.state.lock:
            for job_id in list(self.state.attempts):
                self.admission.cancel(job_id, reason="cancelled: the service is shutting down")
        deadline = time.monotonic() + (timeout or self.state.settings.kill_grace_s + 10.0)
        while self.state.attempts and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.05)

    def _loop(self) -> None:
        while not self.state.stopping.is_set():
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("monitor pass failed")
            self.state.wake.wait(self._next_wait())
            self.state.wake.clear()

    def _next_wait(self) -> float:
        wait = self.state.settings.monitor_interval_s
        if not self.state.attempts and not len(self.state.journal) and not self.state.dirty:
            due = self.state.pending.next_due()
            wait = max(wait, due - time.time()) if due is not None else 5.0
        return max(0.0, min(wait, 5.0))

    def tick(self, now: float | None = None) -> None:
        """One pass of the monitor loop: poll ranks, stop, finish, retry, schedule.

        The users' quotas are read at most once a pass (the scheduling pass, the shrink and
        preemption checks all ask), not once per question.
        """
        with self.state.lock:
            self.state.pass_quotas = (threading.get_ident(), None)
            try:
                self._tick(time.time() if now is None else now)
            finally:
                self.state.pass_quotas = None

    def _tick(self, now: float) -> None:
        if len(self.state.journal):
            self.state.flush(RETRY_WRITE_S)
        for attempt in list(self.state.attempts.values()):
            self._poll(attempt, now)
        # nothing new starts until the store has taken what already happened
        first = self.state.pending.next_due()
        due = first is not None and first <= now
        if (self.state.dirty or due) and not len(self.state.journal):
            self.state.dirty = False
            self.schedule(now)
        for hook in self.state.hooks:
            hook(now)
        # the machine-wide leases follow the slots the attempts hold now
        owners = {s: (a.job_id, a.plan.attempt) for a in self.state.attempts.values()
                  for s in a.plan.slots}  # fmt: skip
        self.state.leases.sync(owners)
        if self.state.dropped:
            self.admission.remove_dropped()

    def _poll(self, attempt: Attempt, now: float) -> None:
        grace = self.state.settings.kill_grace_s
        attempt.codes = [rank_status(r) for r in attempt.ranks]
        if attempt.held and attempt.stop_state is None:
            why = held_reason(attempt.ranks, attempt.plan.spec.runtime.value)
            if why is not None:  # still in the runtime's queue (its reason may change)
                if why != attempt.held_why:
                    attempt.held_why = why
                    self.state.write(Write(attempt.job_id, None, now, None, {"reason": why}))
                return
            if Exit.lost not in attempt.codes:  # it runs, or ran between two passes
                self.launch.running(attempt)
        if attempt.elastic is not None:
            self.elastic.watch(attempt, now)
        if attempt.stop_state is None:
            codes = self._keep_engines(attempt, now)
            failed = first_failure(codes)
            self._watch_preflight(attempt, now)
            if failed is not None:
                first, status = failed
                why = describe(first, status, attempt.ranks[first].note)
                if attempt.plan.driver:  # rank 0 is hora run's driver; its log says why
                    why = f"the elastic driver ({why}; rank 0's log says why)"
                why = self.state.bounds.explain(
                    self.state.runtime(attempt.plan.spec.runtime), attempt.plan, first, why, status
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
            self.state.runtime(attempt.plan.spec.runtime).clear(attempt.plan)
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
        if attempt.kind != JobKind.session:
            return attempt.codes
        if not self.state.runtime(attempt.plan.spec.runtime).replaces_ranks:
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
                self.state.write(Write(attempt.job_id, JobState.running, now, event, event=True))
        return [Exit.running if r in attempt.lost else c for r, c in enumerate(attempt.codes)]

    def replace_engine(self, session_id: int, rank: int, master_port: int) -> JobRecord:
        """Start a new engine for ``rank`` of a running session whose engine died.

        It meets the surviving engines at the store on ``master_port`` (the kernel's
        choice: its surviving engines host it there).

        Raises:
            HoraError: the session is not running, or that rank's engine is (409).
            SpecError: no such rank, or the session's runtime cannot (field named; 422).
        """
        with self.state.lock:
            attempt = self.state.attempts.get(session_id)
            if attempt is None or attempt.kind != JobKind.session or attempt.stop_state is not None:
                raise HoraError(f"session {session_id} is not running")
            if not 0 <= rank < len(attempt.ranks):
                last = len(attempt.ranks) - 1
                raise SpecError("rank", f"session {session_id} has ranks 0..{last}")
            now = time.time()
            attempt.codes = [rank_status(r) for r in attempt.ranks]
            self._keep_engines(attempt, now)
            if rank not in attempt.lost:
                raise EngineRunning(session_id, rank)
            runtime = self.state.runtime(attempt.plan.spec.runtime)
            try:
                new = runtime.replace_rank(attempt.plan, rank, self.state.base_env, master_port)
            except OSError as e:
                raise HoraError(f"could not start a new engine for rank {rank}: {e}") from None
            attempt.ranks[rank] = new
            del attempt.lost[rank]
            event = f"rank {rank}: new engine started (asked by the notebook; port {master_port})"
            self.state.write(Write(session_id, JobState.running, now, event, event=True))
        self.state.wake.set()
        found = self.state.record(session_id)
        assert found is not None
        return found

    def _watch_preflight(
        self, attempt: Attempt, now: float, force: bool = False
    ) -> PreflightFigures | None:
        """Name each new preflight of the attempt in its events; its figures.

        A job's rank 0 hands them over at ``hvd.init()`` when asked (``preflight_env``); a
        session's rank 0 engine when ``%dist_start`` measures (unless ``--no-preflight``).
        """
        if not attempt.plan.preflight_env and attempt.kind != JobKind.session:
            return None
        plan = attempt.plan
        ended = [c for r, c in enumerate(attempt.codes) if r not in attempt.lost]
        force = force or any(c is not Exit.running for c in ended)
        found = self.state.preflight.poll(
            attempt.job_id, plan.attempt, plan.paths.preflight, now, force
        )
        if found is not None:
            self.state.write(
                Write(attempt.job_id, JobState.running, now, found.event(), event=True)
            )
            self.state.preflight.measured(found, self._nodes(attempt))
        return self.state.preflight.known(attempt.job_id, plan.attempt)

    def _nodes(self, attempt: Attempt) -> frozenset[str]:
        """The nodes the service placed an attempt's ranks on, as it knows them itself."""
        try:
            return self.state.runtime(attempt.plan.spec.runtime).nodes(attempt.plan)
        except HoraError:
            return frozenset()

    def _lease(self, slots: Sequence[int]) -> set[int]:
        """Take the leases of ``slots``; those someone else took since the pass looked.

        Those are noted as theirs, and the pass runs again.
        """
        lost = self.state.leases.take(slots)
        if lost:
            self.state.foreign.update(lost)
            self.state.dirty = True
        return set(lost)

    def _launch(self, job_id: int, slots: tuple[int, ...], spare: list[int] | None = None) -> None:
        """Launch a placed job; an attempt whose ranks could not start is stopped at once."""
        failed = self.launch.launch(job_id, slots, spare)
        if failed is not None:
            self._poll(failed, failed.started)

    def _cleared(self, attempt: Attempt, now: float) -> bool:
        """Every rank has ended: kill what is left of the attempt; True once nothing is.

        Until then the attempt keeps its slots (a leftover process may hold a GPU); one that
        cannot be emptied within ``clear_timeout_s`` is logged as stuck, and still held.
        """
        try:
            runtime = self.state.runtime(attempt.plan.spec.runtime)
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
        elif now - attempt.clearing_since > self.state.settings.clear_timeout_s:
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
        del self.state.attempts[attempt.job_id]
        self.state.dirty = True
        attempt.count(self.state.usage, now)
        figures = self._watch_preflight(attempt, now, force=True)  # every rank has ended
        self.state.preflight.done(attempt.job_id, attempt.plan.attempt)
        if figures is not None and state == JobState.failed:
            reason = figures.explain(reason or "")  # a crossed threshold names its rank
        heir = self.state.handoffs.pop(attempt.job_id, None)
        # the session's slots go straight to the job it handed to
        if heir is not None and heir in self.state.pending:
            self._launch(heir, attempt.plan.slots[: self.state.pending[heir][0].need])
        codes = {r: (c if isinstance(c, int) else None) for r, c in enumerate(attempt.codes)}
        if state == JobState.parked:  # a session whose engines' state is on disk
            job = self.state.record(attempt.job_id)
            park = job.park if job is not None else None
            park = park.model_copy(update={"phase": "parked"}) if park is not None else None
            self.state.set_state(
                attempt.job_id, state, now, reason, exit_codes=codes, slots=[], park=park
            )
            return
        spec = attempt.plan.spec
        if (
            state == JobState.failed
            and attempt.retriable
            and attempt.plan.attempt <= spec.max_retries
        ):
            delay = self.state.settings.retry_backoff_s * 2 ** (attempt.plan.attempt - 1)
            self.state.set_state(
                attempt.job_id, JobState.retrying, now, reason,
                exit_codes=codes, slots=[], retry_at=now + delay,
            )  # fmt: skip
            self.state.enqueue(attempt.job_id, attempt.user, spec, now + delay)
            return
        self.state.set_state(
            attempt.job_id, state, now, reason, exit_codes=codes, slots=[], finished_at=now
        )

    def schedule(self, now: float) -> None:
        """One scheduling pass (the lock held): place, start, grow or shrink for the queue."""
        t0 = time.perf_counter()
        # in queue order, as the queue keeps it: the running limit, the pass and the shrink
        # check keep this order
        ready = [p for p, due in self.state.pending.ordered() if due is None or due <= now]
        running = collections.Counter(a.user for a in self.state.attempts.values())
        limit_running = self.state.settings.max_running_jobs_per_user
        ready = within_running_limit(ready, running, limit_running, ordered=True)
        # jobs whose runtime owns its resources (slurm) take none of the service's slots
        outside = [p for p in ready if p.need == 0]
        ready = [p for p in ready if p.need > 0]
        held = {s for a in self.state.attempts.values() for s in a.plan.slots}
        free = [s.index for s in self.state.inventory if s.index not in held]
        # slots someone else on this machine holds (another service, a notebook's engines)
        self.state.foreign = self.state.leases.others(free)
        free = [s for s in free if s not in self.state.foreign]
        holding = [
            Holding(a.job_id, a.user, a.plan.slots, a.deadline if a.deadline else INF)
            for a in self.state.attempts.values()
        ] + [Holding(-1, h.user or "", (s,)) for s, h in self.state.foreign.items()]
        used: dict[str, int] = {}
        for a in self.state.attempts.values():
            used[a.user] = used.get(a.user, 0) + len(a.plan.slots)
        placements: list[Placement] = []
        if free and ready:  # else nothing can start: the users' quotas are not read
            quotas = self.state.quotas()
            default = self.state.settings.user_gpu_quota
            limit = None if default is None and not quotas else lambda u: quotas.get(u, default)
            placements = schedule(ready, free, holding, now, limit, used, ordered=True)
        self.state.last_pass_s = time.perf_counter() - t0
        placed = {s for p in placements for s in p.slots}
        # slots nobody waits for: elastic jobs grow into them (up to their max_workers)
        spare = [s for s in free if s not in placed] if len(placements) == len(ready) else []
        for placement in placements:
            if not self._lease(placement.slots):  # leased before anything runs there
                self._launch(placement.job_id, placement.slots, spare)
        if self.state.foreign and len(placements) < len(ready):
            self.state.dirty = True  # a holder elsewhere lets go without telling: look again
        for p in outside:
            self._launch(p.id, ())
        if spare:
            self.elastic.grow(spare, now)
        elif len(placements) < len(ready):
            started = {x.job_id for x in placements}
            waiting = [p for p in ready if p.id not in started]  # in queue order
            self.elastic.shrink_for(waiting, len(free) - len(placed), now)
