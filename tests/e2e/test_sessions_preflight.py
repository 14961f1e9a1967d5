"""A notebook session's communication preflight, read by a real service (CPU slots, gloo).

A real uvicorn service on 127.0.0.1 with 2 CPU slots; a real kernel started by nbclient with
``HORA_URL``/``HORA_TOKEN`` set, so ``%dist_start -n 2`` asks the service for a session and
its two ipyparallel engines are started by the service's local runtime. Engine rank 1 is
slowed on purpose: a ``sitecustomize`` on the engines' ``PYTHONPATH`` adds a test hook that
sleeps inside each of the preflight's timed local copies on the session engine whose
``RANK`` is 1 (nothing else in the run is touched).

The service has a recorded baseline for this host (the preflight judges nothing without
one). Checked: ``%dist_start`` shows the figures' line naming rank 1; the engines' logs hold
no ``HORA_PREFLIGHT`` line (rank 0 hands the figures to its shim on a pipe); the service
reads them: ``GET /v1/sessions/{id}`` and ``GET /v1/jobs/{id}`` carry the validated figures
naming rank 1, the session's events have the line while it is ``running``, and so does the
dashboard's JSON for the session's page (``/ui/api/jobs/{id}``, signed in with the cookie),
and the page itself in headless Chromium (the *Preflight* box and the events naming rank 1;
a screenshot is saved under pytest's tmp dir, or ``HORA_SCREENSHOT_DIR``). A second
service whose admin set ``job_preflight_fail_below`` passes it to the engines: ``%dist_start``
raises naming rank 1, the session's ``preflight.failed`` has the message, and its page says
``failed %dist_start`` (the engines stay up until ``%dist_stop``, as the magics page says).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e._notebook import Notebook, close_checked
from e2e._notebooks_procs import new_tag, tagged_env
from e2e.test_dashboard import CHROMIUM, CHROMIUM_ARGS, SCREENSHOT_DIR_VAR, sign_in
from helpers.known_share import baseline_env
from helpers.service_server import ServiceServer
from playwright.sync_api import Page, expect, sync_playwright

pytestmark = pytest.mark.timeout(240)
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)"
)

# imported by every Python process that has the folder on its path; acts only in the
# service's session engine of rank 1 (the service passes RANK and the connection info)
SLOW_ENGINE = """\
import os
if os.environ.get("RANK") == "1" and "HORA_ENGINE_CONNECTION" in os.environ:
    import time
    from hora.torch import preflight
    preflight.SLOW_HOOKS.append(lambda phase: time.sleep(0.05) if phase == "copy" else None)
"""


def poll(c: httpx.Client, url: str, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """GET ``url`` until ``ready`` says yes (at most 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        body: dict[str, Any] = c.get(url).json()
        if ready(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} is still {body}")
        time.sleep(0.2)


@contextmanager
def slowing_server(root: Path, env: dict[str, str] | None = None) -> Iterator[ServiceServer]:
    """A service whose session engine of rank 1 is slowed (see the module docstring)."""
    hook = root / "slow-engine"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_ENGINE)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "HORA_SESSION_LEASE_S": "10",
        "HORA_SESSION_IDLE_TIMEOUT_S": "3600",
        "PYTHONPATH": path,  # passed on to the engines (HORA_JOB_ENV_PASSTHROUGH)
        **baseline_env(root),
        **(env or {}),
    }
    with ServiceServer(root, {"ann": False, "bob": False}, 2, env) as srv:
        yield srv


@contextmanager
def two_engines(server: ServiceServer, work: Path) -> Iterator[dict[str, Any]]:
    """ann's notebook after ``%dist_start -n 2``: the session's id and the cell's output."""
    tag = new_tag()
    env = tagged_env(tag)
    env.update(HORA_URL=server.url, HORA_TOKEN=server.tokens["ann"],
               HORA_CONFIG=str(work / "no-config"))
    nb = Notebook(env, work)
    try:
        nb.run("%load_ext hora")
        out = nb.run("%dist_start -n 2 --timeout 60")
        assert "2 engines ready" in out, out
        with server.client("ann") as c:
            (sid,) = [s["id"] for s in c.get("/v1/sessions").json()["items"]
                      if s["state"] == "running"]
        yield {"id": sid, "out": out}
        nb.run("%dist_stop")
    finally:
        close_checked(nb, tag)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with slowing_server(tmp_path_factory.mktemp("svc-preflight-nb")) as srv:
        yield srv


@pytest.fixture(scope="module")
def session(
    server: ServiceServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """ann's running 2-engine session: its id and ``%dist_start``'s output."""
    with two_engines(server, tmp_path_factory.mktemp("nb")) as started:
        yield started


@contextmanager
def session_page(server: ServiceServer, sid: int, shot: Path) -> Iterator[Page]:
    """ann signed in with headless Chromium on the session's page; a screenshot at the end."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = sign_in(browser, server, "ann")
            page.goto(server.url + f"/ui#/job/{sid}")
            yield page
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()


def shots(tmp: Path) -> Path:
    """Where screenshots go: ``HORA_SCREENSHOT_DIR``, else the test's tmp dir."""
    return Path(os.environ.get(SCREENSHOT_DIR_VAR) or tmp)


def test_dist_start_shows_the_line_naming_the_slowed_engine(session: dict[str, Any]) -> None:
    out = session["out"]
    (line,) = [x for x in out.splitlines() if x.startswith("preflight (2 ranks, ")]
    assert "SLOW: rank 1 (" in line, out
    assert "HORA_PREFLIGHT" not in out  # the figures go to the service, not to the notebook


def test_the_service_reads_the_session_s_preflight(
    server: ServiceServer, session: dict[str, Any]
) -> None:
    sid = session["id"]
    with server.client("ann") as c, server.client("bob") as bob:
        body = poll(c, f"/v1/sessions/{sid}", lambda b: b["preflight"] is not None)
        figures = body["preflight"]
        assert body["state"] == "running"
        assert figures["size"] == 2 and figures["backend"] == "gloo" and not figures["failed"]
        assert figures["line"].startswith("preflight (2 ranks, ")
        assert "SLOW: rank 1 (" in figures["line"], figures["line"]
        assert any(f["who"] == "rank 1" for f in figures["findings"]), figures["findings"]
        record = poll(c, f"/v1/jobs/{sid}",
                      lambda r: any(t["reason"] == figures["line"] for t in r["transitions"]))
        assert record["kind"] == "session" and record["preflight"] == figures
        events = [t["state"] for t in record["transitions"] if t["reason"] == figures["line"]]
        assert events == ["running"], record["transitions"]
        for rank in (0, 1):  # the figures went to the service on a pipe, not to a log
            log = c.get(f"/v1/jobs/{sid}/logs", params={"rank": rank}).text
            assert "HORA_PREFLIGHT" not in log, log[-2000:]
        assert bob.get(f"/v1/sessions/{sid}").status_code == 404  # not bob's session
    with httpx.Client(base_url=server.url, timeout=30) as page:  # what the dashboard reads
        assert page.post("/ui/login", json={"token": server.tokens["ann"]}).status_code == 200
        shown = page.get(f"/ui/api/jobs/{sid}").json()
    assert shown["kind"] == "session" and shown["preflight"]["line"] == figures["line"]
    assert shown["preflight"]["findings"] == figures["findings"]


@needs_chromium
def test_the_session_s_page_shows_its_preflight(
    server: ServiceServer, session: dict[str, Any], tmp_path: Path
) -> None:
    shot = shots(tmp_path) / "dashboard-session-preflight.png"
    with session_page(server, session["id"], shot) as page:
        expect(page.locator("#job-state")).to_have_text("running")
        expect(page.locator("#cancel")).to_have_text("Stop session")
        expect(page.locator("#job-preflight")).to_be_visible()
        expect(page.locator("#preflight-line")).to_contain_text("preflight (2 ranks, ")
        expect(page.locator("#preflight-line")).to_contain_text("SLOW: rank 1 (")
        expect(page.locator("#preflight-slow li").first).to_contain_text("rank 1 (")
        expect(page.locator("#preflight-failed")).to_have_count(0)
        expect(page.locator("#transitions")).to_contain_text("SLOW: rank 1 (")


@needs_chromium
def test_an_admin_threshold_fails_dist_start_naming_the_engine(tmp_path: Path) -> None:
    why = "preflight: below 0.3 of the baseline: rank 1 ("
    with (
        slowing_server(tmp_path, {"HORA_JOB_PREFLIGHT_FAIL_BELOW": "0.3"}) as server,
        two_engines(server, tmp_path) as started,
    ):
        assert why in started["out"], started["out"]  # %dist_start raised, naming rank 1
        sid = started["id"]
        with server.client("ann") as c:
            body = poll(c, f"/v1/sessions/{sid}", lambda b: b["preflight"] is not None)
        figures = body["preflight"]
        assert body["state"] == "running"  # the engines stay up until %dist_stop
        assert figures["failed"].startswith(why) and "FAILED" in figures["line"], figures
        shot = shots(tmp_path) / "dashboard-session-preflight-failed.png"
        with session_page(server, sid, shot) as page:
            failed = page.locator("#preflight-failed")
            expect(failed).to_contain_text("failed %dist_start: " + why)
            expect(page.locator("#preflight-line")).to_contain_text("FAILED: threshold crossed")
