"""The kernel's tally of a cell's outputs per rank (hora.engines.outputs.Tally).

A rank is complete when its reply announced a count and that many outputs came; an engine
whose reply announces nothing is never complete by the tally (the kernel waits for IOPub's
idle then). The engines' side is tested end to end in tests/e2e/test_magics_shell.py.
"""

from __future__ import annotations

from hora.engines import outputs


def test_a_rank_is_complete_once_its_announced_outputs_came() -> None:
    t = outputs.Tally()
    t.seen(0, "stream")
    t.seen(0, "status")  # not an output
    t.replied(0, {"status": "ok", outputs.KEY: 2})
    assert not t.complete(0)
    t.seen(0, "display_data")
    assert t.complete(0)


def test_a_reply_without_a_count_leaves_the_rank_to_idle() -> None:
    t = outputs.Tally()
    t.replied(1, {"status": "ok"})
    t.replied(2, {"status": "ok", outputs.KEY: True})  # not a count
    t.replied(3, None)  # ipyparallel kept no content
    assert not any(t.complete(r) for r in (1, 2, 3))


def test_a_silent_cell_is_complete_at_its_reply_and_forget_starts_over() -> None:
    t = outputs.Tally()
    t.replied(0, {"status": "ok", outputs.KEY: 0})
    assert t.complete(0)
    t.forget(0)
    assert not t.complete(0)


def test_only_output_messages_answering_a_request_are_counted() -> None:
    parent = {"header": {"msg_id": "abc"}}
    assert outputs._parent_id("stream", ({}, parent), {}) == "abc"
    assert outputs._parent_id("stream", (), {"parent": parent["header"]}) == "abc"
    assert outputs._parent_id("status", (), {"parent": parent}) is None
    msg = {"header": {"msg_type": "display_data"}, "parent_header": {"msg_id": "m1"}}
    assert outputs._parent_id(msg, (), {}) == "m1"
