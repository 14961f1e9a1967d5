"""``%dist_start``'s preflight line and ``%%distributed --profile``'s scaling report.

Engine side (run through ipyparallel's ``apply``): :func:`engine_preflight` runs
:func:`hora.torch.preflight.run`; :func:`begin` and :func:`end` bracket one cell: they time
the cell's execution (IPython's ``pre_run_cell``/``post_run_cell`` events) and collect the
collectives hora.torch records (the timeline's in-process listener, with or without a
timeline file).

Kernel side: :func:`hora.scaling.summarise` turns every rank's record into a
:class:`~hora.scaling.ProfileReport` (per rank the wall time, time in collectives, of which
waiting for other ranks, bytes reduced, the bus bandwidth reached against the preflight's,
the slowest rank and why, and an estimated scaling efficiency; the definitions are
:mod:`hora.scaling`'s, which a job's report from its timeline shares).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hora.scaling import (
    MAX_OPS,
    PLANNED_QUEUE,
    ProfileReport,
    RankProfile,
    digest,
    preflight_busbw,
    summarise,
)

__all__ = [
    "ChartHTML", "ProfileReport", "RankProfile", "abandon_profile", "begin", "end",
    "engine_preflight", "finish_profile", "preflight_busbw", "run_preflight", "start_profile",
    "summarise",
]  # fmt: skip

_ACTIVE: dict[str, Any] = {}
log = logging.getLogger(__name__)


# --- engine side -------------------------------------------------------------------------------
def engine_preflight() -> dict[str, Any]:
    """Run the preflight on this engine (every engine at once); its report or the error.

    Rank 0 also hands the figures to the hora service, as a job's rank 0 does at
    ``hvd.init()`` (:func:`hora.torch.preflight.publish`; only an engine the service started
    has the descriptor to do it): a session's figures are read there.

    Returns:
        ``{"report": dict, "line": str}`` or ``{"error": str}``.
    """
    from hora.errors import HoraError
    from hora.torch import preflight

    try:
        report = preflight.run()
    except HoraError as e:
        if isinstance(e, preflight.PreflightError) and e.report is not None:
            preflight.publish(e.report.to_dict() | {"failed": str(e)})
        return {"error": f"{type(e).__name__}: {e}"}
    preflight.publish(report.to_dict())
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
            planned = bool(args) and PLANNED_QUEUE in args
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
    from hora.torch import host, timeline

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
    state = host.current()
    return {"rank": state.rank if state is not None else -1,
            "size": state.size if state is not None else 1,
            "wall_s": max(0, stop - start) / 1e9, **digest(a["events"])}


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
        view = cluster.view(None)
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


def start_profile(cluster: Any) -> None:
    """Start recording the next cell on every engine."""
    cluster.view(None).apply_async(begin).get(timeout=cluster.options.timeout_s)


def finish_profile(cluster: Any) -> ProfileReport | None:
    """Stop recording on every engine; the report (None when some rank recorded nothing)."""
    records = cluster.view(None).apply_async(end).get(timeout=cluster.options.timeout_s)
    if not records or any(not r for r in records):
        return None
    return summarise(list(records), preflight_busbw(getattr(cluster, "preflight", None)))


def abandon_profile(cluster: Any, timeout_s: float = 5.0) -> None:
    """After a failed cell: stop recording where the engines answer soon (errors ignored)."""
    try:
        cluster.view(None).apply_async(end).get(timeout=timeout_s)
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
