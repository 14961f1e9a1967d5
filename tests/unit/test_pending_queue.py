"""The job queue keeps its order and its per-user counts through every change
(hora_service.jobs.pending.PendingQueue)."""

from __future__ import annotations

import collections

import pytest
from hora_service.jobs.pending import PendingQueue
from hora_service.scheduling.scheduler import Pending, queue_order
from hypothesis import given
from hypothesis import strategies as st

# one change to the queue: ("set", id, user, priority, due) or ("del" | "pop", id)
changes = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(1, 30), st.sampled_from(["ann", "bob", "cy"]),
                  st.integers(0, 2), st.sampled_from([None, 5.0, 9.0])),
        st.tuples(st.sampled_from(["del", "pop"]), st.integers(1, 30)),
    ),
    max_size=80,
)


@given(changes)
def test_order_and_counts_match_a_plain_dict_after_any_changes(steps: list[tuple]) -> None:
    q, plain = PendingQueue(), {}
    for step in steps:
        job_id = step[1]
        if step[0] == "set":
            _, _, user, priority, due = step
            q[job_id] = plain[job_id] = (Pending(job_id, user, 1, priority=priority), due)
        elif job_id in plain:
            removed = q.pop(job_id) if step[0] == "pop" else q[job_id]
            if step[0] == "del":
                del q[job_id]
            assert removed == plain.pop(job_id)
        else:
            with pytest.raises(KeyError):
                q.pop(job_id) if step[0] == "pop" else q.__delitem__(job_id)
        assert dict(q) == plain
        expected = sorted(plain.values(), key=lambda e: queue_order(e[0]))
        assert q.ordered() == expected
        assert [q.position(p.id) for p, _ in expected] == list(range(len(expected)))
        assert all(q.position(i) is None for i in range(1, 31) if i not in plain)
        times = [t for _, t in plain.values() if t is not None]
        assert q.next_due() == (min(times) if times else None)
        counts = collections.Counter(p.user for p, _ in plain.values())
        assert {u: q.waiting(u) for u in ("ann", "bob", "cy")} == {
            u: counts[u] for u in ("ann", "bob", "cy")
        }


def test_pop_with_a_default_and_clear() -> None:
    q = PendingQueue()
    q[1] = (Pending(1, "ann", 1), None)
    assert q.pop(2, None) is None
    assert q.pop(1, None) == (Pending(1, "ann", 1), None)
    q[3] = (Pending(3, "bob", 2), 9.0)
    q.clear()
    assert q == {} and q.ordered() == [] and q.waiting("bob") == 0 and q.next_due() is None


@pytest.mark.parametrize("change", ["update", "setdefault", "popitem", "ior"])
def test_the_changes_that_would_bypass_the_order_are_refused(change: str) -> None:
    q = PendingQueue()
    q[1] = (Pending(1, "ann", 1), None)
    entry = (Pending(2, "bob", 1), None)
    with pytest.raises(TypeError, match="item assignment, del, pop or clear"):
        if change == "update":
            q.update({2: entry})
        elif change == "setdefault":
            q.setdefault(2, entry)
        elif change == "popitem":
            q.popitem()
        else:
            q |= {2: entry}
    assert q.ordered() == [(Pending(1, "ann", 1), None)] and q.waiting("bob") == 0
