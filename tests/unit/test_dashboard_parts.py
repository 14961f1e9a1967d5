"""Pure parts behind the dashboard and /metrics: GPU figures, timeline, sessions, metrics."""

from __future__ import annotations

import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from hora_service.api.prometheus import render_metrics
from hora_service.models import MetricsSnapshot
from hora_service.ui import auth
from hora_service.ui.auth import UiSessions
from hora_service.ui.gpustats import parse_stats
from hora_service.ui.timeline import summarize
from hora_service.users.usage import Usage
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


def test_nvidia_smi_figures_parse_and_not_available_is_none() -> None:
    text = "0, 1024, 81559, 37\n1, [N/A], 81559, [Not Supported]\nbogus line\n"
    stats = parse_stats(text)
    assert sorted(stats) == [0, 1]
    assert (stats[0].memory_used_mib, stats[0].utilization_pct) == (1024.0, 37.0)
    assert stats[1].memory_used_mib is None and stats[1].utilization_pct is None


def test_timeline_keeps_complete_events_and_row_names() -> None:
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "grad.w"}},
        {"ph": "X", "name": "ALLREDUCE", "pid": 1, "tid": 3, "ts": 10, "dur": 5},
        {"ph": "X", "name": "broken", "pid": 1},  # no ts: dropped, not an error
        {"ph": "B", "name": "ignored", "pid": 0, "ts": 1},
    ]
    out = summarize(events)
    assert out["rows"] == {"1:3": "grad.w"}
    assert out["events"] == [{"rank": 1, "row": 3, "name": "ALLREDUCE", "ts": 10.0, "dur": 5.0}]


def test_ui_sessions_end_at_expiry_and_logout() -> None:
    sessions = UiSessions(ttl_s=0.05)
    sid, session = sessions.open("tok")
    assert sessions.get(sid) is session and session.token == "tok"
    assert sessions.get("x" * 200) is None and sessions.get(None) is None
    time.sleep(0.1)
    assert sessions.get(sid) is None
    live = UiSessions()
    sid2, _ = live.open("tok")
    live.close(sid2)
    assert live.get(sid2) is None


def test_one_users_sign_ins_never_sign_another_user_out() -> None:
    # the red team's concern: by the code, 10,000 sign-ins by one user signed everyone out
    sessions = UiSessions()
    bob, _ = sessions.open("bob-token")
    alice = [sessions.open("alice-token")[0] for _ in range(10_000)]
    assert sessions.get(bob) is not None
    assert sessions.get(alice[-1]) is not None and sessions.get(alice[0]) is None
    live = [sid for sid in alice if sessions.get(sid) is not None]
    assert live == alice[-auth.SESSIONS_PER_USER :]  # alice's newest, hers only
    assert sessions.count("alice-token") == auth.SESSIONS_PER_USER
    sessions.close(live[0])
    assert sessions.count("alice-token") == auth.SESSIONS_PER_USER - 1


def test_a_users_sign_ins_are_bounded_whatever_token_each_brings() -> None:
    # behind JupyterHub each sign-in brings a new OAuth token: sessions count by the user
    sessions = UiSessions()
    bob, _ = sessions.open("bob-hub-token-0", owner="bob")
    alice = [sessions.open(f"alice-hub-token-{i}", owner="alice")[0] for i in range(1_000)]
    assert sessions.get(bob) is not None
    live = [sid for sid in alice if sessions.get(sid) is not None]
    assert live == alice[-auth.SESSIONS_PER_USER :]
    assert sessions.count("alice") == auth.SESSIONS_PER_USER
    assert sessions.count("bob") == 1


def test_metrics_render_waits_slot_hours_reasons_and_preflight() -> None:
    usage = Usage()
    usage.started("ann", "high", 4.0)
    usage.started("ann", "high", 2.0)
    usage.held("bob", 2, 3600.0)
    snap = MetricsSnapshot(
        jobs_by_state={"queued": 2}, queue_length=2, slots_total=4, slots_allocated=2,
        slot_kind="gpu", queue_wait=usage.wait_rows(), slot_hours=usage.slot_hours({"ann": 1800}),
        waiting=[("queued", "job", "quota", 2)], waiting_longest_s=[("ann", "high", 9.5)],
        preflight_bandwidth_gbps={"node1": {"nccl": 410.0}},
    )  # fmt: skip
    text = render_metrics(snap)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    user = (("priority", "high"), ("user", "ann"))
    assert got[("hora_queue_wait_seconds_sum", user)] == 6
    assert got[("hora_queue_wait_seconds_count", user)] == 2
    assert got[("hora_slot_hours_total", (("slot_kind", "gpu"), ("user", "bob")))] == 2
    assert got[("hora_slot_hours_total", (("slot_kind", "gpu"), ("user", "ann")))] == 0.5
    why = (("kind", "job"), ("reason", "quota"), ("state", "queued"))
    assert got[("hora_jobs_waiting", why)] == 2
    assert got[("hora_queue_waiting_longest_seconds", user)] == 9.5
    assert got[("hora_preflight_bandwidth_gbps", (("node", "node1"), ("path", "nccl")))] == 410
    assert "# TYPE hora_slot_hours_total counter" in text
    # the generic gauges do not repeat the new fields
    assert "hora_slot_hours{" not in text and "hora_queue_wait{" not in text


@pytest.mark.parametrize("asset", ["index.html", "app.js", "app.css"])
def test_the_page_ships_in_the_wheel(asset: str) -> None:
    # hatchling puts every file of a listed package that git does not ignore in the wheel
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = config["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "service/hora_service" in wheel["packages"]
    path = REPO / "service" / "hora_service" / "ui" / "static" / asset
    assert path.is_file()
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)], check=False)
    assert ignored.returncode == 1, f"{asset} is git-ignored: hatchling would leave it out"
