"""Prometheus text exposition (format 0.0.4) of the service metrics (control plane, pure).

``render_metrics`` turns the manager's :class:`MetricsSnapshot` into the ``/metrics`` body:
``hora_jobs{state=...}``, ``hora_queue_length``, ``hora_slots_total``,
``hora_slots_allocated`` and the ``hora_schedule_latency_seconds`` summary (submit -> running).
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
}  # fmt: skip


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
