"""The per-user running-job limit applied before each scheduling pass
(hora_service.users.quotas)."""

from __future__ import annotations

from hora_service.scheduling.scheduler import Pending, queue_order
from hora_service.users.quotas import within_running_limit
from hypothesis import given
from hypothesis import strategies as st

jobs = st.lists(
    st.builds(
        Pending,
        id=st.integers(1, 10_000),
        user=st.sampled_from(["ann", "bob", "cy"]),
        need=st.integers(1, 4),
        priority=st.integers(0, 2),
    ),
    unique_by=lambda p: p.id,
    max_size=40,
)


def test_each_user_keeps_their_first_jobs_in_queue_order() -> None:
    ready = [Pending(3, "ann", 1), Pending(1, "ann", 1, priority=0), Pending(2, "ann", 1)]
    kept = within_running_limit(ready, {"ann": 1}, 3)
    assert [p.id for p in kept] == [2, 3]  # 2 of 3 left; the low-priority one waits
    assert within_running_limit(ready, {"ann": 3}, 3) == []
    assert within_running_limit(ready, {}, None) == ready


@given(jobs, st.dictionaries(st.sampled_from(["ann", "bob", "cy"]), st.integers(0, 5)),
       st.integers(1, 5))  # fmt: skip
def test_a_queue_already_in_order_gives_the_same_answer(
    ready: list[Pending], running: dict[str, int], limit: int
) -> None:
    ordered = sorted(ready, key=queue_order)
    got = within_running_limit(ordered, running, limit, ordered=True)
    assert got == within_running_limit(ready, running, limit)
    for user in ("ann", "bob", "cy"):
        assert sum(p.user == user for p in got) <= max(0, limit - running.get(user, 0))
