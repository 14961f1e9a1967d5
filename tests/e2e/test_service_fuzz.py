"""Fuzz the job API from its own OpenAPI schema (schemathesis) against a real uvicorn.

Every operation gets ~60 generated valid and invalid requests (derandomized: the same ones on
every run) with an admin token where the case has an Authorization header, and every
schemathesis check runs on each answer: no 5xx, conformance to the schema (status code,
content type, headers, body), invalid data rejected, valid data accepted. Generated
job commands are replaced with a harmless ``python -c pass`` before sending, so the fuzzer
never runs a random program on this machine (the rest of the body stays generated).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from helpers.service_server import ServiceServer
from hypothesis import HealthCheck, settings
from schemathesis.config import PositiveDataAcceptanceConfig

SAFE_COMMAND = [sys.executable, "-c", "pass"]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(tmp_path_factory.mktemp("svc-fuzz"), {"fuzz": True}, cpu_slots=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServiceServer) -> Any:
    return schemathesis.openapi.from_url(
        fuzz_server.url + "/openapi.json", headers=fuzz_server.auth("fuzz")
    )


schema = schemathesis.pytest.from_fixture("api_schema")


def _authorize(case: Any, token: str) -> None:
    """Put the real token where the case has an Authorization header.

    A case generated without one (the negative "missing header" mutation) is sent without
    one, so that it is rejected (401) as schemathesis expects.
    """
    if isinstance(case.headers, dict) and "Authorization" in case.headers:
        case.headers["Authorization"] = f"Bearer {token}"


def _defuse(case: Any) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("command"), list):
        body["command"] = list(SAFE_COMMAND)
    if isinstance(case.query, dict) and "follow" in case.query:
        case.query["follow"] = "false"  # a followed log of a live job streams until it ends


# Every check runs. A request valid by the schema may still be refused for what only the
# service knows: a job that does not exist (404), one still active (409 on DELETE), more
# slots than this machine has or a rank or attempt past the job's (422, naming the field).
ACCEPTED = ["2xx", "401", "403", "404", "409", "422"]
EXAMPLES = 60  # per operation: about 500 requests in all


@pytest.fixture(scope="module", autouse=True)
def _configure(api_schema: Any) -> None:
    api_schema.config.checks.positive_data_acceptance = PositiveDataAcceptanceConfig(
        expected_statuses=ACCEPTED
    )


@schema.parametrize()
# derandomized: the same ~500 requests every run (a failure reproduces; CI does not flake)
@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
def test_api_never_5xx_and_conforms(case: Any, fuzz_server: ServiceServer) -> None:
    _defuse(case)
    _authorize(case, fuzz_server.tokens["fuzz"])
    case.call_and_validate(timeout=30)


def test_server_state_is_intact_after_fuzzing(fuzz_server: ServiceServer, tmp_path: Path) -> None:
    """After the fuzzer, the service still answers and every listed job is readable."""
    with fuzz_server.client("fuzz") as c:
        assert httpx.get(fuzz_server.url + "/healthz").status_code == 200
        page = c.get("/v1/jobs", params={"limit": 500})
        assert page.status_code == 200
        for job in page.json()["items"]:
            assert c.get(f"/v1/jobs/{job['id']}").status_code == 200
        assert len(c.get("/v1/gpus").json()) == 2
