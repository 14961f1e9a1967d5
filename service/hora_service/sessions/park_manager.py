"""Parked sessions: park, resume, quota, retention, and when the service asks (control plane).

A notebook parks its session in three steps, each checked here:

* **begin** (``POST /v1/sessions/{id}/park``): the session runs; the service makes the
  park's directory in the owner's own (:mod:`hora_service.sessions.parkdirs`), given to the account
  the engines run as, and answers with a ticket and the quota left; an estimate already
  past the quota is refused.
* the kernel's engines write their parts there, each its own, at once.
* **commit** (``.../park/commit``): the service measures the parts itself (``lstat``, no
  link followed), refuses past the quota (the parts are removed; the engines run on), else
  records the snapshot and stops the engines: the session ends ``parked``, holding no slot
  and no lease. The record in the store is the commit point: a park interrupted before it
  (the service or the kernel killed) leaves the engines running, and its parts are removed,
  never restored.

**Resume** (``.../resume``) queues the session again with the new kernel's controller and
the snapshot's directory in the engines' environment; the kernel confirms the restore
(``DELETE .../snapshot``) and the snapshot goes. A session with a snapshot whose kernel goes
silent, or that is withdrawn while it waits, is parked again, its snapshot kept.

Every monitor pass (:meth:`ParkManager.check`) ends parked sessions past the retention,
removes the snapshots of sessions that ended, and asks kernels to park: at the idle timeout
(``session_idle_action=park``, by
:class:`hora_service.sessions.session_manager.SessionManager`), and when a
request of a higher priority waits for slots that sessions idle for
``session_preempt_idle_s`` hold. A kernel hears it with its next heartbeat and parks unless
a cell runs. An idle park that fails stops the session (as the idle timeout did before); a
preempting one leaves it running.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hora.engines.park import part_name
from hora.env import RankEnv
from hora.errors import HoraError, SpecError
from hora.scaling import fmt_bytes
from hora.session_wire import ParkAbort, ParkBegin, ResumeRequest, check_interface, host_of
from hora.spec import (
    PRIORITY_RANK,
    JobKind,
    JobSpec,
    JobState,
    ParkCommit,
    ParkedRank,
    ParkInfo,
    ParkTicket,
    RuntimeName,
    SlotInfo,
    SlotKind,
)

from hora_service.manager import JobManager
from hora_service.models import JobRecord
from hora_service.sessions import parkdirs
from hora_service.sessions.session_spec import CONNECTION_VAR, check_controller
from hora_service.settings import Settings
from hora_service.users.quotas import OverLimit

log = logging.getLogger(__name__)

SWEEP_S = 2.0  # how often parked sessions' retention and ended sessions' snapshots are checked
COOLDOWN_S = 600.0  # a session whose preempting park failed is not asked again for this long
PRIORITY_NAME = {rank: name.value for name, rank in PRIORITY_RANK.items()}
WORLD_VAR = RankEnv.var("engine_world")


class ParkConflict(HoraError):
    """The session is not in a state this step needs (a 409)."""


@dataclass
class Ask:
    """The service asks the kernel to park a session (it hears it with its next heartbeat)."""

    reason: str
    kind: str  # idle | preempt | asked
    at: float
    begun: bool = False


@dataclass(frozen=True)
class Opened:
    """A park under way: its ticket, directory, and why (when the service did not ask)."""

    ticket: str
    workdir: Path
    directory: Path
    cause: str = "user"


CAUSES = {
    "user": "parked by its user (%dist_park)",
    "exit": "parked when its kernel exited (HORA_PARK_ON_EXIT)",
}


def _ticket_of(park: ParkInfo | None) -> str | None:
    return Path(park.directory).name.rsplit("-", 1)[-1] if park is not None else None


def _workdir_of(park: ParkInfo) -> Path:
    return Path(park.directory).parent.parent


class ParkManager:
    """Parks and resumes sessions, keeps the quota and retention, asks kernels to park.

    Args:
        manager: the job manager (sessions are its jobs of kind ``session``).
        settings: the quota, retention, idle action and preemption settings.
        idle_of: how long a session's engines have been idle (the session manager's).
        end_lease: forget a session's lease (it is parked: nothing heartbeats it).
        new_lease: give a resumed session a fresh lease.
    """

    def __init__(
        self,
        manager: JobManager,
        settings: Settings,
        idle_of: Callable[[int, float], float | None],
        end_lease: Callable[[int], None],
        new_lease: Callable[[int], None],
    ) -> None:
        self.manager, self.settings = manager, settings
        self.idle_of, self.end_lease, self.new_lease = idle_of, end_lease, new_lease
        self._lock = threading.Lock()
        self._asks: dict[int, Ask] = {}
        self._open: dict[int, Opened] = {}
        self._cooldown: dict[int, float] = {}
        self._known: set[int] | None = None  # sessions with a snapshot
        self._swept = 0.0
        self._started = False  # the first pass removes what an earlier run left unfinished
        manager.hooks.append(self.check)

    # --- where, whose -----------------------------------------------------------------------
    def _account(self, job: JobRecord) -> tuple[int, int] | None:
        """The account the session's engines run as (None: the service's own)."""
        if self.manager.user_mode == "multi":
            who = self.manager.users.run_as(job.user_id)
            return who.uid, who.gid
        if job.spec.runtime == RuntimeName.docker and os.geteuid() == 0:
            uid = self.settings.docker_uid  # docker's job account in this mode (its runtime's)
            return uid, uid
        return None

    def used(self, user: str, but: int | None = None) -> int:
        """Bytes of ``user``'s snapshots (but session ``but``'s)."""
        total = 0
        for job_id in self._snapshots():
            job = self.manager.get(job_id)
            if job is not None and job.user == user and job.id != but and job.park is not None:
                total += job.park.bytes
        return total

    def _check_quota(self, job: JobRecord, size: int) -> int:
        quota = self.settings.park_quota_bytes
        used = self.used(job.user, but=job.id)
        if quota is not None and used + size > quota:
            raise OverLimit(
                "park_quota",
                f"not parked: the snapshot is {fmt_bytes(size)} and your parked sessions keep "
                f"{fmt_bytes(used)} of your {fmt_bytes(quota)} quota; the engines run on. "
                "End a parked session (%dist_resume lists them) or leave out large variables "
                "(%dist_park --drop NAME)",
                413,
            )
        return used

    # --- park ---------------------------------------------------------------------------------
    def begin(self, job: JobRecord, body: ParkBegin) -> ParkTicket:
        """Start a park: its directory, made for the engines, and a ticket (module docstring).

        Raises:
            ParkConflict: the session is not running, or a park of it is under way.
            OverLimit: the estimate is past the user's quota already.
            ParkDirError: the directory cannot be made.
        """
        if job.state != JobState.running:
            raise ParkConflict(f"session {job.id} is {job.state.value}; only a running one parks")
        used = self._check_quota(job, body.bytes)
        workdir = self.manager.workdir(job.spec, job.user)
        ticket = secrets.token_hex(8)
        with self._lock:
            if job.id in self._open:
                raise ParkConflict(f"a park of session {job.id} is under way")
            directory = parkdirs.make(workdir, job.id, ticket, self._account(job))
            self._open[job.id] = Opened(ticket, workdir, directory, body.cause)
            if job.id in self._asks:
                self._asks[job.id].begun = True
        return ParkTicket(
            ticket=ticket, directory=str(directory),
            quota_bytes=self.settings.park_quota_bytes, used_bytes=used,
        )  # fmt: skip

    def commit(self, job: JobRecord, body: ParkCommit) -> JobRecord:
        """Check the parts, count them against the quota, record them, stop the engines.

        Raises:
            ParkConflict: no park under way with this ticket, or the session stopped.
            SpecError: the parts do not match the session's ranks (field ``ranks``).
            OverLimit: past the quota (the parts are removed, the engines run on).
        """
        with self._lock:
            opened = self._open.get(job.id)
            if opened is None or opened.ticket != body.ticket:
                raise ParkConflict(f"no park of session {job.id} is under way with this ticket")
            del self._open[job.id]
            ask = self._asks.pop(job.id, None)
        try:
            info = self._checked(job, opened, body, ask)
            self.manager.park(job.id, info.reason, info)
        except BaseException:
            parkdirs.remove(opened.workdir, job.id, keep=_ticket_of(job.park))
            raise
        self.end_lease(job.id)
        with self._lock:
            self._snapshots().add(job.id)
        parkdirs.remove(opened.workdir, job.id, keep=opened.ticket)  # an earlier park's parts
        parts = [part_name(r.rank) for r in info.ranks]
        threading.Thread(
            target=parkdirs.flush, args=(opened.workdir, job.id, opened.ticket, parts),
            name=f"hora-park-flush-{job.id}", daemon=True,
        ).start()  # fmt: skip
        log.info("session %d parked: %s (%s)", job.id, info.reason, fmt_bytes(info.bytes))
        found = self.manager.get(job.id)
        assert found is not None
        return found

    def _checked(
        self, job: JobRecord, opened: Opened, body: ParkCommit, ask: Ask | None
    ) -> ParkInfo:
        if job.state != JobState.running:
            raise ParkConflict(f"session {job.id} is {job.state.value}; it was not parked")
        world = job.spec.workers
        ranks = sorted(body.ranks, key=lambda r: r.rank)
        if [r.rank for r in ranks] != list(range(world)):
            raise SpecError("ranks", f"expected one part for each of ranks 0..{world - 1}")
        sizes = parkdirs.measure(
            opened.workdir, job.id, opened.ticket, [part_name(r.rank) for r in ranks]
        )
        for r in ranks:
            if sizes[part_name(r.rank)] != r.bytes:
                raise SpecError(
                    "ranks", f"rank {r.rank}'s part is {sizes[part_name(r.rank)]} bytes on disk, "
                    f"not {r.bytes}: it was not written whole",
                )  # fmt: skip
        total = sum(sizes.values())
        self._check_quota(job, total)
        now = time.time()
        return ParkInfo(
            phase="parking", parked_at=datetime.fromtimestamp(now, UTC),
            reason=ask.reason if ask is not None else CAUSES[opened.cause],
            bytes=total, world=world, elastic=body.elastic, directory=str(opened.directory),
            ranks=[ParkedRank.model_validate(r.model_dump()) for r in ranks],
            expires_at=datetime.fromtimestamp(now + self.settings.session_park_retention_s, UTC),
        )  # fmt: skip

    def abort(self, job: JobRecord, body: ParkAbort) -> None:
        """The kernel gave a park up: remove its parts; an idle session is then stopped."""
        now = time.time()
        with self._lock:
            opened = self._open.get(job.id)
            if opened is not None and body.ticket in (None, opened.ticket):
                del self._open[job.id]
            else:
                opened = None
            ask = self._asks.pop(job.id, None)
        if opened is not None:
            parkdirs.remove(opened.workdir, job.id, keep=_ticket_of(job.park))
        if ask is None:
            return
        why = body.why.splitlines()[0][:300] if body.why else "the kernel gave it up"
        if ask.kind == "idle":
            reason = f"{ask.reason}; not parked ({why}): engines stopped and slots freed"
            log.info("session %d: %s", job.id, reason)
            self.manager.cancel(job.id, reason=reason)
        else:
            self._cooldown[job.id] = now + COOLDOWN_S

    # --- resume -------------------------------------------------------------------------------
    def resume(self, job: JobRecord, req: ResumeRequest) -> JobRecord:
        """Queue a parked session again, its engines told where their snapshot is.

        Raises:
            ParkConflict: the session is not parked.
            SpecError: another size without elastic state (``workers``), a controller its
                engines cannot reach (``connection.interface``), more slots than the quota.
        """
        park = job.park
        if job.state != JobState.parked or park is None:
            raise ParkConflict(
                f"session {job.id} is {job.state.value}; only a parked session resumes"
            )
        workers = req.workers or park.world
        if workers != park.world and not park.elastic:
            raise SpecError(
                "workers",
                f"session {job.id} was parked with {park.world} engines; another size needs "
                "elastic state (hvd.elastic.TorchState in the namespace)",
            )
        spec = self._resumed_spec(job, req, park, workers)
        self.manager.check(job.user, spec)
        resuming = park.model_copy(update={"phase": "resuming"})
        self.manager.requeue(job.id, job.user, spec, "resumed by its user", resuming)
        self.new_lease(job.id)
        found = self.manager.get(job.id)
        assert found is not None
        return found

    def _resumed_spec(
        self, job: JobRecord, req: ResumeRequest, park: ParkInfo, workers: int
    ) -> JobSpec:
        runtime = job.spec.runtime
        try:
            check_interface(runtime, req.connection.interface)
        except ValueError as e:
            raise SpecError("connection.interface", str(e).split(": ", 1)[-1]) from None
        if runtime == RuntimeName.slurm:
            check_controller(self.settings, host_of(req.connection.interface))
        if req.world_file is not None and runtime != RuntimeName.local:
            raise SpecError("world_file", f"a {runtime.value} session's engines cannot use it")
        env = dict(job.spec.env)
        env.pop(WORLD_VAR, None)
        env.update(
            RankEnv(
                engine_connection=req.connection.model_dump_json(), engine_world=req.world_file,
                restore_dir=park.directory, restore_size=park.world,
            ).to_environ()
        )  # fmt: skip
        env[CONNECTION_VAR] = req.connection.model_dump_json()
        return JobSpec.model_validate({**job.spec.model_dump(), "env": env, "workers": workers})

    def withdraw(self, job: JobRecord) -> None:
        """A resume given up while it waits (or starts): parked again; other sessions end."""
        park = job.park
        if park is None or park.phase != "resuming" or job.state.terminal:
            self.manager.cancel(job.id, reason="withdrawn by the user")
            return
        self.end_lease(job.id)
        self.manager.park(job.id, park.reason, park.model_copy(update={"phase": "parking"}))

    def restored(self, job: JobRecord) -> None:
        """The kernel restored the snapshot: delete it."""
        park = job.park
        if park is None:
            return
        self.manager.set_park(job.id, None)
        parkdirs.remove(_workdir_of(park), job.id)
        with self._lock:
            self._snapshots().discard(job.id)

    def dropped(self, job: JobRecord) -> None:
        """Its owner deleted the session: its snapshot goes with it (the row is gone already)."""
        if job.park is not None:
            parkdirs.remove(_workdir_of(job.park), job.id)
        with self._lock:
            self._snapshots().discard(job.id)

    def lease_ran_out(self, job_id: int) -> bool:
        """The kernel went silent: a session with a snapshot is parked again (True)."""
        job = self.manager.get(job_id)
        if job is None or job.park is None or job.state.terminal or job.state == JobState.parked:
            return False
        self.withdraw(job)
        return True

    # --- asking kernels -----------------------------------------------------------------------
    def ask(self, job_id: int, reason: str, kind: str, now: float) -> bool:
        """Ask the kernel to park ``job_id``; False once it was asked and never began.

        Returns:
            True while the park is asked for or under way.
        """
        with self._lock:
            asked = self._asks.get(job_id)
            if asked is None:
                self._asks[job_id] = Ask(reason, kind, now)
                log.info("session %d: the kernel is asked to park it (%s)", job_id, reason)
                return True
            if asked.begun or now - asked.at < self._grace():
                return True
            del self._asks[job_id]
        return False

    def ask_all(self, user: str, by: str, now: float | None = None) -> list[int]:
        """Ask the kernels of ``user``'s running sessions to park them; their ids."""
        now = time.time() if now is None else now
        ids = [i for i, owner, _, _ in self.manager.session_holders() if owner == user]
        for job_id in ids:
            self.ask(job_id, f"asked by {by}", "asked", now)
        return ids

    def asked(self, job_id: int) -> str | None:
        """Why the service asks the kernel to park ``job_id`` now (None: it does not)."""
        with self._lock:
            ask = self._asks.get(job_id)
        return ask.reason if ask is not None and not ask.begun else None

    def _grace(self) -> float:
        """How long an asked kernel has to begin its park (it hears it within lease/3)."""
        return max(60.0, 3 * self.settings.session_lease_s)

    def parked_rows(self) -> list[SlotInfo]:
        """The parked sessions, as ``GET /v1/gpus`` lists them after the slots (they hold none)."""
        rows = []
        for job_id in sorted(self._snapshots()):
            job = self.manager.get(job_id)
            if job is None or job.state != JobState.parked or job.park is None:
                continue
            rows.append(SlotInfo(
                index=None, kind=SlotKind.parked, name=job.spec.name, job_id=job.id, user=job.user,
                holder_kind=JobKind.session, parked_at=job.park.parked_at,
                snapshot_bytes=job.park.bytes,
            ))  # fmt: skip
        return rows

    # --- every monitor pass -------------------------------------------------------------------
    def check(self, now: float) -> None:
        """Drop stale asks, ask for preempting parks, apply retention, remove ended snapshots."""
        if not self._started:
            self._started = True
            self._forget_torn()
        self._settle_asks(now)
        self._preempt(now)
        if now - self._swept >= SWEEP_S:
            self._swept = now
            self._sweep(now)

    def _settle_asks(self, now: float) -> None:
        limit = self.settings.session_preempt_idle_s or 0.0
        with self._lock:
            asks = list(self._asks.items())
        for job_id, ask in asks:
            if ask.begun or ask.kind == "idle":
                continue  # an idle ask is the session manager's to settle
            idle = self.idle_of(job_id, now)
            busy = ask.kind == "preempt" and (idle is None or idle < limit)
            if busy or now - ask.at > self._grace():
                with self._lock:
                    self._asks.pop(job_id, None)
                self._cooldown[job_id] = now + (0.0 if busy else COOLDOWN_S)

    def _preempt(self, now: float) -> None:
        """Ask idle lower-priority sessions to park for the first request that cannot start."""
        limit = self.settings.session_preempt_idle_s
        holders = self.manager.session_holders() if limit is not None else []
        if not holders:  # no session to park: the queue need not be looked at
            return
        head = self.manager.blocked_head(now)
        if head is None or limit is None:
            return
        want, free = head
        with self._lock:
            asked = set(self._asks)
        short = want.need - free - sum(n for i, _, _, n in holders if i in asked)
        if short <= 0:
            return
        idle = {i: self.idle_of(i, now) for i, _, _, _ in holders}
        chosen = []
        for job_id, _, prio, slots in sorted(holders, key=lambda h: -(idle[h[0]] or 0.0)):
            seconds = idle[job_id]
            if job_id in asked or prio >= want.priority or seconds is None or seconds < limit:
                continue
            if self._cooldown.get(job_id, 0.0) > now:
                continue
            chosen.append((job_id, seconds))
            short -= slots
            if short <= 0:
                break
        if short > 0:
            return  # parking what may be parked would not be enough: park nothing
        wanted = self.manager.get(want.id)
        what = wanted.kind if wanted is not None else JobKind.job
        for job_id, seconds in chosen:
            reason = (
                f"its slots were wanted by {what} {want.id} ({want.user}, priority "
                f"{PRIORITY_NAME.get(want.priority, want.priority)}) after "
                f"{seconds / 60:.0f} min idle"
            )
            self.ask(job_id, reason, "preempt", now)

    def _forget_torn(self) -> None:
        """At start: remove the parts of parks an earlier run of the service never committed.

        A park under way when the service stopped (even with kill -9) left its parts beside
        a session whose engines still run: they are never restored, so they go.
        """
        for job in self.manager.session_jobs():
            try:
                workdir = self.manager.workdir(job.spec, job.user)
            except SpecError:
                continue
            torn = parkdirs.remove(workdir, job.id, keep=_ticket_of(job.park))
            if torn:
                log.info("session %d: removed an unfinished park's parts (%s)", job.id, torn)

    def _snapshots(self) -> set[int]:
        if self._known is None:
            self._known = {j.id for j in self.manager.open_store().jobs_with_park()}
        return self._known

    def _sweep(self, now: float) -> None:
        """End parked sessions past the retention; remove the snapshots of ended sessions."""
        with self._lock:
            known = list(self._snapshots())
        for job_id in known:
            job = self.manager.get(job_id)
            park = job.park if job is not None else None
            if job is None or park is None or job.state.terminal:
                if park is not None:
                    parkdirs.remove(_workdir_of(park), job_id)
                    if job is not None:
                        self.manager.set_park(job_id, None)
                with self._lock:
                    self._snapshots().discard(job_id)
            elif job.state == JobState.parked and park.expires_at is not None:
                if park.expires_at.timestamp() <= now:
                    days = self.settings.session_park_retention_s / 86400
                    self.manager.cancel(
                        job_id, reason=f"parked for {days:g} days without a resume: the "
                        "session ended and its snapshot was deleted",
                    )  # fmt: skip
        with self._lock:
            stale = [(i, o) for i, o in self._open.items() if self._ended(i)]
            for job_id, _ in stale:
                self._open.pop(job_id, None)
        for job_id, opened in stale:
            parkdirs.remove(opened.workdir, job_id)

    def _ended(self, job_id: int) -> bool:
        job = self.manager.get(job_id)
        return job is None or job.state != JobState.running
