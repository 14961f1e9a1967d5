"""Prometheus text exposition (format 0.0.4) of the service metrics (control plane, pure).

``render_metrics`` turns the manager's :class:`MetricsSnapshot` into the ``/metrics`` body:
``hora_jobs{state=...}``, ``hora_queue_length``, ``hora_slots_total``,
``hora_slots_allocated`` and the ``hora_schedule_latency_seconds`` summary (submit -> running);
per user: ``hora_queue_wait_seconds`` (a summary by user and priority, first attempts),
``hora_queue_waiting_longest_seconds``, ``hora_slot_hours_total`` (GPU-hours on a GPU
machine, ``slot_kind`` says which); ``hora_jobs_waiting`` by state, kind and wait reason;
and ``hora_preflight_bandwidth_gbps`` by node and collective path once preflight fills it.
"""

from __future__ import annotations

import re
from typing import Any

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} {_num(value)}"
    return f"{name} {_num(value)}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _metric(name: str, kind: str, help_text: str, lines: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]


def render_metrics(snap: Any) -> str:
    """Prometheus text exposition of a :class:`MetricsSnapshot`.

    Args:
        snap: the manager's metrics snapshot.

    Returns:
        The text, ending with a newline.
    """
    from hora.spec import JobState

    by_state = {str(k): v for k, v in dict(getattr(snap, "jobs_by_state", {}) or {}).items()}
    out = _metric(
        "hora_jobs",
        "gauge",
        "Jobs by state.",
        [_line("hora_jobs", by_state.get(s.value, 0), {"state": s.value}) for s in JobState],
    )
    for field, help_text in GAUGES.items():
        if getattr(snap, field, None) is not None:
            name = f"hora_{field}"
            out += _metric(name, "gauge", help_text, [_line(name, getattr(snap, field))])
    out += _latency(snap)
    out += _usage(snap)
    out += _extra(snap)
    return "\n".join(out) + "\n"


GAUGES = {
    "queue_length": "Jobs waiting for slots.",
    "slots_total": "Schedulable GPUs (or CPU slots).",
    "slots_allocated": "GPUs (or CPU slots) held by jobs.",
}
KNOWN = {
    "jobs_by_state", "queue_length", "slots_total", "slots_allocated", "schedule_latency_p50_s",
    "schedule_latency_p99_s", "schedule_latency_sum_s", "schedule_latency_count",
    "slot_kind", "queue_wait", "slot_hours", "waiting", "waiting_longest_s",
    "preflight_bandwidth_gbps",
}  # fmt: skip


def _usage(snap: Any) -> list[str]:
    """Queue waits, slot-hours, waiting entries by reason, preflight bandwidth."""
    name = "hora_queue_wait_seconds"
    lines = []
    for user, priority, total, count in getattr(snap, "queue_wait", []) or []:
        labels = {"user": user, "priority": priority}
        lines += [_line(f"{name}_sum", total, labels), _line(f"{name}_count", count, labels)]
    out = _metric(name, "summary", "Time first attempts waited in the queue.", lines)
    name = "hora_queue_waiting_longest_seconds"
    rows = getattr(snap, "waiting_longest_s", []) or []
    lines = [_line(name, s, {"user": u, "priority": p}) for u, p, s in rows]
    out += _metric(name, "gauge", "The longest wait of a job queued now.", lines)
    name, kind = "hora_slot_hours_total", str(getattr(snap, "slot_kind", "gpu"))
    hours = sorted((getattr(snap, "slot_hours", {}) or {}).items())
    lines = [_line(name, h, {"user": u, "slot_kind": kind}) for u, h in hours]
    out += _metric(name, "counter", "Slot-hours held (GPU-hours where slots are GPUs).", lines)
    name = "hora_jobs_waiting"
    rows = getattr(snap, "waiting", []) or []
    lines = [_line(name, n, {"state": s, "kind": k, "reason": r}) for s, k, r, n in rows]
    out += _metric(name, "gauge", "Waiting jobs and sessions by state and reason.", lines)
    name = "hora_preflight_bandwidth_gbps"
    nodes = sorted((getattr(snap, "preflight_bandwidth_gbps", {}) or {}).items())
    lines = [
        _line(name, gbps, {"node": node, "path": path})
        for node, paths in nodes
        for path, gbps in sorted(paths.items())
    ]
    out += _metric(name, "gauge", "Collective bandwidth the last preflight measured.", lines)
    return out


def _extra(snap: Any) -> list[str]:
    """Every other numeric field of the snapshot as a gauge ``hora_<field>``.

    A mapping field becomes one series per key (label ``key``), so metrics the manager adds
    later appear without a change here.
    """
    fields = snap.model_dump() if hasattr(snap, "model_dump") else dict(vars(snap))
    out: list[str] = []
    for field, value in sorted(fields.items()):
        name = "hora_" + _NAME.sub("_", field)
        if field in KNOWN or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out += _metric(name, "gauge", f"{field} (manager metric).", [_line(name, value)])
        elif isinstance(value, dict) and value and all(_numeric(v) for v in value.values()):
            lines = [_line(name, v, {"key": str(k)}) for k, v in sorted(value.items())]
            out += _metric(name, "gauge", f"{field} (manager metric).", lines)
    return out


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _latency(snap: Any) -> list[str]:
    name = "hora_schedule_latency_seconds"
    lines = [_line(name, v, {"quantile": q}) for q, v in _quantiles(snap)]
    lines += [
        _line(f"{name}_sum", float(getattr(snap, "schedule_latency_sum_s", 0.0))),
        _line(f"{name}_count", int(getattr(snap, "schedule_latency_count", 0))),
    ]
    return _metric(name, "summary", "Time from submission to running.", lines)


def _quantiles(snap: Any) -> list[tuple[str, float]]:
    pairs = [("0.5", "schedule_latency_p50_s"), ("0.99", "schedule_latency_p99_s")]
    return [
        (q, float(getattr(snap, attr)))
        for q, attr in pairs
        if getattr(snap, attr, None) is not None
    ]
