"""Every wait has a reason: the API, `hora jobs`, `hora status` and /metrics, on a real service.

One real service with 4 CPU slots and real jobs (ranks that wait for a gate file the test
creates, so the queue stands still while it is looked at). The queue it builds:

* carol (quota 2) runs a 1-slot job and queues a 2-slot one: **quota**;
* bob runs a 2-slot job, so 1 slot is free;
* ann queues a 4-slot high-priority job: **slots** (1 of 4 free; bob and carol hold them);
* ann queues a 1-slot job that would fit in the free slot, but the 4-slot job ahead holds a
  reservation and nothing ends in time to backfill: **priority**, naming the job ahead.

A request that can never fit is refused at submission with a 422 naming the field (**gang**:
more than the machine has; and more than the user's quota). The other kinds (running limit,
retry backoff, an image being pulled, a runtime's own reason) are covered in
tests/unit/test_reasons.py.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state
from hora import jobs_cli

pytestmark = pytest.mark.timeout(120)

GATED = """\
import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 120
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reasons")
    (root / "gated.py").write_text(GATED)
    return root


@pytest.fixture(scope="module")
def srv(work: Path) -> Iterator[ServiceServer]:
    from hora_service.manager import JobManager
    from hora_service.settings import Settings

    users = {"ann": False, "bob": False, "root": True}
    server = ServiceServer(work, users=users, cpu_slots=4)
    manager = JobManager(Settings(data_dir=server.data_dir, user_mode="shared"))
    server.tokens["carol"] = manager.users.create("carol", quota=2)
    manager.close_store()
    with server:
        yield server
    (work / "gate").touch()


def submit(srv: ServiceServer, user: str, work: Path, **spec: object) -> dict[str, Any]:
    body = {"command": [sys.executable, str(work / "gated.py"), str(work / "gate")], **spec}
    with srv.client(user) as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code in (201, 422), r.text
        return dict(r.json()) | {"status": r.status_code}


@pytest.fixture(scope="module")
def queue(srv: ServiceServer, work: Path) -> dict[str, int]:
    ids = {}
    ids["carol_run"] = int(submit(srv, "carol", work, workers=1)["id"])
    ids["bob_run"] = int(submit(srv, "bob", work, workers=2)["id"])
    for key, user in (("carol_run", "carol"), ("bob_run", "bob")):
        with srv.client(user) as c:
            wait_state(c, ids[key], ("running",))
    ids["carol_quota"] = int(submit(srv, "carol", work, workers=2)["id"])
    ids["ann_big"] = int(submit(srv, "ann", work, workers=4, priority="high")["id"])
    ids["ann_small"] = int(submit(srv, "ann", work, workers=1)["id"])
    return ids


def reason(srv: ServiceServer, user: str, job_id: int) -> dict[str, Any]:
    with srv.client(user) as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "queued", job
    return dict(job["queue"]["why"]) | {"position": job["queue"]["position"]}


def test_slots_reason_counts_free_slots_and_names_holders(
    srv: ServiceServer, queue: dict[str, int]
) -> None:
    why = reason(srv, "ann", queue["ann_big"])
    assert why["kind"] == "slots" and why["position"] == 1
    assert (why["asked"], why["free"], why["total"]) == (4, 1, 4)
    holders = {(h["user"], h["id"]) for h in why["holders"]}
    assert holders == {("carol", queue["carol_run"]), ("bob", queue["bob_run"])}
    assert "no estimate" in str(why["text"])  # nothing holding slots has a time limit


def test_priority_reason_names_the_job_ahead(srv: ServiceServer, queue: dict[str, int]) -> None:
    why = reason(srv, "ann", queue["ann_small"])
    assert why["kind"] == "priority"
    assert why["ahead"] == queue["ann_big"] and why["ahead_priority"] == "high"


def test_quota_reason(srv: ServiceServer, queue: dict[str, int]) -> None:
    why = reason(srv, "carol", queue["carol_quota"])
    assert (why["kind"], why["limit"], why["used"], why["asked"]) == ("quota", 2, 1, 2)


@pytest.mark.parametrize(
    ("user", "spec", "field"),
    [
        ("ann", {"workers": 5}, "workers"),  # more than the machine has
        ("ann", {"workers": 2, "gpus_per_worker": 3}, "gpus_per_worker"),
        ("carol", {"workers": 3}, "workers"),  # more than carol's quota
    ],
)
def test_a_request_that_can_never_fit_is_refused(
    srv: ServiceServer, work: Path, user: str, spec: dict[str, object], field: str
) -> None:
    answer = submit(srv, user, work, **spec)
    assert answer["status"] == 422
    assert answer["detail"][0]["loc"] == ["body", field]


def test_queue_view_hides_other_users_entries(srv: ServiceServer, queue: dict[str, int]) -> None:
    with srv.client("bob") as c:
        entries = c.get("/v1/queue").json()
    assert [e["position"] for e in entries] == [1, 2, 3]
    assert all(e["id"] is None and e["reason"] is None and e["user"] is None for e in entries)
    with srv.client("root") as c:
        admin = c.get("/v1/queue").json()
    assert [e["id"] for e in admin] == [queue["ann_big"], queue["carol_quota"], queue["ann_small"]]
    assert [e["reason"]["kind"] for e in admin] == ["slots", "quota", "priority"]


def test_the_dashboards_queue_is_the_apis(srv: ServiceServer, queue: dict[str, int]) -> None:
    # both serialise the entries in one pass now; same entries, same reasons, same redaction
    for user in ("bob", "root"):
        with srv.client(user) as api, httpx.Client(base_url=srv.url, timeout=30) as page:
            assert page.post("/ui/login", json={"token": srv.tokens[user]}).status_code == 200
            shown, listed = page.get("/ui/api/queue"), api.get("/v1/queue")
            assert shown.headers["content-type"] == listed.headers["content-type"]
            assert shown.json() == listed.json() and len(listed.json()) == 3


def test_hora_jobs_and_status_show_the_reason(srv: ServiceServer, queue: dict[str, int]) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--url", srv.url, "--token", srv.tokens["ann"]]
    assert jobs_cli.main(["jobs", *argv], out, err) == 0, err.getvalue()
    rows = {line.split()[0]: line for line in out.getvalue().splitlines()[1:]}
    assert "waiting for 4 slot(s): 1 of 4 free" in rows[str(queue["ann_big"])]
    assert f"job {queue['ann_big']} (high priority" in rows[str(queue["ann_small"])]
    out = io.StringIO()
    assert jobs_cli.main(["status", str(queue["ann_small"]), *argv], out, err) == 0
    assert "waiting:  position 3;" in out.getvalue() and "[priority]" in out.getvalue()


def test_metrics_count_waiting_jobs_by_reason(srv: ServiceServer, queue: dict[str, int]) -> None:
    with srv.client("root") as c:
        text = c.get("/metrics").text
    for kind in ("slots", "quota", "priority"):
        assert f'hora_jobs_waiting{{kind="job",reason="{kind}",state="queued"}} 1.0' in text
    assert 'hora_queue_wait_seconds_count{priority="normal",user="bob"} 1.0' in text
    assert 'hora_queue_waiting_longest_seconds{priority="high",user="ann"}' in text
    assert 'hora_slot_hours_total{slot_kind="cpu",user="carol"}' in text
