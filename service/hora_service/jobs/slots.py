"""What the slots and the queue look like now: holders, a queued job's place, metrics.

These are read-only views of the monitor's state, taken under its lock, for the API's
slot and queue pages and for ``/metrics``.
"""

from __future__ import annotations

import statistics
import time

from hora.errors import HoraError
from hora.inventory import Slot
from hora.leases import LeaseHolder
from hora.spec import PRIORITY_RANK, JobKind, RuntimeName

from hora_service.jobs.attempt import Attempt, Holder, QueueView
from hora_service.jobs.state import ManagerState
from hora_service.models import JobRecord, MetricsSnapshot, SlotInfo
from hora_service.scheduling.scheduler import INF, Holding, Pending, queue_order, reserve


def _slot_info(slot: Slot, attempt: Attempt | None, elsewhere: LeaseHolder | None) -> SlotInfo:
    """One slot as ``/v1/gpus`` shows it."""
    info = SlotInfo(index=slot.index, kind=slot.kind, name=slot.name)
    if attempt is not None:
        info.job_id, info.user, info.holder_kind = attempt.job_id, attempt.user, attempt.kind
    elif elsewhere is not None:
        info.user, info.holder = elsewhere.user, elsewhere.words()
        info.holder_kind = elsewhere.kind or None
    return info


class SlotViews:
    """The slots, their holders, the queue and the metrics.

    Args:
        state: the manager's state (read under its lock).
    """

    def __init__(self, state: ManagerState) -> None:
        self.state = state

    def slots(self) -> list[SlotInfo]:
        """Every slot and who holds it: a job or session here, or a holder elsewhere."""
        with self.state.lock:
            held = {s: a for a in self.state.attempts.values() for s in a.plan.slots}
        elsewhere = self.state.leases.others(
            s.index for s in self.state.inventory if s.index not in held
        )
        return [
            _slot_info(s, held.get(s.index), elsewhere.get(s.index)) for s in self.state.inventory
        ]

    def _outside(self) -> tuple[Holder, ...]:
        """Who else on this machine holds slots of this service's (one per holder), now."""
        held = {s for a in self.state.attempts.values() for s in a.plan.slots}
        found = self.state.leases.others(
            s.index for s in self.state.inventory if s.index not in held
        )
        by: dict[int | None, tuple[LeaseHolder, list[int]]] = {}
        for slot, h in sorted(found.items()):
            by.setdefault(h.pid, (h, []))[1].append(slot)
        return tuple(
            Holder(h.pid or 0, h.kind or "lease", h.user or "", tuple(slots),
                   h.since or time.time(), None, what=h.words())
            for h, slots in by.values()
        )  # fmt: skip

    def cpu_seconds(self, job_id: int) -> float | None:
        """CPU seconds the running attempt of ``job_id`` has used (None: none, or unknown)."""
        with self.state.lock:
            attempt = self.state.attempts.get(job_id)
        if attempt is None:
            return None
        try:
            runtime = self.state.runtime(attempt.plan.spec.runtime)
        except HoraError:
            return None
        return runtime.cpu_seconds(attempt.plan)

    def cluster_slots(self) -> list[SlotInfo]:
        """The Slurm cluster's GPUs and their holders (none unless ``slurm_conf`` is set)."""
        if self.state.settings.slurm_conf is None:
            return []
        with self.state.lock:
            holders = {
                r.container_id.removeprefix("slurm:"): (a.job_id, a.user, a.kind)
                for a in self.state.attempts.values()
                for r in a.ranks[:1]
                if r.container_id and r.container_id.startswith("slurm:")
            }
        from hora_service.runtimes.slurm import SlurmRuntime  # only where Slurm is used

        runtime = self.state.runtime(RuntimeName.slurm)
        return runtime.cluster_slots(holders) if isinstance(runtime, SlurmRuntime) else []

    def queue_view(self, job_id: int, now: float | None = None) -> QueueView:
        """Where queued ``job_id`` stands (position 0 when it is not queued)."""
        now = time.time() if now is None else now
        with self.state.lock:
            at = self.state.pending.position(job_id)
            job = self.state.pending[job_id][0] if at is not None else None
            attempts = sorted(self.state.attempts.values(), key=lambda a: a.started)
            held = sum(len(a.plan.slots) for a in attempts)
            owner = job.user if job is not None else None
            used = sum(len(a.plan.slots) for a in attempts if a.user == owner)
            outside = self._outside()
        free = len(self.state.inventory) - held - sum(len(h.slots) for h in outside)
        holders = (
            tuple(
                Holder(a.job_id, a.kind, a.user, a.plan.slots, a.started, a.deadline)
                for a in attempts
            )
            + outside
        )
        if job is None or at is None:
            return QueueView(0, 0, free, holders, None, False)
        quota = self.state.quota_of(job.user)
        slots = [Holding(h.id, h.user, h.slots, h.ends_at or INF) for h in holders]
        shadow = reserve(job, free, slots, now).shadow
        return QueueView(
            at + 1, job.need, free, holders, shadow if shadow < INF else None,
            quota is not None and used + job.need > quota,
        )  # fmt: skip

    def blocked_head(self, now: float | None = None) -> tuple[Pending, int] | None:
        """The first queued request (by priority, then age) that the free slots cannot take.

        Returns:
            It and the number of free slots, or None when nothing ready waits for slots
            (or the first waits for its user's own quota, which no other holder frees).
        """
        now = time.time() if now is None else now
        with self.state.lock:
            ready = [
                p for p, due in self.state.pending.values() if p.need > 0 and (due or 0) <= now
            ]
            held = sum(len(a.plan.slots) for a in self.state.attempts.values())
            used: dict[str, int] = {}
            for a in self.state.attempts.values():
                used[a.user] = used.get(a.user, 0) + len(a.plan.slots)
        free = len(self.state.inventory) - held
        for head in sorted(ready, key=queue_order):
            if head.need <= free:
                free -= head.need  # the next pass places it
                continue
            quota = self.state.quota_of(head.user)
            if quota is not None and used.get(head.user, 0) + head.need > quota:
                return None
            return head, free
        return None

    def session_holders(self) -> list[tuple[int, str, int, int]]:
        """``(id, user, priority, slots)`` of the running sessions not being stopped."""
        with self.state.lock:
            return [
                (a.job_id, a.user, PRIORITY_RANK[a.plan.spec.priority], len(a.plan.slots))
                for a in self.state.attempts.values()
                if a.kind == JobKind.session and a.stop_state is None and not a.held
            ]

    def session_jobs(self) -> list[JobRecord]:
        """The sessions queued, starting or running now (their records)."""
        with self.state.lock:
            ids = [a.job_id for a in self.state.attempts.values() if a.kind == JobKind.session]
        return [j for j in (self.state.record(i) for i in ids) if j is not None]

    def queue_snapshot(self) -> tuple[list[tuple[Pending, float | None]], tuple[Holder, ...]]:
        """The queued jobs in queue order (with retry times) and the holders, oldest first."""
        with self.state.lock:
            pending = self.state.pending.ordered()
            attempts = sorted(self.state.attempts.values(), key=lambda a: a.started)
            outside = self._outside()
        holders = tuple(
            Holder(
                a.job_id,
                a.kind,
                a.user,
                a.plan.slots,
                a.started,
                a.deadline,
                a.stop_state is not None,
                name=a.plan.spec.name,
            )  # fmt: skip
            for a in attempts
        )
        return pending, holders + outside

    def metrics(self) -> MetricsSnapshot:
        """Jobs by state, queue length, slots, and submit-to-running latency."""
        counts = self.state.open_store().count_by_state()
        now = time.time()
        with self.state.lock:
            lat = sorted(self.state.latencies)
            allocated = sum(len(a.plan.slots) for a in self.state.attempts.values())
            running: dict[str, float] = {}
            for a in self.state.attempts.values():
                held = len(a.plan.slots) * max(0.0, now - (a.counted or a.started))
                running[a.user] = running.get(a.user, 0.0) + held
        return MetricsSnapshot(
            slot_kind=self.state.slot_kind,
            queue_wait=self.state.usage.wait_rows(),
            slot_hours=self.state.usage.slot_hours(running),
            jobs_by_state=counts,
            queue_length=counts.get("queued", 0) + counts.get("retrying", 0),
            slots_total=len(self.state.inventory),
            slots_allocated=allocated,
            schedule_latency_p50_s=statistics.median(lat) if lat else None,
            schedule_latency_p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            schedule_latency_sum_s=self.state.latency_sum,
            schedule_latency_count=self.state.latency_count,
            schedule_pass_seconds=self.state.last_pass_s,
            store_pending_writes=len(self.state.journal),
            preflight_bandwidth_gbps=self.state.preflight.by_node(),
        )
