"""A job's scaling report from its Chrome trace (hora.scaling): windows, phases, bad events."""

from __future__ import annotations

from typing import Any

import pytest
from hora.scaling import PREFLIGHT, START, STOP, from_trace, records_from_trace

S = 1e6  # trace times are microseconds


def mark(rank: int, name: str, ts: float) -> dict[str, Any]:
    return {"ph": "i", "s": "p", "pid": rank, "tid": 0, "name": name, "ts": ts}


def ev(rank: int, phase: str, ts: float, dur: float, tensor: str = "g", nbytes: int = 1 << 20,
       **args: Any) -> dict[str, Any]:
    return {"ph": "X", "pid": rank, "tid": 1, "name": phase, "ts": ts, "dur": dur,
            "args": {"tensor": tensor, "bytes": nbytes, **args}}


def test_the_window_starts_after_the_preflight_and_ends_at_the_stop_marker() -> None:
    trace = [mark(r, START, 0) for r in (0, 1)] + [mark(r, STOP, 3 * S) for r in (0, 1)]
    trace += [ev(r, PREFLIGHT, 0, 1 * S, "preflight", 0) for r in (0, 1)]
    # after the preflight: rank 0 computes 0.2 s, rank 1 1.0 s, then one allreduce of 1 MiB
    trace += [ev(0, "ALLREDUCE", 1.2 * S, 0.9 * S), ev(1, "ALLREDUCE", 2.0 * S, 0.1 * S)]
    report = from_trace(trace, preflight_busbw_gbps=1.0)
    assert report is not None
    r0, r1 = report.ranks
    assert (r0.wall_s, r1.wall_s) == (2.0, 2.0)  # 1 s of preflight is not the job's
    assert r0.wait_s == pytest.approx(0.8) and r1.wait_s == 0.0
    assert r0.compute_s == pytest.approx(1.1) and r1.compute_s == pytest.approx(1.9)
    assert r0.bytes_reduced == r1.bytes_reduced == 1 << 20
    assert r1.busbw_gbps == pytest.approx((1 << 20) / 0.1 / 1e9)  # 2 (n - 1) / n = 1
    assert r1.of_preflight == pytest.approx(r1.busbw_gbps)
    assert report.slowest == 1 and report.why.startswith("compute: ")
    data = report.to_dict()
    assert data["rows"][1]["reduced"] == "1.0 MiB" and data["verdict"].startswith("slowest rank 1")


def test_a_rank_without_markers_runs_from_the_world_s_start_to_its_last_event() -> None:
    trace = [mark(0, START, 0), mark(0, STOP, 2 * S)]
    trace += [ev(0, "ALLREDUCE", 0.5 * S, 0.5 * S), ev(1, "ALLREDUCE", 0.9 * S, 0.1 * S)]
    (r0, r1) = records_from_trace(trace)
    assert (r0["wall_s"], r1["wall_s"]) == (2.0, 1.0)  # rank 1 died before shutdown()
    assert r0["size"] == r1["size"] == 2


def test_only_communicating_phases_count_and_bad_events_are_skipped() -> None:
    trace = [
        ev(0, "MEMCPY_IN_FUSION_BUFFER", 0, 10),
        ev(0, "QUEUED", 10, 100, bucket=0),  # waiting for its bucket: not communication
        ev(0, "QUEUED", 200, 100, tensor="h"),  # negotiation: communication
        ev(0, "ALLREDUCE", 300, 50, tensor="h", nbytes=64),
        ev(0, "BROADCAST", 400, 50, tensor="b", nbytes=999),
        {"ph": "X", "pid": 0, "name": "ALLREDUCE"},  # no ts
        {"ph": "X", "pid": "x", "name": "ALLREDUCE", "ts": 1},
        {"ph": "X", "pid": 0, "name": "ALLREDUCE", "ts": 1, "dur": "long", "args": {}},
        {"ph": "M", "pid": 0, "name": "thread_name", "args": {"name": "h"}},
    ]
    (rec,) = records_from_trace(trace)
    assert rec["comm_s"] == pytest.approx(200e-6)  # QUEUED h + ALLREDUCE h + BROADCAST
    assert rec["bytes_reduced"] == 64  # a broadcast reduces nothing
    assert [op[:3] for op in rec["ops"]] == [["h", 0, 200_000], ["b", 0, 400_000]]


def test_no_collective_no_report() -> None:
    assert from_trace([mark(0, START, 0), mark(0, STOP, 1)]) is None
    assert from_trace([]) is None


def test_the_notebook_and_the_job_share_one_computation() -> None:
    from hora import scaling
    from hora.engines import profile

    assert profile.summarise is scaling.summarise and profile.ProfileReport is scaling.ProfileReport
