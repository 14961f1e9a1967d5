"""The wire format of a negotiation round: one member's row of int64s, and its exchange.

Every member of a process set publishes one row per round (:func:`encode`): whether it has
joined (and when), the collective it blocks on (name hash, how long, and once it has waited
half of ``DEADLOCK_GRACE_S`` its "kind 'name'" text), then each pending collective as
(name hash, expired, signature, payload). :func:`exchange` all-gathers the rows, through the
members' shared memory when they share a machine, else on the gloo side group;
:func:`decode` reads a row back into a :class:`Row`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hora.torch import _hier, _stall
from hora.torch._comm import Comm
from hora.torch._handles import SIG_LEN

_CAP = 96  # ints in the first all_gather of a round; longer tables take a second one
# How long every member must have been blocked, none in a collective all of them submitted,
# before the longest waiter gives up (CollectiveDeadlock): time for a submission from
# another thread of some rank, which would unblock them, to arrive
DEADLOCK_GRACE_S = 1.0
WAIT_TEXT_MAX = 120  # bytes of "kind 'name'" a blocked member publishes


@dataclass
class Row:
    """One member's row of a round, decoded.

    Attributes:
        joined_at: when the member joined, in µs (0 when it has not).
        waiting: the name hash of the collective the member blocks on (0: not blocked).
        waited_us: how long ago the member submitted that collective.
        wait_text: "kind 'name'" of it, once the member has waited half the grace period.
        entries: (name hash, expired, signature, payload) of each pending collective.
    """

    joined_at: int
    waiting: int
    waited_us: int
    wait_text: str
    entries: list[tuple[int, bool, tuple[int, ...], list[int]]]


def _pack(text: str) -> list[int]:
    raw = text.encode()[:WAIT_TEXT_MAX]
    raw += b"\0" * (-len(raw) % 8)
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _unpack(ints: list[int]) -> str:
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in ints)
    return raw.rstrip(b"\0").decode(errors="replace")


def encode(comm: Comm) -> list[int]:
    """Encode this member's row of a round (marking entries past their deadline expired)."""
    now = time.monotonic()
    waited = next((e for e in comm.pending if e.hashed == comm.waiting), None)
    text: list[int] = []
    if waited is not None and now - waited.since >= DEADLOCK_GRACE_S / 2:
        text = _pack(f"{waited.kind} {waited.name!r}")
    out = [
        1 if comm.joined else 0,
        comm.joined_at,
        0 if waited is None else waited.hashed,
        0 if waited is None else int((now - waited.since) * 1e6),
        len(text),
        *text,
        len(comm.pending),
    ]
    for e in comm.pending:
        if not e.expired and now > e.deadline:
            e.expired = True
        out += [e.hashed, 1 if e.expired else 0, *e.key, len(e.payload), *e.payload]
    return out


def decode(row: list[int]) -> Row:
    """Decode one member's row of a round (what :func:`encode` wrote)."""
    tlen = row[4]
    text = _unpack(row[5 : 5 + tlen]) if tlen else ""
    i = 5 + tlen
    n = row[i]
    entries, i = [], i + 1
    for _ in range(n):
        h, exp = row[i], bool(row[i + 1])
        key = tuple(row[i + 2 : i + 2 + SIG_LEN])
        plen = row[i + 2 + SIG_LEN]
        payload = row[i + 3 + SIG_LEN : i + 3 + SIG_LEN + plen]
        entries.append((h, exp, key, payload))
        i += 3 + SIG_LEN + plen
    return Row(row[1] if row[0] else 0, row[2], row[3], text, entries)


def exchange(comm: Comm, mine: list[int], op: str, name: str) -> list[list[int]]:
    """All-gather every member's table.

    Through the members' shared memory when they share a machine (:mod:`hora.torch._shm`,
    set up by every member at its first round), else one all_gather on the side group (two
    when a table is long).
    """
    ring = _hier.ring_of(comm, op)
    if ring is not None:
        tables = ring.allgather_ints(mine, op, name)
        if tables is not None:
            return tables
    first = torch.zeros(_CAP + 1, dtype=torch.int64)
    first[0] = len(mine)
    head = mine[:_CAP]
    first[1 : 1 + len(head)] = torch.tensor(head, dtype=torch.int64)
    rows = [torch.empty_like(first) for _ in range(comm.size)]
    # blocking: the side group's own timeout (init's) bounds it, and on this machine a
    # blocking all_gather costs a third of an async one plus a timed wait (270 vs 780 µs)
    _stall.run_guarded(op, name, dist.all_gather, rows, first, group=comm.side)
    lengths = [int(r[0]) for r in rows]
    if max(lengths) <= _CAP:
        return [r[1 : 1 + n].tolist() for r, n in zip(rows, lengths, strict=True)]
    top = max(lengths)
    full = torch.zeros(top, dtype=torch.int64)
    full[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    big = [torch.empty_like(full) for _ in range(comm.size)]
    _stall.run_guarded(op, name, dist.all_gather, big, full, group=comm.side)
    return [r[:n].tolist() for r, n in zip(big, lengths, strict=True)]
