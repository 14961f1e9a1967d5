"""Every kind of wait reason, from the pure rules of hora_service.scheduling.reasons
(milliseconds)."""

from __future__ import annotations

import pytest
from hora.spec import QueueInfo, ReasonKind, WaitReason
from hora_service.scheduling.reasons import (
    INF,
    QueueState,
    ReasonBoard,
    explain_queue,
    gang_reason,
    image_reason,
    runtime_reason,
)
from hora_service.scheduling.scheduler import Holding, Pending, schedule


def state(queue: list[Pending], total: int, holding: list[Holding], **kw: object) -> QueueState:
    return QueueState(queue=queue, total=total, holding=holding, now=100.0, **kw)  # type: ignore[arg-type]


def test_slots_reason_counts_and_names_holders_without_an_estimate() -> None:
    q = state([Pending(5, "ann", 3)], 4, [Holding(1, "bob", (0, 1), ends_at=INF)])
    why = explain_queue(q)[5]
    assert why.kind == ReasonKind.slots
    assert (why.asked, why.free, why.total) == (3, 2, 4)
    assert why.estimate_at is None
    assert "waiting for 3 slot(s): 2 of 4 free" in why.text and "bob (job 1)" in why.text
    assert "no estimate" in why.text


def test_slots_reason_estimates_from_the_holders_time_limits() -> None:
    holding = [Holding(1, "bob", (0, 1), ends_at=160.0), Holding(2, "bob", (2,), ends_at=130.0)]
    why = explain_queue(state([Pending(5, "ann", 3)], 3, holding))[5]
    # 2 slots free at 130 are not enough; at 160 all 3 are
    assert why.estimate_at is not None and why.estimate_at.timestamp() == 160.0
    assert "expected free by" in why.text


def test_quota_reason_says_what_the_user_holds() -> None:
    quota = {"ann": 2}.get
    q = state([Pending(5, "ann", 2)], 8, [Holding(1, "ann", (0,))], quota=quota)
    why = explain_queue(q)[5]
    assert (why.kind, why.limit, why.used, why.asked) == (ReasonKind.quota, 2, 1, 2)
    assert "your quota" in why.text


def test_running_limit_reason() -> None:
    q = state([Pending(5, "ann", 1)], 8, [Holding(1, "ann", (0,))], running_limit=1)
    why = explain_queue(q)[5]
    assert (why.kind, why.limit, why.used) == (ReasonKind.running_limit, 1, 1)


def test_priority_reason_names_the_reserving_head() -> None:
    # 1 slot free: the high-priority head needs 4 and reserves everything; a small job that
    # would fit in the free slot may not delay it (nothing ends in time to backfill)
    queue = [Pending(7, "bob", 4, priority=2), Pending(8, "ann", 1, priority=1)]
    holding = [Holding(1, "carl", (0, 1, 2), ends_at=INF)]
    reasons = explain_queue(state(queue, 4, holding))
    assert reasons[7].kind == ReasonKind.slots
    why = reasons[8]
    assert (why.kind, why.ahead, why.ahead_priority) == (ReasonKind.priority, 7, "high")
    # the scheduler agrees: it starts neither
    assert schedule(queue, [3], holding, 100.0) == []


def test_backoff_reason_until_the_retry_time() -> None:
    q = state([Pending(5, "ann", 1)], 4, [], due={5: 130.0})
    why = explain_queue(q)[5]
    assert why.kind == ReasonKind.backoff and why.retry_at is not None
    assert why.retry_at.timestamp() == 130.0


def test_a_job_that_fits_with_nothing_ahead_is_starting() -> None:
    why = explain_queue(state([Pending(5, "ann", 1)], 4, []))[5]
    assert why.kind == ReasonKind.slots and why.text.startswith("starting")


@pytest.mark.parametrize(
    ("reason", "kind", "field", "value"),
    [
        (gang_reason(16, 8), ReasonKind.gang, "asked", 16),
        (image_reason("hora:cpu"), ReasonKind.image, "image", "hora:cpu"),
        (runtime_reason("slurm", "Resources"), ReasonKind.runtime, "detail", "Resources"),
    ],
)
def test_reasons_the_rules_do_not_compute(
    reason: WaitReason, kind: str, field: str, value: object
) -> None:
    assert reason.kind == kind and getattr(reason, field) == value and reason.text


def test_a_posted_reason_replaces_until_cleared() -> None:
    board = ReasonBoard()
    board.post(5, runtime_reason("slurm", "Priority"))
    assert board.get(5) is not None and board.all()[5].source == "slurm"
    board.clear(5)
    assert board.get(5) is None and board.all() == {}


def test_a_client_keeps_a_kind_it_does_not_know() -> None:
    data = {"position": 1, "need": 1, "free": 0, "holders": [], "reason": "x",
            "why": {"kind": "future_kind", "text": "x", "new_field": 1}}  # fmt: skip
    info = QueueInfo.model_validate(data)
    assert info.why is not None and info.why.kind == "future_kind"


def test_a_pass_for_one_job_stops_there_and_agrees_with_the_full_pass() -> None:
    queue = [Pending(i, "ann", 3 if i % 2 else 1, timeout_s=None) for i in range(1, 9)]
    q = state(queue, 4, [Holding(100, "bob", (0, 1, 2))], due={2: 500.0})
    full = explain_queue(q)
    part = explain_queue(q, until=4)
    assert set(part) == {1, 2, 3, 4} and all(part[i] == full[i] for i in part)


def test_entries_that_wait_alike_share_a_reason_and_others_keep_their_own() -> None:
    # one reason per (size, free slots) in a pass: 200 queued entries are a few reasons
    queue = [Pending(1, "ann", 1), Pending(2, "bob", 3), Pending(3, "ann", 3), Pending(4, "c", 1)]
    out = explain_queue(state(queue, 4, [Holding(9, "dan", (0, 1, 2))]))
    assert out[1].text == "starting: 1 of 1 free slot(s) are being assigned"
    assert out[2] is out[3] and (out[2].asked, out[2].free) == (3, 0)
    assert out[4].kind == ReasonKind.slots and (out[4].asked, out[4].free) == (1, 0)
    assert "waiting for 1 slot(s): 0 of 4 free" in out[4].text


def _one(queue: list[Pending], total: int, holding: list[Holding], **kw: object) -> WaitReason:
    return explain_queue(state(queue, total, holding, **kw))[5]


BOB = [Holding(1, "bob", (0, 1))]
ANN = [Holding(1, "ann", (0,))]
EVERY_KIND = [
    _one([Pending(5, "ann", 3)], 4, BOB),
    _one([Pending(5, "ann", 2)], 8, ANN, quota={"ann": 2}.get),
    _one([Pending(5, "ann", 1)], 8, ANN, running_limit=1),
    _one([Pending(7, "b", 4, 2), Pending(5, "ann", 1)], 4, [Holding(1, "c", (0, 1, 2))]),
    _one([Pending(5, "ann", 1)], 4, [], due={5: 130.0}),
    image_reason("hora:cpu"),
    runtime_reason("slurm", "Resources"),
    gang_reason(16, 8),
]


@pytest.mark.parametrize("why", EVERY_KIND, ids=lambda w: w.kind)
def test_the_notebook_queue_display_shows_each_kind(why: WaitReason) -> None:
    from datetime import UTC, datetime

    from hora.engines.session import render_queue
    from hora.spec import SessionInfo

    now = datetime(2026, 1, 1, tzinfo=UTC)
    info = SessionInfo(
        id=5, user="ann", name="s", state="queued", workers=1, slots=[], created_at=now,
        lease_s=30,
        queue=QueueInfo(position=1, need=1, free=0, holders=[], reason=why.text, why=why),
    )  # fmt: skip
    first = render_queue(info, now).splitlines()[0]
    assert first.startswith("session 5 queued: position 1; " + why.text)


def test_every_kind_is_covered_above() -> None:
    assert {w.kind for w in EVERY_KIND} == {k.value for k in ReasonKind}
