"""What the job CLI prints: tables and views of jobs, slots and scaling; state lines (data plane).

Pure functions from the service's answers (:class:`hora.client.JobInfo`, ``/v1/gpus`` rows,
a scaling report) to text; :mod:`hora.jobs_cli` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from hora.client import JobInfo
from hora.scaling import fmt_bytes
from hora.service_wire import JobScaling
from hora.spec import ElasticInfo, JobState, SlotInfo, SlotKind


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces.

    Example:
        >>> print(format_table(["ID", "NAME"], [[1, "a"]]))
        ID  NAME
        1   a
    """
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def age(when: datetime | None, now: datetime | None = None) -> str:
    """Short age like ``42s``, ``5m``, ``3h``, ``2d`` (``-`` when unknown).

    Example:
        >>> age(datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 1, 1, 0, 5, tzinfo=UTC))
        '5m'
    """
    if when is None:
        return "-"
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    secs = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def jobs_table(
    jobs: Sequence[JobInfo],
    now: datetime | None = None,
    unit: str = "GPU",
    waits: Mapping[int, str] | None = None,
) -> str:
    """The ``hora jobs`` table (``unit``: "GPU", or "slot" on a service without GPUs).

    KIND is ``job``, or ``session`` for a notebook's engines (they share the slots).
    REASON is why a waiting job waits (``waits``: job id -> reason, from ``/v1/queue``),
    else why it failed or was cancelled.
    """
    waits = waits or {}
    rows = [
        [
            j.id,
            j.kind,
            j.spec.name,
            j.user,
            state_cell(j),
            workers_cell(j),
            j.attempt,
            age(j.created_at, now),
            _short(waits.get(j.id) or j.reason or ""),
        ]
        for j in jobs
    ]
    return format_table(
        [
            "ID", "KIND", "NAME", "USER", "STATE", f"WORKERSx{unit.upper()}S", "ATTEMPT", "AGE",
            "REASON",
        ],  # fmt: skip
        rows,
    )


def state_cell(job: JobInfo) -> str:
    """The STATE column: the state, and a parked session's snapshot size.

    Example:
        >>> from datetime import datetime
        >>> from hora.spec import JobSpec, ParkInfo
        >>> park = ParkInfo(phase="parked", parked_at=datetime(2026, 1, 1), reason="idle",
        ...                 bytes=412_000_000, world=2, directory="/w")
        >>> state_cell(JobInfo(id=1, user="ann", spec=JobSpec(command=["t"]), state="parked",
        ...                    park=park))
        'parked (392.9 MiB)'
    """
    if job.state == JobState.parked and job.park is not None:
        return f"parked ({fmt_bytes(job.park.bytes)})"
    return job.state.value


def workers_cell(job: JobInfo) -> str:
    """The WORKERS column: ``2x1``, or ``size 3/2..4`` (now/min..max) for an elastic job.

    Example:
        >>> from hora.spec import ElasticInfo, ElasticSpec, JobSpec
        >>> spec = JobSpec(command=["t"], elastic=ElasticSpec(min_workers=2, max_workers=4))
        >>> job = JobInfo(id=1, user="ann", spec=spec, state="running",
        ...               elastic=ElasticInfo(min_workers=2, max_workers=4, size=3))
        >>> workers_cell(job)
        'size 3/2..4'
    """
    s = job.spec
    if s.elastic is None:
        return f"{s.workers}x{s.gpus_per_worker}"
    info = job.elastic or ElasticInfo(
        min_workers=s.elastic.min_workers, max_workers=s.elastic.max_workers
    )
    per = f" x{s.gpus_per_worker}" if s.gpus_per_worker > 1 else ""
    return f"size {info.label}{per}"


def status_text(job: JobInfo, unit: str = "GPU") -> str:
    """The ``hora status`` view: spec, state, per-rank exit codes and transition times.

    Args:
        job: the job.
        unit: what a worker holds: "GPU", or "slot" on a service without GPUs.
    """
    s = job.spec
    lines = [
        f"job {job.id}  {s.name}  ({job.user})",
        f"state:    {job.state.value}" + (f"  reason: {job.reason}" if job.reason else ""),
        f"attempt:  {job.attempt} (max retries {s.max_retries})",
        f"command:  {' '.join(s.command)}",
        f"workers:  {s.workers} x {s.gpus_per_worker} {unit}  priority {s.priority.value}"
        + (f"  timeout {s.timeout_s:g}s" if s.timeout_s else ""),
        f"slots:    {', '.join(map(str, job.slots)) or '-'}",
    ]
    if job.elastic is not None:
        lines.append(f"elastic:  size {job.elastic.label}  (holds {job.elastic.slots} {unit}s)")
    if job.park is not None:
        p = job.park
        ends = f"; deleted at {_iso(p.expires_at)} unless resumed" if p.expires_at else ""
        lines.append(
            f"parked:   {_iso(p.parked_at)} ({p.reason}); snapshot {fmt_bytes(p.bytes)} of "
            f"{p.world} ranks{ends}"
        )
    if job.queue is not None:
        place = f"position {job.queue.position}; " if job.queue.position else ""
        kind = job.queue.why.kind if job.queue.why is not None else "wait"
        lines.append(f"waiting:  {place}{job.queue.reason} [{kind}]")
    if job.exit_codes:
        codes = [[r, "-" if c is None else c] for r, c in sorted(job.exit_codes.items())]
        lines += ["", format_table(["RANK", "EXIT"], codes)]
    if job.elastic is not None and job.elastic.history:
        rows = [[c.size, _iso(c.at), c.reason] for c in job.elastic.history]
        lines += ["", format_table(["SIZE", "AT", "MEMBERSHIP CHANGE"], rows)]
    if job.transitions:
        rows = [[t.state.value, _iso(t.at), t.reason or ""] for t in job.transitions]
        lines += ["", format_table(["STATE", "AT", "REASON"], rows)]
    return "\n".join(lines)


def _iso(at: datetime) -> str:
    """A UTC time as the service's JSON writes it (``...Z``)."""
    return at.isoformat().replace("+00:00", "Z")


def slot_unit(slots: Sequence[SlotInfo]) -> str:
    """Name what the service schedules: "GPU", or "slot" where it has only CPU slots.

    Example:
        >>> slot_unit([SlotInfo(index=0, kind="cpu", name="cpu0")])
        'slot'
    """
    return "GPU" if any(s.kind == SlotKind.gpu for s in slots) else "slot"


def gpus_table(slots: Sequence[SlotInfo]) -> str:
    """The ``hora gpus`` table; HOLDER says whether a job or a notebook's session holds it.

    A slot held outside this service (another hora service, a notebook's kernel-local
    engines) says by whom. Parked sessions follow the slots (they hold none): their
    snapshot's size and since when.

    Example:
        >>> print(gpus_table([
        ...     SlotInfo(index=0, kind="cpu", name="cpu0", user="ann", holder_kind="kernel",
        ...              holder="notebook kernel pid 7"),
        ...     SlotInfo(index=None, kind="parked", name="nb", job_id=3, user="ann",
        ...              holder_kind="session", snapshot_bytes=412_000_000,
        ...              parked_at="2026-01-01T10:02:11Z")]))
        SLOT  KIND    NAME  JOB  USER  HOLDER
        0     cpu     cpu0  -    ann   notebook kernel pid 7
        -     parked  nb    3    ann   session, 392.9 MiB since 2026-01-01T10:02:11Z
    """
    rows = []
    for s in slots:
        holder = s.holder or s.holder_kind or "-"
        if s.kind == SlotKind.parked:
            since = _iso(s.parked_at) if s.parked_at else "-"
            holder += f", {fmt_bytes(s.snapshot_bytes or 0)} since {since}"
        rows.append([
            "-" if s.index is None else s.index, s.kind, s.name, s.job_id or "-",
            s.user or "-", holder,
        ])  # fmt: skip
    return format_table(["SLOT", "KIND", "NAME", "JOB", "USER", "HOLDER"], rows)


def scaling_text(report: JobScaling) -> str:
    """The ``hora scaling`` view: one row per rank, then the verdict line.

    Example:
        >>> print(scaling_text(JobScaling(
        ...     timeline="t.json", ranks=[], slowest=0, why="balanced", efficiency=1.0,
        ...     rows=[{"rank": 0, "wall s": "1.000"}], verdict="slowest rank 0 (balanced)")))
        RANK  WALL S
        0     1.000
        slowest rank 0 (balanced)
    """
    rows = report.rows
    headers = list(rows[0]) if rows else []
    table = format_table([h.upper() for h in headers], [[r[h] for h in headers] for r in rows])
    return f"{table}\n{report.verdict}"


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def state_line(info: JobInfo) -> str:
    """One progress line: ``job 7: running (attempt 2): reason``."""
    attempt = f" (attempt {info.attempt})" if info.attempt > 1 else ""
    reason = f": {info.reason}" if info.reason else ""
    return f"job {info.id}: {info.state.value}{attempt}{reason}\n"


def new_state_lines(info: JobInfo, shown: int) -> list[str]:
    """Lines for the state changes after the first ``shown`` of ``info.transitions``.

    Every change is shown, also those that came and went between two looks at the job (a
    quick retry); the newest one with its attempt.

    Example:
        >>> from hora.spec import Transition
        >>> at = datetime(2024, 1, 1, tzinfo=UTC)
        >>> moves = [Transition(state=s, at=at) for s in ("running", "retrying", "starting")]
        >>> info = JobInfo(id=7, user="a", spec={"command": ["x"]}, state="starting",
        ...                attempt=2, transitions=moves)
        >>> print("".join(new_state_lines(info, 1)), end="")
        job 7: retrying
        job 7: starting (attempt 2)
    """
    moves = info.transitions[shown:]
    if not moves:
        return [state_line(info)] if not info.transitions else []
    *before, last = moves
    attempt = f" (attempt {info.attempt})" if info.attempt > 1 else ""
    lines = [_line(info.id, t.state.value, t.reason) for t in before]
    return [*lines, _line(info.id, last.state.value + attempt, info.reason or last.reason)]


def _line(job_id: int, state: str, reason: str | None) -> str:
    return f"job {job_id}: {state}" + (f": {reason}" if reason else "") + "\n"


def empty_log_note(info: JobInfo, rank: int, attempt: int | None) -> str:
    """What ``hora logs`` says on stderr when a rank's log is empty (it still exits 0).

    Example:
        >>> from hora.client import JobInfo
        >>> spec = {"command": ["x"]}
        >>> info = JobInfo.model_validate(
        ...     {"id": 7, "user": "a", "state": "succeeded", "attempt": 1, "spec": spec}
        ... )
        >>> empty_log_note(info, 1, None)
        'hora logs: rank 1 of job 7 wrote nothing (attempt 1; job succeeded)'
    """
    which = attempt if attempt is not None else info.attempt
    return (
        f"hora logs: rank {rank} of job {info.id} wrote nothing "
        f"(attempt {which}; job {info.state.value})"
    )
