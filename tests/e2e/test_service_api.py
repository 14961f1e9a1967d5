"""The job API end to end: a real uvicorn, a real SQLite file, real job processes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers.service_server import ServiceServer, wait_state, write_scripts

PY = sys.executable
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(
        tmp_path_factory.mktemp("svc-api"), {"ann": False, "root": True}, cpu_slots=4,
        env={"SLURM_CONF": ""},  # no Slurm configured (HORA_SLURM_CONF is not set either)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_scripts(tmp_path_factory.mktemp("scripts"))


@pytest.fixture
def ann(server: ServiceServer) -> Iterator[httpx.Client]:
    with server.client("ann") as c:
        yield c


def submit(c: httpx.Client, command: list[str], **fields: Any) -> dict[str, Any]:
    r = c.post("/v1/jobs", json={"command": command, **fields})
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def read_all(c: httpx.Client, job_id: int, rank: int = 0, limit: int | None = None) -> str:
    text, offset = "", 0
    while True:
        params: dict[str, Any] = {"rank": rank, "offset": offset}
        if limit:
            params["limit"] = limit
        r = c.get(f"/v1/jobs/{job_id}/logs", params=params)
        assert r.status_code == 200, r.text
        nxt = int(r.headers["X-Hora-Next-Offset"])
        text += r.text
        if nxt == offset:
            return text
        offset = nxt


def sse(
    c: httpx.Client, job_id: int, headers: dict[str, str] | None = None, **params: Any
) -> list[dict[str, Any]]:
    """Follow a log to its end event; return the events (data decoded)."""
    events, cur = [], {}
    q = {"follow": "true", **params}
    with c.stream("GET", f"/v1/jobs/{job_id}/logs", params=q, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                if cur:
                    events.append(cur)
                    if cur.get("event") == "end":
                        break
                cur = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                cur[key] = json.loads(value) if key == "data" else value
    return events


def test_healthz_needs_no_token(server: ServiceServer) -> None:
    r = httpx.get(server.url + "/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_two_rank_job_lifecycle(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    created = ann.post(
        "/v1/jobs", json={"name": "hello", "command": [PY, str(scripts["hello"])], "workers": 2}
    )
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["state"] == "queued" and job["user"] == "ann" and job["spec"]["workers"] == 2
    done = wait_state(ann, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded", done
    assert {int(k): v for k, v in done["exit_codes"].items()} == {0: 0, 1: 0}
    states = [t["state"] for t in done["transitions"]]
    assert states[0] == "queued" and "running" in states and states[-1] == "succeeded"
    for rank in (0, 1):
        assert f"hello from rank {rank} of 2" in read_all(ann, job["id"], rank)
    assert ann.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded"
    assert ann.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert ann.get(f"/v1/jobs/{job['id']}").status_code == 404


def test_failed_rank_is_reported(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["fail"])], workers=2)
    done = wait_state(ann, job["id"], ("succeeded", "failed"))
    assert done["state"] == "failed"
    assert {int(k): v for k, v in done["exit_codes"].items()}[1] == 3
    assert done["reason"] and "1" in done["reason"]


def test_ddp_job_on_gloo(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["ddp"])], workers=2, name="ddp")
    done = wait_state(ann, job["id"], ("succeeded", "failed"), timeout=120)
    assert done["state"] == "succeeded", read_all(ann, job["id"], 0) + read_all(ann, job["id"], 1)
    assert "rank 0 of 2 sum 3" in read_all(ann, job["id"], 0)
    assert "rank 1 of 2 sum 3" in read_all(ann, job["id"], 1)


def test_retry_keeps_one_log_per_attempt(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["flaky"])], max_retries=1)
    done = wait_state(ann, job["id"], ("succeeded", "failed"), timeout=90)
    assert done["state"] == "succeeded" and done["attempt"] >= 2, done
    assert "retrying" in [t["state"] for t in done["transitions"]]
    last = ann.get(f"/v1/jobs/{job['id']}/logs").text
    assert "restart count 1" in last
    first = ann.get(f"/v1/jobs/{job['id']}/logs", params={"attempt": done["attempt"] - 1})
    assert "restart count 0" in first.text and first.headers["X-Hora-Log-Complete"] == "true"


def test_submission_id_is_idempotent(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    body = {"command": [PY, str(scripts["hello"])], "submission_id": "idem-1"}
    first = ann.post("/v1/jobs", json=body)
    again = ann.post("/v1/jobs", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    jobs = ann.get("/v1/jobs", params={"limit": 500}).json()["items"]
    assert [j["id"] for j in jobs if j["spec"].get("submission_id") == "idem-1"] == [
        first.json()["id"]
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"command": []}, "command"),
        ({"command": ["python"], "workers": 0}, "workers"),
        ({"command": "python train.py"}, "command"),
        ({"command": ["python"], "priority": "urgent"}, "priority"),
        ({"command": ["python"], "surprise": 1}, "surprise"),
        ({"command": ["python"], "env": {"BAD NAME": "1"}}, "env"),
        ({"command": ["python"], "workers": 3, "gpus_per_worker": 2}, None),
    ],
)
def test_bad_spec_is_422_naming_field(
    ann: httpx.Client, body: dict[str, Any], field: str | None
) -> None:
    r = ann.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    fields = {str(p) for d in detail for p in d["loc"]}
    if field is None:  # more slots than the cluster has: named, with both numbers
        assert fields & {"workers", "gpus_per_worker"}
        assert "6" in detail[0]["msg"] and "4" in detail[0]["msg"]
    else:
        assert field in fields


def test_the_slurm_runtime_without_a_configured_slurm_is_a_422_naming_the_setting(
    ann: httpx.Client,
) -> None:
    # sbatch is installed here; the service must not accept the job and fail it later with
    # sbatch's own "Could not establish a configuration source"
    r = ann.post("/v1/jobs", json={"command": ["python", "x.py"], "runtime": "slurm"})
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "runtime"], detail
    assert detail["msg"].startswith("no Slurm cluster answers: "), detail
    assert "set HORA_SLURM_CONF to the cluster's slurm.conf" in detail["msg"], detail
    assert ann.get("/v1/jobs").json()["total"] == 0 or all(
        j["spec"]["runtime"] != "slurm" for j in ann.get("/v1/jobs").json()["items"]
    )


def test_malformed_json_is_422(ann: httpx.Client) -> None:
    r = ann.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


@pytest.mark.parametrize(
    ("method", "path"), [("GET", ""), ("POST", "/cancel"), ("DELETE", ""), ("GET", "/logs")]
)
def test_unknown_job_is_404(ann: httpx.Client, method: str, path: str) -> None:
    r = ann.request(method, f"/v1/jobs/987654{path}")
    assert r.status_code == 404 and "987654" in r.json()["detail"]


@pytest.mark.parametrize("job_id", ["abc", "0", "-1", str(2**70)])
def test_bad_job_id_is_422(ann: httpx.Client, job_id: str) -> None:
    assert ann.get(f"/v1/jobs/{job_id}").status_code == 422


def test_list_filters_and_pages(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    ids = [submit(ann, [PY, str(scripts["hello"])], name=f"page-{i}")["id"] for i in range(3)]
    for i in ids:
        wait_state(ann, i, ("succeeded",))
    page = ann.get("/v1/jobs", params={"state": "succeeded", "limit": 2}).json()
    assert page["limit"] == 2 and len(page["items"]) == 2 and page["total"] >= 3
    assert all(j["state"] == "succeeded" for j in page["items"])
    listed = [j["id"] for j in page["items"]]
    assert listed == sorted(listed, reverse=True)  # newest first
    nxt = ann.get("/v1/jobs", params={"state": "succeeded", "limit": 2, "offset": 2}).json()
    assert not set(listed) & {j["id"] for j in nxt["items"]}
    assert ann.get("/v1/jobs", params={"state": "failed"}).json()["items"] == [] or all(
        j["state"] == "failed"
        for j in ann.get("/v1/jobs", params={"state": "failed"}).json()["items"]
    )


@pytest.mark.parametrize(
    "params", [{"limit": 0}, {"limit": 100000}, {"offset": -1}, {"state": "nope"}]
)
def test_list_bounds_are_422(ann: httpx.Client, params: dict[str, Any]) -> None:
    assert ann.get("/v1/jobs", params=params).status_code == 422


def test_logs_plain_offsets_and_bounds(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["chatty"]), "50", "0"], workers=2)
    wait_state(ann, job["id"], ("succeeded",))
    full = read_all(ann, job["id"])
    assert full.startswith("line 0000") and full.rstrip().endswith("done")
    assert read_all(ann, job["id"], limit=97) == full  # small pages join up exactly
    r = ann.get(f"/v1/jobs/{job['id']}/logs", params={"offset": 10, "limit": 20})
    assert r.text == full[10:30] and r.headers["X-Hora-Next-Offset"] == "30"
    assert r.headers["X-Hora-Log-Complete"] == "false"
    end = ann.get(f"/v1/jobs/{job['id']}/logs", params={"offset": len(full.encode())})
    assert end.text == "" and end.headers["X-Hora-Log-Complete"] == "true"
    bad = ann.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 2})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "rank"]
    future = ann.get(f"/v1/jobs/{job['id']}/logs", params={"attempt": 99})
    assert future.status_code == 422 and future.json()["detail"][0]["loc"] == ["query", "attempt"]


def test_logs_follow_streams_live_and_resumes(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["chatty"]), "30", "0.05"])
    wait_state(ann, job["id"], ("running", "succeeded"))
    events = sse(ann, job["id"])
    assert events[-1]["event"] == "end" and events[-1]["data"]["state"] == "succeeded"
    chunks = [e for e in events if e.get("event") is None]
    text = "".join(e["data"] for e in chunks)
    assert text == read_all(ann, job["id"]) and text.rstrip().endswith("done")
    offsets = [int(e["id"]) for e in chunks]
    assert offsets == sorted(offsets) and offsets[-1] == len(text.encode())
    # resume from the middle, both ways: offset= and Last-Event-ID
    mid = len(text.encode()) // 2
    by_offset = "".join(
        e["data"] for e in sse(ann, job["id"], offset=mid) if e.get("event") is None
    )
    by_header = sse(ann, job["id"], headers={"Last-Event-ID": str(mid)})
    assert by_offset == text.encode()[mid:].decode()
    assert "".join(e["data"] for e in by_header if e.get("event") is None) == by_offset


def test_cancel_kills_every_rank_and_frees_slots(
    ann: httpx.Client, scripts: dict[str, Path], tmp_path: Path
) -> None:
    pids_dir = tmp_path / "pids"
    job = submit(ann, [PY, str(scripts["sleeper"]), str(pids_dir)], workers=2)
    wait_state(ann, job["id"], ("running",))
    deadline = time.monotonic() + 30
    while len(list(pids_dir.glob("*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pids_dir.glob("*")]
    assert len(pids) == 2
    held = [s for s in ann.get("/v1/gpus").json() if s["job_id"] == job["id"]]
    assert len(held) == 2 and all(s["user"] == "ann" for s in held)
    r = ann.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200
    done = wait_state(ann, job["id"], ("cancelled",), timeout=30)
    assert done["state"] == "cancelled"
    assert ann.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"  # no-op
    gone_by = time.monotonic() + 15
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not [s for s in ann.get("/v1/gpus").json() if s["job_id"] == job["id"]]


def test_delete_of_running_job_is_409(
    ann: httpx.Client, scripts: dict[str, Path], tmp_path: Path
) -> None:
    job = submit(ann, [PY, str(scripts["sleeper"]), str(tmp_path)])
    wait_state(ann, job["id"], ("running",))
    r = ann.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 409 and "cancel" in r.json()["detail"]
    ann.post(f"/v1/jobs/{job['id']}/cancel")
    wait_state(ann, job["id"], ("cancelled",), timeout=30)
    assert ann.delete(f"/v1/jobs/{job['id']}").status_code == 204


def test_gpus_lists_every_slot(ann: httpx.Client) -> None:
    slots = ann.get("/v1/gpus").json()
    assert [s["index"] for s in slots] == [0, 1, 2, 3]
    assert {s["kind"] for s in slots} == {"cpu"}


def test_metrics_are_prometheus_text(ann: httpx.Client, scripts: dict[str, Path]) -> None:
    job = submit(ann, [PY, str(scripts["hello"])])
    wait_state(ann, job["id"], ("succeeded",))
    r = ann.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['hora_jobs{state="succeeded"}'] >= 1
    assert samples["hora_slots_total"] == 4
    assert "hora_queue_length" in samples and "hora_slots_allocated" in samples
    assert samples["hora_schedule_latency_seconds_count"] >= 1


def test_oversized_body_is_413_and_server_survives(
    ann: httpx.Client, server: ServiceServer
) -> None:
    big = {"command": ["python"], "env": {"X": "y" * (2 << 20)}}
    assert ann.post("/v1/jobs", json=big).status_code == 413

    def chunks() -> Iterator[bytes]:
        yield b'{"command": ["python"], "name": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    streamed = ann.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_openapi_documents_the_api(server: ServiceServer) -> None:
    for page in ("/openapi.json", "/docs", "/redoc"):  # only /healthz answers without a token
        assert httpx.get(server.url + page).status_code == 401
        assert httpx.get(server.url + page, headers=server.auth("ann")).status_code == 200
    schema = httpx.get(server.url + "/openapi.json", headers=server.auth("ann")).json()
    paths = schema["paths"]
    for path in (
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/logs",
        "/v1/gpus",
        "/healthz",
        "/metrics",
    ):
        assert path in paths
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert "security" not in paths["/healthz"]["get"]
    assert "security" in paths["/v1/jobs"]["post"]
