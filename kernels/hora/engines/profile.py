"""``%dist_start``'s preflight line and ``%%distributed --profile``'s scaling report.

Engine side (run through ipyparallel's ``apply``): :func:`engine_preflight` runs
:func:`hora.torch.preflight.run`; :func:`begin` and :func:`end` bracket one cell: they time
the cell's execution (IPython's ``pre_run_cell``/``post_run_cell`` events) and collect the
collectives hora.torch records (the timeline's in-process listener, with or without a
timeline file).

Kernel side: :func:`summarise` turns every rank's record into a :class:`ProfileReport`:
per rank the wall time, time in collectives, of which waiting for other ranks, bytes
reduced, the bus bandwidth reached against the preflight's, the slowest rank and why, and
an estimated scaling efficiency.

Definitions (per rank, over the cell):

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
"""

from __future__ import annotations

import html
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

MAX_OPS = 20_000  # collectives kept per rank for matching; beyond, waits come from QUEUED
_PLANNED_QUEUE = "bucket"  # the optimizer's QUEUED (waiting for its bucket) is not comm

_ACTIVE: dict[str, Any] = {}


# --- engine side -------------------------------------------------------------------------------
def engine_preflight() -> dict[str, Any]:
    """Run the preflight on this engine (every engine at once); its report or the error.

    Returns:
        ``{"report": dict, "line": str}`` or ``{"error": str}``.
    """
    from hora.errors import HoraError
    from hora.torch import preflight

    try:
        report = preflight.run()
    except HoraError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"report": report.to_dict(), "line": report.line()}


def begin() -> None:
    """Start recording this engine's next cell (its time and its collectives)."""
    from IPython import get_ipython

    from hora.torch import timeline

    end()  # a profile left over by an interrupted cell
    shell = get_ipython()
    events: list[tuple[Any, ...]] = []
    times: dict[str, int] = {}

    def listener(name: str, phase: str, start: int, stop: int, nbytes: int, args: Any) -> None:
        if len(events) < 4 * MAX_OPS:
            planned = bool(args) and _PLANNED_QUEUE in args
            events.append((name, phase, start, stop, nbytes, planned))

    def pre(info: Any = None) -> None:
        times["start"] = time.time_ns()

    def post(result: Any = None) -> None:
        times["end"] = time.time_ns()

    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)
    timeline.LISTENERS.append(listener)
    _ACTIVE.update(shell=shell, events=events, times=times, pre=pre, post=post,
                   listener=listener)


def end() -> dict[str, Any]:
    """Stop recording; this rank's record (wall time, busy intervals, collectives)."""
    from hora.torch import _state, timeline

    if not _ACTIVE:
        return {}
    a = dict(_ACTIVE)
    _ACTIVE.clear()
    for event, fn in (("pre_run_cell", a["pre"]), ("post_run_cell", a["post"])):
        try:
            a["shell"].events.unregister(event, fn)
        except ValueError:
            pass
    if a["listener"] in timeline.LISTENERS:
        timeline.LISTENERS.remove(a["listener"])
    times = a["times"]
    start, stop = times.get("start", 0), times.get("end", 0)
    state = _state._STATE
    return {"rank": state.rank if state is not None else -1,
            "size": state.size if state is not None else 1,
            "wall_s": max(0, stop - start) / 1e9, **_digest(a["events"])}


def _digest(events: list[tuple[Any, ...]]) -> dict[str, Any]:
    """This rank's collectives: busy intervals, reduced bytes, and one row per collective."""
    busy: list[tuple[int, int]] = []
    ops: dict[tuple[str, int], list[Any]] = {}
    seen: dict[str, int] = {}
    queued: dict[str, int] = {}
    queued_s = 0.0
    for name, phase, start, stop, nbytes, planned in events:
        if phase == "MEMCPY_IN_FUSION_BUFFER" or (phase == "QUEUED" and planned):
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
        "comm_s": _union(busy) / 1e9,
        "bytes_reduced": sum(v[2] for v in ops.values()),
        "ops": [[n, k, *v] for (n, k), v in ops.items()],
        "queued_s": queued_s,
        "truncated": len(ops) >= MAX_OPS,
    }


def _union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


# --- kernel side -------------------------------------------------------------------------------
@dataclass
class RankProfile:
    """One rank's figures for one cell."""

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
    """The scaling report of one ``%%distributed --profile`` cell."""

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
                "reduced": _bytes(r.bytes_reduced),
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


def _bytes(n: int) -> str:
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
    return [(_union(a) / 1e9, _union(b) / 1e9) for a, b in zip(spans, reducing, strict=True)]


def summarise(records: list[dict[str, Any]], preflight_busbw_gbps: float | None = None
              ) -> ProfileReport:
    """Every rank's :func:`end` record -> the cell's report (ranks in rank order).

    Args:
        records: one :func:`end` result per rank.
        preflight_busbw_gbps: the preflight's bus bandwidth on the path the cell used.
    """
    n = len(records)
    waits = _waits(records)
    ranks = []
    for rec, (wait, reduce_wait) in zip(records, waits, strict=True):
        wall, comm = float(rec["wall_s"]), min(float(rec["comm_s"]), float(rec["wall_s"]))
        wait = min(wait, comm)
        reduce_s = _union([(s, e) for _n, _k, s, e, b in rec.get("ops", []) if b]) / 1e9
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


# --- the magics' helpers -----------------------------------------------------------------------
def run_preflight(cluster: Any) -> dict[str, Any] | None:
    """Run the preflight on every engine; display its line; keep the report on the cluster.

    A failed threshold (``HORA_PREFLIGHT_FAIL_BELOW``) raises on every rank: its message is
    raised here as :class:`hora.errors.HoraError`. Any other failure is printed, not raised.

    Returns:
        The report (``hora.torch.preflight.PreflightReport.to_dict()``), or None.
    """
    import sys

    from hora.errors import HoraError

    cluster.preflight = None
    try:
        view = cluster._view(None)
        answers = view.apply_async(engine_preflight).get(timeout=cluster.options.timeout_s + 30)
    except Exception as e:  # noqa: BLE001  (the engines stay usable; say why there is no line)
        sys.stderr.write(f"preflight: no figures ({type(e).__name__}: {e})\n")
        return None
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        if "PreflightError" in errors[0]:
            raise HoraError(errors[0].split(": ", 1)[-1])
        sys.stderr.write(f"preflight: no figures ({errors[0]})\n")
        return None
    cluster.preflight = answers[0]["report"]
    # displayed with the start's table, not printed: a cell's stdout stays the cell's own
    from IPython.display import Pretty, display

    display(Pretty(answers[0]["line"]))
    return cluster.preflight  # type: ignore[no-any-return]


def preflight_busbw(report: dict[str, Any] | None) -> float | None:
    """The preflight's bus bandwidth at its largest size on the group's path (gloo/NCCL)."""
    if not report or not report.get("paths"):
        return None
    return float(report["paths"][0]["busbw_gbps"][-1])


def start_profile(cluster: Any) -> None:
    """Start recording the next cell on every engine."""
    cluster._view(None).apply_async(begin).get(timeout=cluster.options.timeout_s)


def finish_profile(cluster: Any) -> ProfileReport | None:
    """Stop recording on every engine; the report (None when some rank recorded nothing)."""
    records = cluster._view(None).apply_async(end).get(timeout=cluster.options.timeout_s)
    if not records or any(not r for r in records):
        return None
    return summarise(list(records), preflight_busbw(getattr(cluster, "preflight", None)))


def abandon_profile(cluster: Any, timeout_s: float = 5.0) -> None:
    """After a failed cell: stop recording where the engines answer soon (errors ignored)."""
    try:
        cluster._view(None).apply_async(end).get(timeout=timeout_s)
    except Exception:  # noqa: BLE001  (a dead or busy engine: its next begin() cleans up)
        return


class ChartHTML:
    """The report's chart, displayed as HTML in notebooks (and a word elsewhere)."""

    def __init__(self, report: ProfileReport) -> None:
        self.report = report

    def __repr__(self) -> str:
        return "(chart: shown in the notebook)"

    def _repr_html_(self) -> str:
        return self.report.chart_html()
