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


class _Kernel:
    """The two attributes of an ipykernel kernel that counted() wraps, recording what is sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.session = self

    def send(self, stream: object, msg_or_type: str, *args: object, **kwargs: object) -> str:
        self.sent.append(msg_or_type)
        return msg_or_type

    def finish_metadata(self, parent: object, metadata: dict, reply: dict) -> dict:
        return metadata


def test_an_engine_counts_its_outputs_and_does_not_echo_the_code() -> None:
    kernel = _Kernel()
    outputs.counted(kernel)
    request = {"header": {"msg_id": "r1"}}
    for kind in ("status", "execute_input", "stream", "execute_result", "status"):
        kernel.session.send(None, kind, {}, request)
    reply: dict = {"status": "ok"}
    kernel.finish_metadata(request, {}, reply)
    assert kernel.sent == ["status", "stream", "execute_result", "status"]
    assert reply[outputs.KEY] == 2


def test_a_failed_cell_keeps_its_execution_count_where_the_kernel_reads_it() -> None:
    from hora.engines import _ipp
    from ipyparallel.error import unwrap_exception

    kernel = _Kernel()
    outputs.counted(kernel)
    reply: dict = {"status": "error", "execution_count": 7, "ename": "KeyError",
                   "evalue": "'k'", "traceback": [], "engine_info": {"engine_id": 0}}
    kernel.finish_metadata({"header": {"msg_id": "r2"}}, {}, reply)
    assert _ipp.reply_count(unwrap_exception(reply)) == 7
    assert _ipp.reply_count(object()) is None
