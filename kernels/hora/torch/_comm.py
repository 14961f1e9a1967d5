"""A process set's negotiation state on this rank: its :class:`Comm` and pending :class:`Entry`.

The rounds (:mod:`hora.torch._negotiation`) read and write these; the wire format
(:mod:`hora.torch._wire`) encodes them; :mod:`hora.torch._engine` submits into them.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hora.torch._handles import Handle

# A launcher gets every member's payload row (None for a member that joined and serves) and
# returns the Works in flight and the finishing step (average, copy back) for the handle, and
# optionally the bytes moved when only the rows tell (allgather).
Launch = Callable[[list[list[int] | None]], tuple[Any, ...]]
# A server launches, on a rank that joined, its part of a collective it did not submit.
Serve = Callable[["Comm", Sequence[int], list[list[int] | None]], list[Any]]


def name_hash(name: str) -> int:
    """A 62-bit hash of a collective's name, the same in every process."""
    data = name.encode()
    return (zlib.crc32(data) << 30) ^ zlib.adler32(data)


@dataclass(eq=False)
class Entry:
    """A collective submitted on this rank and not launched yet."""

    kind: str
    name: str
    key: tuple[int, ...]
    payload: list[int]
    launch: Launch | None
    handle: Handle | None
    deadline: float
    expired: bool = False
    hashed: int = 0
    since: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.hashed = name_hash(self.name)


@dataclass(eq=False)
class Comm:
    """A process set's communication state on this rank.

    Attributes:
        set_id: the process set's id (0: the global set).
        ranks: the members' global ranks, ascending.
        index: this rank's position in ``ranks`` (-1 when not a member).
        group: the data group (the default group for the global set).
        side: the gloo group the rounds and object collectives use.
        pending: entries submitted here and not launched, in submission order.
        inflight: names of this rank's collectives not finished yet (duplicate check).
        counters: per-op counters for unnamed collectives ("allreduce.noname.3").
        joined: this rank called ``join()`` and serves the others until all joined.
        joined_before: members seen joined in the last round (to name the last joiner).
        shm: the members' shared-memory ring (:mod:`hora.torch._shm`), when they have one.
        shm_lane: its second ring, run by a thread (:mod:`hora.torch._lane`): plain allreduces.
        shm_decided: whether the members decided on ``shm`` yet (they do it once, together).
        waiting: the name hash of the collective this rank blocks on (in ``synchronize``,
            ``barrier``, a blocking call), 0 while it does not; published in every round.
    """

    set_id: int
    ranks: list[int]
    index: int
    group: Any
    side: Any
    pending: list[Entry] = field(default_factory=list)
    inflight: dict[str, Handle] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    joined: bool = False
    joined_at: int = 0
    joined_before: frozenset[int] = frozenset()
    last_joined: int = -1
    shm: Any = None
    shm_lane: Any = None
    shm_decided: bool = False
    waiting: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def member(self, global_rank: int) -> int:
        """Return the position of a global rank in this set (ValueError when not a member)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in the process set {self.ranks}") from None

    def auto_name(self, op: str) -> str:
        n = self.counters.get(op, 0) + 1
        self.counters[op] = n
        return f"{op}.noname.{n}"

    def give_back(self, name: str) -> None:
        """Return the number of a failed unnamed collective, when it was the last one issued.

        A rank whose unnamed collective failed without the others submitting it (it timed out
        waiting for them) would otherwise be one number ahead of them for good, and every
        later unnamed collective of that kind would pair with the wrong one.
        """
        op, sep, n = name.rpartition(".noname.")
        if sep and n.isdigit() and self.counters.get(op) == int(n):
            self.counters[op] = int(n) - 1
