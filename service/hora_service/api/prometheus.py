"""``/metrics``: the service's metrics as ``prometheus_client`` collects them (control plane).

:class:`ServiceCollector` is a custom collector over the service's state: at each scrape it
takes one :class:`~hora_service.models.MetricsSnapshot` and yields its metric families;
``prometheus_client`` writes the text format (0.0.4) and its escaping. The families:
``hora_jobs{state=...}``, ``hora_queue_length``, ``hora_slots_total``,
``hora_slots_allocated`` and the ``hora_schedule_latency_seconds`` summary (submit ->
running); per user: ``hora_queue_wait_seconds`` (a summary by user and priority, first
attempts), ``hora_queue_waiting_longest_seconds``, ``hora_slot_hours_total`` (GPU-hours on a
GPU machine, ``slot_kind`` says which); ``hora_jobs_waiting`` by state, kind and wait reason;
``hora_preflight_bandwidth_gbps`` by node and collective path once a preflight fills it; and
every other number of the snapshot as a gauge ``hora_<field>``.

Every label set is bounded by what the service itself holds, never by what a job writes: job
states and wait-reason kinds are fixed vocabularies, users and priorities the service's own,
and a preflight's node and path come from the service's inventory
(:meth:`hora_service.jobs.preflight.PreflightBook.measured`). No series names a job, so none
outlives one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

PROMETHEUS_TYPE = CONTENT_TYPE_PLAIN_0_0_4
_NAME = re.compile(r"[^a-zA-Z0-9_]")

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


class ServiceCollector(Collector):
    """The service's metric families, from a fresh snapshot at each scrape.

    Args:
        snapshot: returns the manager's :class:`~hora_service.models.MetricsSnapshot`
            (with the queue's waiting rows) when called.
    """

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """Yield every family of one snapshot (see the module docstring)."""
        return iter(families(self._snapshot()))

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on the snapshot (no scrape at register)."""
        return []


def registry(snapshot: Callable[[], Any]) -> CollectorRegistry:
    """A registry of its own holding one :class:`ServiceCollector` (never the global one)."""
    out = CollectorRegistry(auto_describe=False)
    out.register(ServiceCollector(snapshot))
    return out


def exposition(reg: CollectorRegistry) -> str:
    """The text format of what ``reg`` collects now."""
    return generate_latest(reg).decode()


def render_metrics(snap: Any) -> str:
    """The text format of one snapshot.

    Example:
        >>> from hora_service.models import MetricsSnapshot
        >>> text = render_metrics(MetricsSnapshot(jobs_by_state={"queued": 3},
        ...                       queue_length=3, slots_total=4, slots_allocated=2))
        >>> 'hora_jobs{state="queued"} 3.0' in text
        True
    """
    return exposition(registry(lambda: snap))


def families(snap: Any) -> list[Metric]:
    """The metric families of a snapshot (see the module docstring)."""
    from hora.spec import JobState

    by_state = {str(k): v for k, v in dict(getattr(snap, "jobs_by_state", {}) or {}).items()}
    jobs = GaugeMetricFamily("hora_jobs", "Jobs by state.", labels=["state"])
    for s in JobState:
        jobs.add_metric([s.value], by_state.get(s.value, 0))
    out: list[Metric] = [jobs]
    for field, help_text in GAUGES.items():
        if getattr(snap, field, None) is not None:
            out.append(GaugeMetricFamily(f"hora_{field}", help_text, value=getattr(snap, field)))
    return out + [_latency(snap), *_usage(snap), *_extra(snap)]


def _latency(snap: Any) -> Metric:
    name = "hora_schedule_latency_seconds"
    summary = Metric(name, "Time from submission to running.", "summary")
    for q, attr in (("0.5", "schedule_latency_p50_s"), ("0.99", "schedule_latency_p99_s")):
        if getattr(snap, attr, None) is not None:
            summary.add_sample(name, {"quantile": q}, float(getattr(snap, attr)))
    summary.add_sample(f"{name}_sum", {}, float(getattr(snap, "schedule_latency_sum_s", 0.0)))
    summary.add_sample(f"{name}_count", {}, int(getattr(snap, "schedule_latency_count", 0)))
    return summary


def _usage(snap: Any) -> list[Metric]:
    """Queue waits, slot-hours, waiting entries by reason, preflight bandwidth."""
    name = "hora_queue_wait_seconds"
    waits = Metric(name, "Time first attempts waited in the queue.", "summary")
    for user, priority, total, count in getattr(snap, "queue_wait", []) or []:
        labels = {"user": user, "priority": priority}
        waits.add_sample(f"{name}_sum", labels, total)
        waits.add_sample(f"{name}_count", labels, count)
    longest = GaugeMetricFamily("hora_queue_waiting_longest_seconds",
                                "The longest wait of a job queued now.",
                                labels=["user", "priority"])  # fmt: skip
    for u, p, s in getattr(snap, "waiting_longest_s", []) or []:
        longest.add_metric([u, p], s)
    hours = CounterMetricFamily("hora_slot_hours", "Slot-hours held (GPU-hours where slots "
                                "are GPUs).", labels=["user", "slot_kind"])  # fmt: skip
    kind = str(getattr(snap, "slot_kind", "gpu"))
    for u, h in sorted((getattr(snap, "slot_hours", {}) or {}).items()):
        hours.add_metric([u, kind], h)
    waiting = GaugeMetricFamily("hora_jobs_waiting", "Waiting jobs and sessions by state and "
                                "reason.", labels=["state", "kind", "reason"])  # fmt: skip
    for s, k, r, n in getattr(snap, "waiting", []) or []:
        waiting.add_metric([s, k, r], n)
    bandwidth = GaugeMetricFamily("hora_preflight_bandwidth_gbps", "Collective bandwidth the "
                                  "last preflight measured.", labels=["node", "path"])  # fmt: skip
    for node, paths in sorted((getattr(snap, "preflight_bandwidth_gbps", {}) or {}).items()):
        for path, gbps in sorted(paths.items()):
            bandwidth.add_metric([node, path], gbps)
    return [waits, longest, hours, waiting, bandwidth]


def _extra(snap: Any) -> list[Metric]:
    """Every other numeric field of the snapshot as a gauge ``hora_<field>``.

    A mapping field becomes one series per key (label ``key``), so metrics the manager adds
    later appear without a change here.
    """
    fields = snap.model_dump() if hasattr(snap, "model_dump") else dict(vars(snap))
    out: list[Metric] = []
    for field, value in sorted(fields.items()):
        name = "hora_" + _NAME.sub("_", field)
        if field in KNOWN or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out.append(GaugeMetricFamily(name, f"{field} (manager metric).", value=value))
        elif isinstance(value, dict) and value and all(_numeric(v) for v in value.values()):
            gauge = GaugeMetricFamily(name, f"{field} (manager metric).", labels=["key"])
            for k, v in sorted(value.items()):
                gauge.add_metric([str(k)], v)
            out.append(gauge)
    return out


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
