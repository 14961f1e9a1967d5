"""The scheduling pass: examples of the policy, and its invariants under random event streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from hora_service.scheduling.scheduler import (
    INF,
    Holding,
    Pending,
    Placement,
    Reservation,
    queue_order,
    reserve,
    schedule,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def test_gang_all_or_nothing() -> None:
    assert schedule([Pending(1, "a", 3)], free=[0, 1]) == []
    (p,) = schedule([Pending(1, "a", 3)], free=[4, 0, 2])
    assert p.slots == (0, 2, 4)


def test_priority_then_fifo() -> None:
    queue = [Pending(1, "a", 1, 0), Pending(2, "a", 1, 1), Pending(3, "a", 1, 2)]
    queue.append(Pending(4, "a", 1, 2))
    assert [p.job_id for p in schedule(queue, free=[0, 1, 2])] == [3, 4, 2]


def test_backfill_uses_only_what_the_head_cannot_use() -> None:
    running = [Holding(9, "b", (2, 3), ends_at=100.0)]
    queue = [Pending(1, "a", 3), Pending(2, "a", 2), Pending(3, "a", 1)]
    # head (3 slots) starts at t=100 with 4 free, so 1 slot is spare: job 3 fits, job 2 not
    placed = schedule(queue, free=[0, 1], holding=running, now=0.0)
    assert [(p.job_id, p.backfill) for p in placed] == [(3, True)]


def test_backfill_of_a_job_that_ends_before_the_head_starts() -> None:
    running = [Holding(9, "b", (2, 3), ends_at=100.0)]
    queue = [Pending(1, "a", 4), Pending(2, "a", 2, timeout_s=50.0)]
    queue.append(Pending(3, "a", 2, timeout_s=500.0))
    placed = schedule(queue, free=[0, 1], holding=running, now=0.0)
    assert [p.job_id for p in placed] == [2]


def test_no_time_based_backfill_when_the_head_start_is_unknown() -> None:
    running = [Holding(9, "b", (2, 3))]  # no timeout: the head's start time is unknown
    queue = [Pending(1, "a", 4), Pending(2, "a", 2, timeout_s=1.0)]
    assert schedule(queue, free=[0, 1], holding=running) == []


def test_quota_blocked_job_reserves_nothing() -> None:
    queue = [Pending(1, "a", 2), Pending(2, "b", 2)]
    placed = schedule(queue, free=[0, 1], quota=lambda u: 1 if u == "a" else None)
    assert [(p.job_id, p.backfill) for p in placed] == [(2, False)]


def test_reserve_counts_jobs_ending_together() -> None:
    holding = [Holding(1, "x", (0,), 10.0), Holding(2, "x", (1,), 10.0)]
    holding.append(Holding(3, "x", (2,), 20.0))
    assert reserve(Pending(9, "a", 1), 0, holding, 0.0).shadow == 10.0
    assert reserve(Pending(9, "a", 1), 0, holding, 0.0).extra == 1


# --- random event streams ----------------------------------------------------------------


@dataclass
class Cluster:
    """A simulated cluster: the pass decides, the simulation applies and checks."""

    size: int
    quota: int | None
    now: float = 0.0
    queue: dict[int, Pending] = field(default_factory=dict)
    running: dict[int, Holding] = field(default_factory=dict)
    next_id: int = 1

    def free(self) -> list[int]:
        held = {s for h in self.running.values() for s in h.slots}
        return [s for s in range(self.size) if s not in held]

    def used(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.running.values():
            out[h.user] = out.get(h.user, 0) + len(h.slots)
        return out

    def limit(self, user: str) -> int | None:
        return self.quota

    def run_pass(self) -> Reservation | None:
        """One pass, checked; returns the head's reservation as the pass saw it, if any."""
        before, queued, used = set(self.free()), dict(self.queue), self.used()
        placed = schedule(
            list(self.queue.values()),
            sorted(before),
            list(self.running.values()),
            self.now,
            self.limit if self.quota is not None else None,
            used,
        )
        taken: set[int] = set()
        for p in placed:
            job = self.queue.pop(p.job_id)
            assert len(p.slots) == job.need, "gang: a job gets all its slots or none"
            assert set(p.slots) <= before and not taken & set(p.slots), "a slot in two jobs"
            taken |= set(p.slots)
            ends = self.now + job.timeout_s if job.timeout_s else INF
            self.running[job.id] = Holding(job.id, job.user, p.slots, ends)
        if self.quota is not None:
            assert all(n <= self.quota for n in self.used().values()), "quota exceeded"
        return self.replay(queued, placed, len(before), used)

    def replay(
        self, queued: dict[int, Pending], placed: list[Placement], free: int, used: dict[str, int]
    ) -> Reservation | None:
        """Walk the queue in order as the pass did: jobs before the head start in order
        (priority, then FIFO), the head is the first that does not fit, and backfill leaves
        the head's shadow time where it was."""
        prefix = {p.job_id: p for p in placed if not p.backfill}
        hold = [h for h in self.running.values() if h.id not in {p.job_id for p in placed}]
        used = dict(used)
        for job in sorted(queued.values(), key=queue_order):
            if job.id in prefix:
                free -= job.need
                used[job.user] = used.get(job.user, 0) + job.need
                hold.append(self.running[job.id])
                continue
            if self.quota is not None and used.get(job.user, 0) + job.need > self.quota:
                continue
            assert job.need > free, f"job {job.id} fit but was passed over before the head"
            res = reserve(job, free, hold, self.now)
            after = reserve(job, len(self.free()), list(self.running.values()), self.now)
            assert after.shadow <= res.shadow, f"backfill delayed the head: {res} -> {after}"
            return res
        assert not [p for p in placed if p.backfill], "backfill without a head"
        return None


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(1, 6),  # need
            st.integers(0, 2),  # priority
            st.sampled_from(["ann", "bob", "cid"]),
            st.one_of(st.none(), st.integers(1, 50)),  # timeout
        ),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("advance"), st.integers(1, 20)),
    ),
    min_size=200,
    max_size=200,
)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 8), quota=st.one_of(st.none(), st.integers(1, 8)), stream=events)
def test_invariants_under_random_events(size: int, quota: int | None, stream: list[tuple]) -> None:
    """200 random submit/cancel/finish events, a pass after each: no slot in two jobs, gang
    placement, quota kept, priority-then-FIFO order, and backfill never delays the head."""
    c = Cluster(size, quota)
    for event in stream:
        kind = event[0]
        if kind == "submit" and event[1] <= size:
            c.queue[c.next_id] = Pending(c.next_id, event[3], event[1], event[2], event[4])
            c.next_id += 1
        elif kind == "finish" and c.running:
            c.running.pop(sorted(c.running)[event[1] % len(c.running)])
        elif kind == "cancel" and c.queue:
            c.queue.pop(sorted(c.queue)[event[1] % len(c.queue)])
        elif kind == "advance":
            c.now += event[1]
        c.run_pass()


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 8),
    jobs=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 30)), min_size=5, max_size=60),
    early=st.lists(st.booleans(), min_size=60, max_size=60),
)
def test_head_job_never_starves(size: int, jobs: list[tuple[int, int]], early: list[bool]) -> None:
    """Every job has a timeout and ends by it (some earlier); one priority, so later
    arrivals queue behind the head. The head starts no later than the shadow time it was
    given when it became the head, however many jobs were backfilled meanwhile."""
    c = Cluster(size, None)
    arrivals = [(i * 0.5, need, t) for i, (need, t) in enumerate(jobs) if need <= size]
    promised: dict[int, float] = {}
    started: dict[int, float] = {}
    ends: dict[int, float] = {}
    for _ in range(10_000):
        if not (arrivals or c.queue or c.running):
            break
        c.now = min(arrivals[0][0] if arrivals else INF, min(ends.values(), default=INF))
        while arrivals and arrivals[0][0] <= c.now:
            _, need, t = arrivals.pop(0)
            c.queue[c.next_id] = Pending(c.next_id, "u", need, 1, float(t))
            c.next_id += 1
        for job_id in [j for j, e in ends.items() if e <= c.now]:
            del ends[job_id], c.running[job_id]
        running_before = set(c.running)
        res = c.run_pass()
        if res is not None:
            promised.setdefault(res.job_id, res.shadow)
        for job_id in set(c.running) - running_before:
            started[job_id] = c.now
            t = c.running[job_id].ends_at - c.now
            ends[job_id] = c.now + (t / 2 if early[job_id % len(early)] else t)
    else:
        raise AssertionError("the simulation did not drain")
    assert set(started) == set(range(1, c.next_id)), "every job ran"
    for job_id, shadow in promised.items():
        assert started[job_id] <= shadow, (job_id, started[job_id], shadow)
