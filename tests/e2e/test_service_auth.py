"""Auth of the job API against a real server: tokens, isolation between users, admins."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.service_server import (
    SERVE,
    ServiceServer,
    free_port,
    server_env,
    wait_state,
    write_scripts,
)
from hora_service.ui.auth import SESSIONS_PER_USER

PY = sys.executable
pytestmark = pytest.mark.timeout(180)

ENDPOINTS = [
    ("GET", "/v1/jobs"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs/1"),
    ("POST", "/v1/jobs/1/cancel"),
    ("DELETE", "/v1/jobs/1"),
    ("GET", "/v1/jobs/1/logs"),
    ("GET", "/v1/gpus"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    users = {"ann": False, "bob": False, "root": True}
    with ServiceServer(tmp_path_factory.mktemp("svc-auth"), users, cpu_slots=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def ann_job(server: ServiceServer, tmp_path_factory: pytest.TempPathFactory) -> int:
    """A running job of ann's (a sleeper, cancelled by the server fixture at the end)."""
    scripts = write_scripts(tmp_path_factory.mktemp("scripts"))
    with server.client("ann") as ann:
        r = ann.post(
            "/v1/jobs",
            json={"command": [PY, str(scripts["sleeper"]), str(scripts["hello"].parent / "p")]},
        )
        assert r.status_code == 201
        wait_state(ann, r.json()["id"], ("running",))
        return int(r.json()["id"])


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": "Basic YW5uOnB3"},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "unknown", "basic", "empty"],
)
def test_every_endpoint_needs_a_valid_token(
    server: ServiceServer, method: str, path: str, headers: dict[str, str]
) -> None:
    r = httpx.request(method, server.url + path, headers=headers, json={"command": ["true"]})
    assert r.status_code == 401, (method, path, r.text)
    assert r.headers["www-authenticate"] == "Bearer"


def test_other_users_job_is_404_everywhere(server: ServiceServer, ann_job: int) -> None:
    with server.client("bob") as bob:
        for method, suffix in [("GET", ""), ("POST", "/cancel"), ("DELETE", ""), ("GET", "/logs")]:
            r = bob.request(method, f"/v1/jobs/{ann_job}{suffix}")
            assert r.status_code == 404, (method, suffix, r.text)
            assert r.json()["detail"] == f"job {ann_job} not found"  # same as a missing job
        assert bob.get(f"/v1/jobs/{ann_job}/logs", params={"follow": "true"}).status_code == 404
        assert ann_job not in [j["id"] for j in bob.get("/v1/jobs").json()["items"]]
    with server.client("ann") as ann:
        assert (
            ann.get(f"/v1/jobs/{ann_job}").json()["state"] == "running"
        )  # bob's cancel did nothing


def test_admin_sees_and_cancels_everyones_jobs(server: ServiceServer, ann_job: int) -> None:
    with server.client("root") as root:
        assert ann_job in [j["id"] for j in root.get("/v1/jobs").json()["items"]]
        assert root.get(f"/v1/jobs/{ann_job}").json()["user"] == "ann"
        assert root.get(f"/v1/jobs/{ann_job}/logs").status_code == 200
        assert root.post(f"/v1/jobs/{ann_job}/cancel").status_code == 200
        assert wait_state(root, ann_job, ("cancelled",), timeout=30)["state"] == "cancelled"


def test_users_list_only_their_own(server: ServiceServer, tmp_path: Path) -> None:
    scripts = write_scripts(tmp_path)
    with server.client("bob") as bob:
        mine = bob.post("/v1/jobs", json={"command": [PY, str(scripts["hello"])]}).json()
        assert mine["user"] == "bob"
        listed = bob.get("/v1/jobs", params={"limit": 500}).json()["items"]
        assert listed and {j["user"] for j in listed} == {"bob"}
        wait_state(bob, mine["id"], ("succeeded",))


def test_submission_ids_are_per_user(server: ServiceServer, tmp_path: Path) -> None:
    scripts = write_scripts(tmp_path)
    body = {"command": [PY, str(scripts["hello"])], "submission_id": "shared-key"}
    with server.client("ann") as ann, server.client("bob") as bob:
        a = ann.post("/v1/jobs", json=body).json()
        b = bob.post("/v1/jobs", json=body).json()
        assert a["id"] != b["id"] and (a["user"], b["user"]) == ("ann", "bob")


def test_dashboard_sign_ins_are_capped_per_user(server: ServiceServer) -> None:
    def sign_in(user: str) -> httpx.Client:
        page = httpx.Client(base_url=server.url, timeout=30)
        assert page.post("/ui/login", json={"token": server.tokens[user]}).status_code == 200
        return page

    bob = sign_in("bob")
    ann = [sign_in("ann") for _ in range(SESSIONS_PER_USER + 1)]
    try:
        assert bob.get("/ui/api/me").json()["user"] == "bob"  # ann's sign-ins left bob alone
        assert ann[0].get("/ui/api/me").status_code == 401  # her own oldest session ended
        assert [p.get("/ui/api/me").status_code for p in ann[1:]] == [200] * SESSIONS_PER_USER
    finally:
        for page in [bob, *ann]:
            page.close()


def test_refuses_public_bind_without_users(tmp_path: Path) -> None:
    env = server_env(tmp_path / "data", free_port(), extra={"HORA_HOST": "0.0.0.0"})
    out = subprocess.run([PY, "-c", SERVE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "no users" in out.stdout + out.stderr
