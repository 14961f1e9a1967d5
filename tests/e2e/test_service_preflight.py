"""A job's communication preflight on a real service: asked of the ranks, read, shown, measured.

One real service (2 CPU slots) runs one real 2-rank job that calls ``hvd.init()``. The
service set ``HORA_PREFLIGHT=1`` in the ranks' environment, so rank 0 logged the figures
(one ``HORA_PREFLIGHT {json}`` line); rank 1 slows itself on purpose (a test hook sleeps
inside each timed local copy), so the figures name it. Checked: ``GET /v1/jobs/{id}`` carries
the validated figures and their line naming rank 1, and the job's events (its transitions)
have that line while it is ``running``; so does the dashboard's job JSON
(``/ui/api/jobs/{id}``, signed in with the cookie); ``/metrics`` has the node's
``hora_preflight_bandwidth_gbps`` per path; a job whose ``env`` sets ``HORA_PREFLIGHT=0``
keeps it (the ranks' environment, from the runtime's own function). A second service whose
admin set ``job_preflight_fail_below`` fails the same job before training, its reason naming
rank 1.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(150)

SCRIPT = """\
import time
import hora.torch as hvd
from hora.torch import preflight
import os
if os.environ["RANK"] == "1":
    preflight.SLOW_HOOKS.append(lambda phase: time.sleep(0.05) if phase == "copy" else None)
hvd.init()
print("rank", hvd.rank(), "trained", flush=True)
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    root = tmp_path_factory.mktemp("preflight")
    (root / "train.py").write_text(SCRIPT)
    with ServiceServer(root, cpu_slots=2) as server:
        yield server


def test_a_job_s_preflight_is_read_shown_and_measured(srv: ServiceServer) -> None:
    script = srv.data_dir.parent / "train.py"
    with srv.client("ann") as c, srv.client("root") as admin:
        job = c.post("/v1/jobs", json={"command": [sys.executable, str(script)], "workers": 2})
        assert job.status_code == 201, job.text
        jid = job.json()["id"]
        done = wait_state(c, jid, ("succeeded", "failed", "cancelled"), timeout=120)
        log0 = c.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}).text
        assert done["state"] == "succeeded", (done, log0)
        assert "HORA_PREFLIGHT {" in log0 and "rank 0 trained" in log0
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


def test_an_admin_threshold_fails_the_job_naming_the_rank(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {"HORA_JOB_PREFLIGHT_FAIL_BELOW": "0.3"}
    with ServiceServer(tmp_path, cpu_slots=2, env=env) as server, server.client("ann") as c:
        job = c.post("/v1/jobs", json={"command": [sys.executable, str(tmp_path / "train.py")],
                                       "workers": 2})
        assert job.status_code == 201, job.text
        jid = job.json()["id"]
        done = wait_state(c, jid, ("succeeded", "failed", "cancelled"), timeout=120)
        log0 = c.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}).text
    assert done["state"] == "failed", (done, log0)
    assert "trained" not in log0 and "PreflightError" in log0
    assert done["reason"].startswith("preflight: below 0.3 of the reference: rank 1 ("), done
    figures = done["preflight"]
    assert done["reason"].startswith(figures["failed"] + "; rank "), done  # then the exit
    assert "FAILED" in figures["line"] and "SLOW: rank 1" in figures["line"]
    assert [t["state"] for t in done["transitions"] if t["reason"] == figures["line"]] == [
        "running"
    ]


def test_the_ranks_are_asked_unless_the_job_says_no(tmp_path: Path) -> None:
    from hora.spec import JobSpec
    from hora_service.runtimes.base import AttemptPlan
    from hora_service.runtimes.local import rank_environment

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
