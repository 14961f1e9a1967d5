"""Every bad input is a 4xx naming the field (real service, raw request bodies).

The cases a hostile user tried (issue 7): non-finite numbers, lone surrogates, working
directories that loop, hold a NUL or a 4,096-character name, an empty program, log offsets
past the end of any file (the largest the route allows included), attempts that have not
happened, unknown query parameters. Bodies are sent as raw bytes, since a JSON library
would refuse to write most of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from helpers.service_server import ServiceServer, wait_state

PY = sys.executable
pytestmark = pytest.mark.timeout(120)
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    tmp = tmp_path_factory.mktemp("svc-input")
    (tmp / "loop").symlink_to(tmp / "loop")  # a symlink loop under the work root
    with ServiceServer(tmp, cpu_slots=2) as server:
        yield server


@pytest.fixture(scope="module")
def ann(srv: ServiceServer) -> Iterator[httpx.Client]:
    with srv.client("ann") as c:
        yield c


@pytest.fixture(scope="module")
def done_job(ann: httpx.Client) -> dict[str, object]:
    r = ann.post("/v1/jobs", json={"command": [PY, "-c", "print('x' * 100)"]})
    assert r.status_code == 201, r.text
    return wait_state(ann, r.json()["id"], ("succeeded",))


BAD_BODIES = {
    "timeout NaN": ('{"command": ["true"], "timeout_s": NaN}', "timeout_s"),
    "timeout Infinity": ('{"command": ["true"], "timeout_s": Infinity}', "timeout_s"),
    "timeout -Infinity": ('{"command": ["true"], "timeout_s": -Infinity}', "timeout_s"),
    "timeout 1e999": ('{"command": ["true"], "timeout_s": 1e999}', "timeout_s"),
    "workers NaN": ('{"command": ["true"], "workers": NaN}', "workers"),
    "workers 1e999": ('{"command": ["true"], "workers": 1e999}', "workers"),
    "max_retries Infinity": ('{"command": ["true"], "max_retries": Infinity}', "max_retries"),
    "surrogate in command": ('{"command": ["\\ud800"]}', "command"),
    "surrogate in an argument": ('{"command": ["true", "a\\udfffb"]}', "command"),
    "surrogate in env value": ('{"command": ["true"], "env": {"A": "\\ud800"}}', "env"),
    "surrogate in env name": ('{"command": ["true"], "env": {"\\ud800": "x"}}', "env"),
    "surrogate in working_dir": ('{"command": ["true"], "working_dir": "\\ud800"}', "working_dir"),
    "NUL in working_dir": ('{"command": ["true"], "working_dir": "a\\u0000b"}', "working_dir"),
    "4096-char working_dir": (
        json.dumps({"command": ["true"], "working_dir": "a" * 4096}),
        "working_dir",
    ),  # fmt: skip
    "symlink loop working_dir": ('{"command": ["true"], "working_dir": "loop"}', "working_dir"),
    "looping path below": ('{"command": ["true"], "working_dir": "loop/x/y"}', "working_dir"),
    "empty program": ('{"command": [""]}', "command"),
}


@pytest.mark.parametrize("body,field", BAD_BODIES.values(), ids=list(BAD_BODIES))
def test_bad_spec_is_a_422_naming_the_field(ann: httpx.Client, body: str, field: str) -> None:
    r = ann.post("/v1/jobs", content=body.encode("utf-8", "surrogatepass"), headers=JSON)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail[0]["loc"][:2] == ["body", field], detail


def test_an_empty_later_argument_is_fine(ann: httpx.Client) -> None:
    r = ann.post("/v1/jobs", json={"command": [PY, "-c", ""]})
    assert r.status_code == 201, r.text
    assert wait_state(ann, r.json()["id"], ("succeeded", "failed"))["state"] == "succeeded"


@pytest.mark.parametrize("offset", [2**44, 2**44 + 1, 2**50, 2**62])
def test_log_offset_past_any_file_reads_empty(
    ann: httpx.Client, done_job: dict[str, object], offset: int
) -> None:
    r = ann.get(f"/v1/jobs/{done_job['id']}/logs", params={"offset": offset})
    assert r.status_code == 200 and r.text == ""
    assert r.headers["X-Hora-Next-Offset"] == str(offset)


def test_followed_log_from_a_huge_offset_ends_cleanly(
    ann: httpx.Client, done_job: dict[str, object]
) -> None:
    params = {"offset": 2**44, "follow": "true"}
    with ann.stream("GET", f"/v1/jobs/{done_job['id']}/logs", params=params) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "event: end" in text, text  # the stream was not cut


def test_offset_past_the_maximum_is_a_422(ann: httpx.Client, done_job: dict[str, object]) -> None:
    r = ann.get(f"/v1/jobs/{done_job['id']}/logs", params={"offset": 2**63})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "offset"]


def test_an_attempt_that_has_not_happened_is_a_422(
    ann: httpx.Client, done_job: dict[str, object]
) -> None:
    r = ann.get(f"/v1/jobs/{done_job['id']}/logs", params={"attempt": 2})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "attempt"]


def test_unknown_query_parameter_is_a_422(ann: httpx.Client) -> None:
    r = ann.get("/v1/jobs", params={"stat": "running"})  # a typo is not silently ignored
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "stat"]


def test_schema_says_what_is_accepted(srv: ServiceServer, ann: httpx.Client) -> None:
    schema = ann.get("/openapi.json").json()
    command = schema["components"]["schemas"]["JobSpec"]["properties"]["command"]
    assert command["prefixItems"] == [{"type": "string", "minLength": 1}]
    assert command["minItems"] == 1
    assert httpx.get(srv.url + "/openapi.json").status_code == 401


def test_service_is_intact_after_bad_input(srv: ServiceServer, ann: httpx.Client) -> None:
    assert httpx.get(srv.url + "/healthz").json()["status"] == "ok"
    assert "Traceback" not in srv.output()  # no request ended in an unhandled error
    assert len(ann.get("/v1/gpus").json()) == 2


def test_token_from_stdin_keeps_it_out_of_the_command_line(srv: ServiceServer) -> None:
    def jobs(token_arg: str, stdin: str) -> subprocess.CompletedProcess[str]:
        argv = [PY, "-m", "hora.cli", "jobs", "--url", srv.url, "--token", token_arg]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
        env["HORA_CONFIG"] = str(srv.data_dir / "no-such-config")
        return subprocess.run(
            argv, input=stdin, env=env, capture_output=True, text=True, timeout=60
        )

    ok = jobs("-", srv.tokens["ann"] + "\n")
    assert ok.returncode == 0, ok.stderr
    empty = jobs("-", "")
    assert empty.returncode == 2 and "token" in empty.stderr and "Traceback" not in empty.stderr
