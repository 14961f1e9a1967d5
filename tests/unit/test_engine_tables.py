"""A negotiation round's row survives encoding: entries, joined state, and what a rank waits on.

Each member publishes, besides its pending collectives, the one it is blocked on and for how
long (hora.torch._negotiation's deadlock detection reads them); a round is a list of int64s.
"""

from __future__ import annotations

import time

import pytest
from hora.torch import _wire
from hora.torch._comm import Comm, Entry, name_hash
from hora.torch._handles import SIG_LEN


def _entry(name: str, age_s: float, payload: list[int]) -> Entry:
    key = tuple(range(1, SIG_LEN + 1))
    e = Entry("allreduce", name, key, payload, None, None, time.monotonic() + 60)
    e.since -= age_s
    return e


def _comm(*entries: Entry, waiting: str = "") -> Comm:
    comm = Comm(0, [0, 1], 0, None, None, pending=list(entries))
    comm.waiting = name_hash(waiting) if waiting else 0
    return comm


def test_a_rank_that_does_not_wait_publishes_its_entries_only() -> None:
    comm = _comm(_entry("a", 0.0, [3]), _entry("b", 0.0, []))
    t = _wire.decode(_wire.encode(comm))
    assert (t.joined_at, t.waiting, t.waited_us, t.wait_text) == (0, 0, 0, "")
    assert [(h, p) for h, _, _, p in t.entries] == [
        (name_hash("a"), [3]),
        (name_hash("b"), []),
    ]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("grad.w", "allreduce 'grad.w'"),
        ("gradé.ü", "allreduce 'gradé.ü'"),  # non-ASCII names survive the int64 packing
        ("x" * 300, "allreduce '" + "x" * (_wire.WAIT_TEXT_MAX - 11)),  # cut, not refused
    ],
)
def test_a_blocked_rank_publishes_what_it_waits_on(name: str, text: str) -> None:
    comm = _comm(_entry("other", 5.0, []), _entry(name, 2.0, [7, 8]), waiting=name)
    t = _wire.decode(_wire.encode(comm))
    assert t.waiting == name_hash(name)
    assert 2.0e6 <= t.waited_us < 3.0e6
    assert t.wait_text == text
    assert [p for *_, p in t.entries] == [[], [7, 8]]


def test_the_wait_text_comes_only_after_half_the_grace() -> None:
    comm = _comm(_entry("young", 0.0, []), waiting="young")
    t = _wire.decode(_wire.encode(comm))
    assert t.waiting == name_hash("young") and t.wait_text == ""


def test_waiting_on_a_collective_no_longer_pending_publishes_no_wait() -> None:
    comm = _comm(_entry("a", 3.0, []), waiting="gone")
    t = _wire.decode(_wire.encode(comm))
    assert (t.waiting, t.waited_us) == (0, 0)
