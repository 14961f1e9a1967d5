"""Fuzz the job API from its own OpenAPI schema (schemathesis) against a real uvicorn.

``/v1/sessions`` is fuzzed with the rest, and once more on what its body may hold: generated
images (NUL bytes, spaces, names that only look like hora's) must be refused by the schema
and the service alike - a 201 only for a body the schema allows, a 422 naming ``image`` for
one it refuses.

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
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


# --- /v1/sessions: the schema and the service agree on what a session body may hold --------

LOOPBACK_CONN = {
    "interface": "tcp://127.0.0.1", "registration": 1, "control": 2, "mux": 3, "task": 4,
    "iopub": 5, "hb_ping": 6, "hb_pong": 7, "key": "k-1",
}  # fmt: skip
IMAGES = st.one_of(
    st.text(max_size=24),  # anything: NUL, spaces, control characters, non-ASCII
    st.text(alphabet="abc:@/._-+\x00 \n", max_size=16).map(lambda t: "hora:" + t),
    st.sampled_from(["hora:cpu", "hora-gpu:1", "hora:5000/evil/miner", "hora-x/miner"]),
)


@pytest.fixture(scope="module")
def session_schema(fuzz_server: ServiceServer) -> Draft202012Validator:
    """A validator of ``SessionRequest`` as the service's own OpenAPI schema states it."""
    spec = httpx.get(fuzz_server.url + "/openapi.json", headers=fuzz_server.auth("fuzz")).json()
    schemas = spec["components"]["schemas"]
    root = {"$ref": "#/components/schemas/SessionRequest", "components": {"schemas": schemas}}
    return Draft202012Validator(root)


@given(image=IMAGES, runtime=st.sampled_from(["docker", "local"]))
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_a_session_body_the_schema_refuses_is_a_422_naming_the_field(
    image: str, runtime: str, fuzz_server: ServiceServer, session_schema: Draft202012Validator
) -> None:
    body = {"workers": 1, "connection": LOOPBACK_CONN, "runtime": runtime, "image": image}
    valid = session_schema.is_valid(body)
    with fuzz_server.client("fuzz") as c:
        r = c.post("/v1/sessions", json=body)
        if r.status_code == 201:
            c.delete(f"/v1/sessions/{r.json()['id']}")
    assert r.status_code in (201, 422), r.text
    if r.status_code == 201:
        # accepted: the schema allows it, and it is an image the service may run
        assert valid and runtime == "docker" and "\x00" not in image, body
    else:
        fields = {str(d["loc"][-1]) for d in r.json()["detail"]}
        assert fields <= {"image", "runtime"}, r.text  # the service names the field
        if not valid:
            assert "image" in fields, r.text


def test_a_literal_path_beside_a_session_id_is_a_405_for_other_methods(
    fuzz_server: ServiceServer,
) -> None:
    """schemathesis: ``GET /v1/sessions/park?user=`` was a 422 (read as the session "park"
    with an unknown parameter) where the schema says the path has only ``POST``."""
    with fuzz_server.client("fuzz") as c:
        for method in ("GET", "DELETE", "PUT", "PATCH"):
            for params in ({}, {"user": ""}):
                r = c.request(method, "/v1/sessions/park", params=params)
                assert (r.status_code, r.headers.get("allow")) == (405, "POST"), (method, r.text)
        assert c.post("/v1/sessions/park").status_code == 200  # the route itself still answers
        assert c.get("/v1/sessions/999999").status_code == 404  # ids are read as before


def test_a_405_names_every_method_the_path_has_and_a_token_is_still_needed(
    fuzz_server: ServiceServer,
) -> None:
    """``TRACE /v1/sessions/1`` was a 405 with an empty ``Allow`` (FastAPI keeps an included
    router as one route, so the methods were looked for where they no longer are)."""
    cases = {
        ("TRACE", "/v1/sessions/1"): "GET, DELETE",
        ("PUT", "/v1/sessions/1"): "GET, DELETE",
        ("PATCH", "/v1/jobs"): "GET, POST",
        ("TRACE", "/v1/sessions/park"): "POST",
        ("DELETE", "/healthz"): "GET",
    }
    with fuzz_server.client("fuzz") as c:
        for (method, path), allow in cases.items():
            r = c.request(method, path)
            assert (r.status_code, r.headers.get("allow")) == (405, allow), (method, path)
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as anon:
        for path in ("/v1/sessions/1", "/v1/jobs"):  # a method the path has: 401 first
            assert anon.get(path).status_code == 401, path
        r = anon.request("TRACE", "/v1/sessions/1")  # none: 405, as before the token check
        assert (r.status_code, r.headers.get("allow")) == (405, "GET, DELETE")
        assert "Method Not Allowed" in r.text and "session" not in r.text
