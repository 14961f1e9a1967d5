"""Per-user limits (real service): spec bytes, page bytes, running and queued jobs, streams.

One server with small limits: specs of at most 2 KiB, pages of at most 2 KiB, one running
and two queued jobs per user, two open log streams per user. Log bytes per attempt are
tested with the shim in tests/e2e/test_service_runtime.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state

PY = sys.executable
pytestmark = pytest.mark.timeout(120)
LIMITS = {
    "HORA_MAX_SPEC_BYTES": "2048",
    "HORA_MAX_PAGE_BYTES": "2048",
    "HORA_MAX_RUNNING_JOBS_PER_USER": "1",
    "HORA_MAX_QUEUED_JOBS_PER_USER": "2",
    "HORA_MAX_LOG_STREAMS_PER_USER": "2",
}
WAIT = "import pathlib, sys, time\nwhile not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.05)\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    tmp = tmp_path_factory.mktemp("svc-limits")
    users = {"ann": False, "bob": False, "cy": False, "root": True}
    with ServiceServer(tmp, users, cpu_slots=4, env=LIMITS) as server:
        yield server


def waiting_job(c: httpx.Client, release: Path) -> int:
    script = release.parent / "wait.py"
    if not script.exists():  # rewriting it could truncate it under a job that is reading it
        script.write_text(WAIT)
    r = c.post("/v1/jobs", json={"command": [PY, str(script), str(release)]})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_spec_larger_than_the_limit_is_a_413(srv: ServiceServer) -> None:
    with srv.client("bob") as c:
        big = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"], "env": {"X": "x" * 4000}})
        assert big.status_code == 413, big.text
        assert big.json()["detail"][0]["loc"] == ["limits", "spec"]
        small = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"], "env": {"X": "x" * 100}})
        assert small.status_code == 201, small.text
        wait_state(c, small.json()["id"], ("succeeded",))


def test_a_page_stops_before_its_byte_limit_and_says_where_to_go_on(srv: ServiceServer) -> None:
    with srv.client("cy") as c:
        ids = []
        for _ in range(5):
            r = c.post("/v1/jobs", json={"command": [PY, "-c", "pass"]})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            wait_state(c, ids[-1], ("succeeded",))  # one at a time: the queue limit is 2
        seen: list[int] = []
        offset: int | None = 0
        pages = 0
        while offset is not None:
            r = c.get("/v1/jobs", params={"limit": 500, "offset": offset})
            assert r.status_code == 200 and len(r.content) <= 2048 + 1024, len(r.content)
            page = r.json()
            assert page["items"] and page["total"] == 5
            seen += [j["id"] for j in page["items"]]
            offset, pages = page["next_offset"], pages + 1
        assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))  # each job once
        assert pages > 1


def test_running_and_queued_jobs_per_user(srv: ServiceServer, tmp_path: Path) -> None:
    with srv.client("ann") as ann, srv.client("bob") as bob:
        first = waiting_job(ann, tmp_path / "1")
        wait_state(ann, first, ("running",))
        queued = [waiting_job(ann, tmp_path / f"{i}") for i in (2, 3)]
        time.sleep(1.0)  # several passes of the monitor: free slots, yet one running job each
        states = [ann.get(f"/v1/jobs/{j}").json()["state"] for j in [first, *queued]]
        assert states == ["running", "queued", "queued"]
        over = ann.post("/v1/jobs", json={"command": [PY, "-c", "pass"]})
        assert over.status_code == 429 and over.json()["detail"][0]["loc"][1] == "queued_jobs"
        assert int(over.headers["Retry-After"]) > 0
        other = waiting_job(bob, tmp_path / "bob")  # another user is not held back
        wait_state(bob, other, ("running",))
        (tmp_path / "bob").touch()
        (tmp_path / "1").touch()
        wait_state(ann, first, ("succeeded",))
        wait_state(ann, queued[0], ("running",))
        assert ann.get(f"/v1/jobs/{queued[1]}").json()["state"] == "queued"
        for i in (2, 3):
            (tmp_path / f"{i}").touch()
        for j in queued:
            wait_state(ann, j, ("succeeded",))


def test_concurrent_log_streams_per_user(srv: ServiceServer, tmp_path: Path) -> None:
    with srv.client("ann") as ann:
        job = waiting_job(ann, tmp_path / "go")
        wait_state(ann, job, ("running",))
        follow = {"follow": "true"}
        url = f"/v1/jobs/{job}/logs"
        with ExitStack() as stack:
            for _ in range(2):
                r = stack.enter_context(ann.stream("GET", url, params=follow))
                assert r.status_code == 200
            third = ann.get(url, params=follow)
            assert third.status_code == 429, third.text
            assert third.json()["detail"][0]["loc"] == ["limits", "log_streams"]
            assert ann.get(url).status_code == 200  # a plain read is not a stream
            with srv.client("root") as admin, admin.stream("GET", url, params=follow) as other:
                assert other.status_code == 200  # the limit is per user
        # the streams are closed: the server notices and counts them down
        deadline = time.monotonic() + 20
        while True:
            with ann.stream("GET", url, params=follow) as r:
                if r.status_code == 200:
                    break
            assert time.monotonic() < deadline, "closed streams were never counted down"
            time.sleep(0.2)
        (tmp_path / "go").touch()
        wait_state(ann, job, ("succeeded",))
