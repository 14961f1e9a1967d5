"""The scaling report: per-rank compute, collectives and waiting (data plane, pure, no torch).

One computation serves a notebook cell (``%%distributed --profile``, whose engines record
the collectives hora.torch reports: :mod:`hora.engines.profile`) and a job (its merged
per-rank timeline, the Chrome trace ``HOROVOD_TIMELINE`` names: :func:`from_trace`). Each
rank's collectives become one *record* (:func:`digest`); :func:`summarise` turns every
rank's record into a :class:`ProfileReport`: per rank the wall time, time in collectives,
of which waiting for other ranks, bytes reduced, the bus bandwidth reached against the
preflight's, the slowest rank and why, and an estimated scaling efficiency.

Definitions (per rank, over the cell or the job's timeline):

* **comm**: the union of the intervals in which a collective of this rank was in flight
  (its communicating phase, and a negotiated collective's wait for the other ranks to
  submit it). Overlap with computation counts as comm, so compute is a lower bound.
* **wait**: for each collective, matched across ranks by name and occurrence, the time this
  rank entered it before the last rank did (at most its own duration).
* **compute**: ``wall - comm``; **transfer**: ``comm - wait``.
* **busbw**: bytes of the reducing collectives x ``2 (n - 1) / n`` over their transfer time
  (nccl-tests' allreduce definition).
* **efficiency**: the median rank's compute over the slowest rank's wall time (1.0: no time
  lost to communication or to waiting for a slower rank).
* **slowest rank**: the one with the most compute + transfer (its own work, not waiting);
  *why* is compute or communication, whichever of the two exceeds the median rank's more.

A job's **wall** time per rank runs from the end of its preflight (the ``PREFLIGHT`` event
``hvd.init()`` records), else from its ``TIMELINE_START`` marker, else from its first event,
to its ``TIMELINE_STOP`` marker (``shutdown()``), else to its last event.

Importing this module loads only the standard library.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_OPS = 20_000  # collectives kept per rank for matching; beyond, waits come from QUEUED
PLANNED_QUEUE = "bucket"  # the optimizer's QUEUED (waiting for its bucket) is not comm
# the timeline's markers (instant events) and the preflight's span (hora.torch.timeline)
START, STOP, PREFLIGHT = "TIMELINE_START", "TIMELINE_STOP", "PREFLIGHT"
_NOT_COMM = ("MEMCPY_IN_FUSION_BUFFER", PREFLIGHT)

# (tensor name, phase, start ns, stop ns, bytes, planned): one recorded phase of a collective
Event = tuple[str, str, int, int, int, bool]


# --- one rank's record -------------------------------------------------------------------------
def digest(events: Iterable[Event]) -> dict[str, Any]:
    """This rank's collectives: busy intervals, reduced bytes, and one row per collective.

    Example:
        >>> d = digest([("g", "QUEUED", 0, 50, 8, False), ("g", "ALLREDUCE", 50, 80, 8, False)])
        >>> d["comm_s"], d["bytes_reduced"], d["ops"]
        (8e-08, 8, [['g', 0, 0, 80, 8]])
    """
    busy: list[tuple[int, int]] = []
    ops: dict[tuple[str, int], list[Any]] = {}
    seen: dict[str, int] = {}
    queued: dict[str, int] = {}
    queued_s = 0.0
    for name, phase, start, stop, nbytes, planned in events:
        if phase in _NOT_COMM or (phase == "QUEUED" and planned):
            continue
        busy.append((start, stop))
        if phase == "QUEUED":
            queued[name] = start
            queued_s += (stop - start) / 1e9
            continue
        k = seen.get(name, 0)
        seen[name] = k + 1
        entered = queued.pop(name, start)
        if len(ops) < MAX_OPS:
            ops[(name, k)] = [entered, stop, nbytes if "REDUCE" in phase else 0]
    return {
        "comm_s": union(busy) / 1e9,
        "bytes_reduced": sum(v[2] for v in ops.values()),
        "ops": [[n, k, *v] for (n, k), v in ops.items()],
        "queued_s": queued_s,
        "truncated": len(ops) >= MAX_OPS,
    }


def union(spans: list[tuple[int, int]]) -> int:
    """The total length covered by ``spans`` (overlaps counted once).

    Example:
        >>> union([(0, 10), (5, 20), (30, 31)])
        21
    """
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


# --- the report --------------------------------------------------------------------------------
@dataclass
class RankProfile:
    """One rank's figures for one cell or job."""

    rank: int
    wall_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    bytes_reduced: int
    busbw_gbps: float
    of_preflight: float | None  # busbw / the preflight's busbw (None: no preflight)


@dataclass
class ProfileReport:
    """The scaling report of one ``%%distributed --profile`` cell, or of a job's timeline."""

    ranks: list[RankProfile]
    slowest: int
    why: str
    efficiency: float
    preflight_busbw_gbps: float | None = None
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """One display row per rank."""
        return [
            {
                "rank": r.rank,
                "wall s": f"{r.wall_s:.3f}",
                "compute s": f"{r.compute_s:.3f}",
                "collectives s": f"{r.comm_s:.3f}",
                "waiting s": f"{r.wait_s:.3f}",
                "reduced": fmt_bytes(r.bytes_reduced),
                "busbw GB/s": f"{r.busbw_gbps:.2f}",
                "of preflight": "-" if r.of_preflight is None else f"{100 * r.of_preflight:.0f}%",
            }
            for r in self.ranks
        ]

    def verdict(self) -> str:
        """One line: the slowest rank and why, and the efficiency."""
        line = (
            f"slowest rank {self.slowest} ({self.why}); "
            f"estimated scaling efficiency {100 * self.efficiency:.0f}%"
        )
        return line + "".join(f"; {n}" for n in self.notes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the figures, the display ``rows`` and the ``verdict``."""
        return asdict(self) | {"rows": self.rows(), "verdict": self.verdict()}

    def chart_html(self) -> str:
        """An inline SVG bar per rank: compute, transfer and waiting (no JavaScript)."""
        wall = max((r.wall_s for r in self.ranks), default=0.0) or 1.0
        width, bar, rows = 360, 14, []
        for i, r in enumerate(self.ranks):
            y, x = 4 + i * (bar + 6), 60.0
            rows.append(f'<text x="0" y="{y + 11}" font-size="11">rank {r.rank}</text>')
            for value, colour in ((r.compute_s, "#4c78a8"), (r.comm_s - r.wait_s, "#f58518"),
                                  (r.wait_s, "#bab0ac")):
                w = max(0.0, value) / wall * width
                rows.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" '
                            f'fill="{colour}"/>')
                x += w
        height = 8 + len(self.ranks) * (bar + 6)
        legend = ("compute (blue), transfer (orange), waiting for other ranks (grey); "
                  f"full width = {wall:.3f} s")
        return (f'<svg width="{width + 70}" height="{height}" role="img" '
                f'aria-label="{html.escape(legend)}">{"".join(rows)}</svg>'
                f"<div style='font-size:11px'>{html.escape(legend)}</div>")


def fmt_bytes(n: int) -> str:
    """A size for people, in binary units (the scaling report's, a parked snapshot's).

    Example:
        >>> fmt_bytes(412 << 20), fmt_bytes(3)
        ('412.0 MiB', '3 B')
    """
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _waits(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per rank: time in collectives before the last rank entered them (all; reducing ones)."""
    if any(r.get("truncated") for r in records):
        return [(float(r.get("queued_s", 0.0)), 0.0) for r in records]
    by_op: dict[tuple[str, int], dict[int, tuple[int, int, int]]] = {}
    for i, rec in enumerate(records):
        for name, k, entered, stop, nbytes in rec.get("ops", []):
            by_op.setdefault((name, k), {})[i] = (entered, stop, nbytes)
    spans: list[list[tuple[int, int]]] = [[] for _ in records]
    reducing: list[list[tuple[int, int]]] = [[] for _ in records]
    for members in by_op.values():
        if len(members) < 2:
            continue
        last = max(s for s, _, _ in members.values())
        for i, (s, e, nbytes) in members.items():
            if min(e, last) > s:
                spans[i].append((s, min(e, last)))
                if nbytes:
                    reducing[i].append((s, min(e, last)))
    return [(union(a) / 1e9, union(b) / 1e9) for a, b in zip(spans, reducing, strict=True)]


def summarise(records: list[dict[str, Any]], preflight_busbw_gbps: float | None = None
              ) -> ProfileReport:
    """Every rank's record (:func:`digest` plus ``rank``, ``size``, ``wall_s``) -> the report.

    Args:
        records: one record per rank.
        preflight_busbw_gbps: the preflight's bus bandwidth on the path the ranks used.

    Returns:
        The report, ranks in rank order.
    """
    n = len(records)
    waits = _waits(records)
    ranks = []
    for rec, (wait, reduce_wait) in zip(records, waits, strict=True):
        wall, comm = float(rec["wall_s"]), min(float(rec["comm_s"]), float(rec["wall_s"]))
        wait = min(wait, comm)
        reduce_s = union([(s, e) for _n, _k, s, e, b in rec.get("ops", []) if b]) / 1e9
        transfer = max(reduce_s - reduce_wait, 1e-9)
        bus = rec["bytes_reduced"] * 2 * (n - 1) / n / transfer / 1e9 if n > 1 else 0.0
        ranks.append(RankProfile(
            rank=int(rec["rank"]), wall_s=wall, compute_s=wall - comm, comm_s=comm,
            wait_s=wait, bytes_reduced=int(rec["bytes_reduced"]), busbw_gbps=bus,
            of_preflight=(bus / preflight_busbw_gbps
                          if preflight_busbw_gbps and rec["bytes_reduced"] else None),
        ))
    ranks.sort(key=lambda r: r.rank)
    own = [r.compute_s + (r.comm_s - r.wait_s) for r in ranks]
    slow = ranks[own.index(max(own))]
    med_compute = statistics.median(r.compute_s for r in ranks)
    med_transfer = statistics.median(r.comm_s - r.wait_s for r in ranks)
    extra_compute = slow.compute_s - med_compute
    extra_comm = (slow.comm_s - slow.wait_s) - med_transfer
    if n < 2 or max(extra_compute, extra_comm) < 0.05 * max(slow.wall_s, 1e-9):
        share = slow.comm_s / slow.wall_s if slow.wall_s > 0 else 0.0
        why = f"balanced: {100 * share:.0f}% of its time in collectives"
    elif extra_compute >= extra_comm:
        why = f"compute: {extra_compute:.3f} s more than the median rank"
    else:
        why = f"communication: {extra_comm:.3f} s more transfer than the median rank"
    wall = max(r.wall_s for r in ranks)
    efficiency = min(1.0, med_compute / wall) if wall > 0 else 1.0
    notes = []
    if any(r.get("truncated") for r in records):
        notes.append(f"over {MAX_OPS} collectives: waits estimated from negotiation")
    return ProfileReport(ranks, slow.rank, why, efficiency, preflight_busbw_gbps, notes)


def preflight_busbw(report: Mapping[str, Any] | None) -> float | None:
    """The preflight's bus bandwidth at its largest size on the group's path (gloo/NCCL).

    Example:
        >>> preflight_busbw({"paths": [{"path": "gloo", "busbw_gbps": [0.1, 0.8]}]})
        0.8
    """
    if not report or not report.get("paths"):
        return None
    return float(report["paths"][0]["busbw_gbps"][-1])


# --- a job's timeline --------------------------------------------------------------------------
def records_from_trace(trace: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's record from a job's Chrome-trace events (``pid`` is the rank).

    Args:
        trace: the merged timeline's ``traceEvents`` (and any per-rank parts not merged),
            as :mod:`hora.torch.timeline` writes them; other events are skipped.

    Returns:
        One record per rank that has collectives, in rank order (see :func:`summarise`).
    """
    phases: dict[int, list[Event]] = {}
    marks: dict[int, dict[str, float]] = {}
    for e in trace:
        try:
            rank, ts = int(e.get("pid", -1)), float(e["ts"])
        except (KeyError, TypeError, ValueError):
            continue
        if rank < 0:
            continue
        name, mine = str(e.get("name", "")), marks.setdefault(rank, {})
        if e.get("ph") == "i" and name in (START, STOP):
            mine[name] = ts
        elif e.get("ph") == "X":
            _phase(phases.setdefault(rank, []), mine, name, ts, e)
    first = min((m[START] for m in marks.values() if START in m), default=None)
    return [_record(r, len(phases), phases[r], marks.get(r, {}), first) for r in sorted(phases)]


def _phase(out: list[Event], marks: dict[str, float], name: str, ts: float,
           e: Mapping[str, Any]) -> None:
    given = e.get("args")
    args: Mapping[str, Any] = given if isinstance(given, dict) else {}
    try:
        dur, nbytes = float(e.get("dur", 0.0)), int(args.get("bytes", 0))
    except (TypeError, ValueError):
        return
    if name == PREFLIGHT:
        marks[PREFLIGHT] = max(marks.get(PREFLIGHT, ts + dur), ts + dur)
    start = int(ts * 1000)
    out.append((str(args.get("tensor", "")), name, start, start + int(dur * 1000), nbytes,
                PLANNED_QUEUE in args))


def _record(rank: int, size: int, events: list[Event], marks: Mapping[str, float],
            first: float | None) -> dict[str, Any]:
    """One rank's record, its wall time from its window (see the module docstring)."""
    comm = [e for e in events if e[1] != PREFLIGHT]
    begin_ns = min((e[2] for e in comm), default=0)
    end_ns = max((e[3] for e in comm), default=0)
    if PREFLIGHT in marks or START in marks:
        begin_ns = int(marks.get(PREFLIGHT, marks.get(START, 0.0)) * 1000)
    elif first is not None:  # no marker of its own: from the world's first start
        begin_ns = min(begin_ns, int(first * 1000))
    if STOP in marks:
        end_ns = int(marks[STOP] * 1000)
    inside = [e for e in comm if e[2] >= begin_ns]
    return {"rank": rank, "size": size, "wall_s": max(0, end_ns - begin_ns) / 1e9,
            **digest(inside)}


def from_trace(trace: Iterable[Mapping[str, Any]], preflight_busbw_gbps: float | None = None
               ) -> ProfileReport | None:
    """A job's scaling report from its timeline; None when no rank recorded a collective.

    Args:
        trace: the timeline's events (see :func:`records_from_trace`).
        preflight_busbw_gbps: the job's preflight bus bandwidth (:func:`preflight_busbw`).

    Example:
        >>> def ev(rank, name, ts, dur, **args):
        ...     return {"ph": "X", "pid": rank, "name": name, "ts": ts, "dur": dur,
        ...             "args": {"tensor": "g", "bytes": 4096, **args}}
        >>> trace = [{"ph": "i", "pid": r, "name": n, "ts": t} for r in (0, 1)
        ...          for n, t in (("TIMELINE_START", 0), ("TIMELINE_STOP", 1e6))]
        >>> trace += [ev(0, "ALLREDUCE", 2e5, 8e5), ev(1, "ALLREDUCE", 9e5, 1e5)]
        >>> report = from_trace(trace)  # rank 0 waits 0.7 s for rank 1's compute
        >>> [(r.rank, round(r.wait_s, 3), round(r.compute_s, 3)) for r in report.ranks]
        [(0, 0.7, 0.2), (1, 0.0, 0.9)]
        >>> report.slowest, report.why, round(report.efficiency, 2)
        (1, 'compute: 0.350 s more than the median rank', 0.55)
    """
    records = records_from_trace(trace)
    return summarise(records, preflight_busbw_gbps) if records else None
