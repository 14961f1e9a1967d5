"""A job's communication preflight and scaling report on a real service.

One real service (2 CPU slots, with a recorded baseline for this host) runs one real 2-rank
job that calls ``hvd.init()``. The service set ``HORA_PREFLIGHT=1`` in the ranks'
environment, so rank 0 handed the figures to its shim (a pipe; the shim keeps them as
``preflight.json``): the ranks' logs hold only what the job printed. Rank 1 slows itself on
purpose (a test hook sleeps inside each timed local copy), so the figures name it against
the baseline. Checked: ``GET /v1/jobs/{id}`` carries
the validated figures and their line naming rank 1, and the job's events (its transitions)
have that line while it is ``running``; so does the dashboard's job JSON
(``/ui/api/jobs/{id}``, signed in with the cookie); ``/metrics`` has the node's
``hora_preflight_bandwidth_gbps`` per path; a job whose ``env`` sets ``HORA_PREFLIGHT=0``
keeps it (the ranks' environment, from the runtime's own function). A second service whose
admin set ``job_preflight_fail_below`` fails the same job before training, its reason naming
rank 1.

The same job (tests/helpers/known_share.py) records its timeline (``HOROVOD_TIMELINE``) and
has a known communication share, as the profiled cell of tests/e2e/test_magics_profile.py:
after ``hvd.init()`` rank 0 computes (sleeps) 0.2 s and rank 1 1.0 s, then both run four
blocking allreduces of 1 MiB.
``GET /v1/jobs/{id}/scaling`` (and ``hora scaling``) must say rank 0 waited about 0.8 s
(0.4..1.2), rank 1 is the slowest because of compute, each rank reduced exactly 4 MiB, the
efficiency is about 0.6 (0.3..0.8), and the bandwidth is compared with the preflight's.
"""

from __future__ import annotations

import io
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hora
import httpx
import pytest
from helpers.known_share import REDUCED, SCRIPT, baseline_env
from helpers.service_server import ServiceServer, wait_state
from hora import jobs_cli
from hora.service_wire import JobScaling

pytestmark = pytest.mark.timeout(300)



@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    root = tmp_path_factory.mktemp("preflight")
    (root / "train.py").write_text(SCRIPT)
    with ServiceServer(root, users={"ann": False, "bob": False, "root": True},
                       cpu_slots=2, env=baseline_env(root)) as server:
        yield server


@pytest.fixture(scope="module")
def trained(srv: ServiceServer) -> dict[str, Any]:
    """The job, run to its end: its record as ``GET /v1/jobs/{id}`` answers it."""
    script = srv.data_dir.parent / "train.py"
    body = {"command": [sys.executable, str(script)], "workers": 2,
            "env": {"HOROVOD_TIMELINE": "trace.json"}}
    with srv.client("ann") as c:
        job = c.post("/v1/jobs", json=body)
        assert job.status_code == 201, job.text
        done = wait_state(c, job.json()["id"], ("succeeded", "failed", "cancelled"), timeout=240)
        logs = [c.get(f"/v1/jobs/{done['id']}/logs", params={"rank": r}).text for r in (0, 1)]
    assert done["state"] == "succeeded", (done, logs)
    for rank, text in enumerate(logs):  # only what the job printed
        assert text == f"rank {rank} trained\n", text
    return done


def test_a_job_s_preflight_is_read_shown_and_measured(
    srv: ServiceServer, trained: dict[str, Any]
) -> None:
    jid, done = trained["id"], trained
    with srv.client("root") as admin:
        figures = done["preflight"]
        assert figures is not None, done
        assert figures["size"] == 2 and figures["backend"] == "gloo"
        assert [p["path"] for p in figures["paths"]] == ["gloo", "shm"]
        assert figures["line"].startswith("preflight (2 ranks, ")
        assert any(f["who"] == "rank 1" for f in figures["findings"]), figures["findings"]
        assert "SLOW: rank 1" in figures["line"] and figures["failed"] is None
        events = [t for t in done["transitions"] if t["reason"] == figures["line"]]
        assert [t["state"] for t in events] == ["running"], done["transitions"]
        assert done["transitions"][-1]["state"] == "succeeded"
        metrics = admin.get("/metrics").text
    with httpx.Client(base_url=srv.url, timeout=30) as page:  # what the dashboard's page reads
        assert page.post("/ui/login", json={"token": srv.tokens["ann"]}).status_code == 200
        shown = page.get(f"/ui/api/jobs/{jid}").json()["preflight"]
    assert shown["line"] == figures["line"] and shown["findings"] == figures["findings"]
    host = figures["paths"][0]["ranks"][0]["host"]
    assert host == socket.gethostname()
    for path in ("gloo", "shm"):
        assert f'hora_preflight_bandwidth_gbps{{node="{host}",path="{path}"}}' in metrics


def test_a_job_s_scaling_report_from_its_timeline(
    srv: ServiceServer, trained: dict[str, Any]
) -> None:
    jid = trained["id"]
    with srv.client("ann") as c, srv.client("bob") as other:
        answer = c.get(f"/v1/jobs/{jid}/scaling")
        assert other.get(f"/v1/jobs/{jid}/scaling").status_code == 404  # not bob's job
    assert answer.status_code == 200, answer.text
    report = answer.json()
    r0, r1 = report["ranks"]
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["bytes_reduced"] == r1["bytes_reduced"] == REDUCED
    assert 0.4 <= r0["wait_s"] <= 1.2, report  # rank 0 waited for rank 1's extra 0.8 s
    assert r1["wait_s"] < r0["wait_s"] and r1["wait_s"] < 0.4, report
    assert r0["comm_s"] >= r0["wait_s"] and r1["compute_s"] >= 0.9, report
    assert report["slowest"] == 1 and report["why"].startswith("compute"), report
    assert 0.3 <= report["efficiency"] <= 0.8, report
    busbw = trained["preflight"]["paths"][0]["busbw_gbps"][-1]
    assert report["preflight_busbw_gbps"] == busbw and r0["of_preflight"] is not None
    assert report["verdict"].startswith("slowest rank 1 (compute: ")
    assert report["rows"][0]["reduced"] == "4.0 MiB"
    assert report["timeline"].endswith("trace.json")
    out, err = io.StringIO(), io.StringIO()
    argv = ["scaling", str(jid), "--url", srv.url, f"--token={srv.tokens['ann']}"]
    assert jobs_cli.main(argv, out, err) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:3] == ["RANK", "WALL", "S"] and lines[1].split()[0] == "0"
    assert lines[-1] == report["verdict"]
    with hora.Client(srv.url, srv.tokens["ann"]) as client:
        typed = client.scaling(jid)  # the same answer as the service's own model
    assert typed == JobScaling.model_validate(report) and typed.model_dump(mode="json") == report
    out = io.StringIO()
    assert jobs_cli.main([*argv, "--json"], out, err) == 0, err.getvalue()
    assert json.loads(out.getvalue()) == report


def test_an_admin_threshold_fails_the_job_naming_the_rank(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {"HORA_JOB_PREFLIGHT_FAIL_BELOW": "0.3", **baseline_env(tmp_path)}
    with ServiceServer(tmp_path, cpu_slots=2, env=env) as server, server.client("ann") as c:
        job = c.post("/v1/jobs", json={"command": [sys.executable, str(tmp_path / "train.py")],
                                       "workers": 2})
        assert job.status_code == 201, job.text
        jid = job.json()["id"]
        done = wait_state(c, jid, ("succeeded", "failed", "cancelled"), timeout=240)
        log0 = c.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}).text
        no_timeline = c.get(f"/v1/jobs/{jid}/scaling")
    assert no_timeline.status_code == 404 and "HOROVOD_TIMELINE" in no_timeline.text
    assert done["state"] == "failed", (done, log0)
    assert "trained" not in log0 and "PreflightError" in log0 and "HORA_PREFLIGHT" not in log0
    assert done["reason"].startswith("preflight: below 0.3 of the baseline: rank 1 ("), done
    figures = done["preflight"]
    assert done["reason"].startswith(figures["failed"] + "; rank "), done  # then the exit
    assert "FAILED" in figures["line"] and "SLOW: rank 1" in figures["line"]
    assert [t["state"] for t in done["transitions"] if t["reason"] == figures["line"]] == [
        "running"
    ]


def test_the_ranks_are_asked_unless_the_job_says_no(tmp_path: Path) -> None:
    from hora.spec import JobSpec
    from hora_service.runtimes.base import AttemptPlan
    from hora_service.runtimes.core import rank_environment

    asked = (("HORA_PREFLIGHT", "1"), ("HORA_PREFLIGHT_FAIL_BELOW", "0.3"))

    def env_of(job_env: dict[str, str]) -> dict[str, str]:
        spec = JobSpec(command=["true"], workers=1, env=job_env)
        plan = AttemptPlan(1, 1, spec, (0,), "cpu", tmp_path, tmp_path, 1234,
                           preflight_env=asked)
        return rank_environment(plan, 0, {})

    assert env_of({})["HORA_PREFLIGHT"] == "1"
    off = env_of({"HORA_PREFLIGHT": "0", "HORA_PREFLIGHT_FAIL_BELOW": "0.9"})
    assert off["HORA_PREFLIGHT"] == "0"
    assert off["HORA_PREFLIGHT_FAIL_BELOW"] == "0.3"  # the admin's threshold wins
