"""The web dashboard at /ui in headless Chromium (Playwright) against a real service.

A real ``hora serve`` (uvicorn on 127.0.0.1, SQLite file) with two CPU slots runs real jobs:
plain Python scripts whose ranks print a few lines and then wait for a gate file the test
creates, so that the page is seen while they run without the test depending on timings.
Covered: sign-in (the cookie is HttpOnly and SameSite=Strict, the token never reaches
``document.cookie``), a job watched on one page (no reload) going queued -> running ->
succeeded with every rank's log streaming, a queued job's reason, cancelling a running job
from its page, another user who cannot read the job or its logs (page and API), POSTs
refused without the CSRF token or from another origin, the admin's users page, and a job's
timeline drawn from the trace its ranks wrote (the Chrome-trace part files that
``hora.torch``'s timeline writes, written here by the script itself to spare a torch import).
Last, one real torch job (tests/helpers/known_share.py: rank 1 slowed in the preflight, a
known communication share, its timeline recorded): its page shows the preflight naming
rank 1 (the box and the job's events) and the scaling report from its timeline (the table,
a bar per rank, the verdict naming rank 1 and compute). The same job on a second service
whose admin set a preflight threshold fails before training: its page says so and names
rank 1 (the failure in the *Preflight* box and the state line).

A screenshot of each page is saved under pytest's tmp dir, or ``HORA_SCREENSHOT_DIR``.
Skipped only when /usr/bin/chromium is missing (CI installs it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.known_share import SCRIPT as KNOWN_SHARE
from helpers.known_share import baseline_env
from helpers.service_server import ServiceServer, wait_state
from playwright.sync_api import Browser, Page, expect, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]  # fmt: skip
SCREENSHOT_DIR_VAR = "HORA_SCREENSHOT_DIR"
WAIT_MS = 30_000

# each rank prints three lines, waits for the gate file, then says done (and, given a
# timeline path, writes one complete event per line the way hora.torch.timeline does)
GATED = """\
import json, os, pathlib, sys, time
gate, rank = pathlib.Path(sys.argv[1]), int(os.environ["RANK"])
for i in range(3):
    print(f"rank {rank} line {i}", flush=True)
deadline = time.monotonic() + 120
while not gate.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trace = os.environ.get("HOROVOD_TIMELINE")
if trace:
    with open(f"{trace}.rank{rank}.part", "w") as f:
        f.write(json.dumps({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
                            "args": {"name": "grad.w"}}) + "\\n")
        for k, name in enumerate(["QUEUED", "ALLREDUCE"]):
            f.write(json.dumps({"ph": "X", "name": name, "pid": rank, "tid": 1,
                                "ts": 1000 * k + 100 * rank, "dur": 800}) + "\\n")
print(f"rank {rank} done", flush=True)
"""

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]


expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dash")
    (root / "gated.py").write_text(GATED)
    (root / "known_share.py").write_text(KNOWN_SHARE)
    return root


@pytest.fixture(scope="module")
def srv(work: Path) -> Iterator[ServiceServer]:
    with ServiceServer(work, users={"ann": False, "bob": False, "root": True}, cpu_slots=2,
                       env=baseline_env(work)) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keep = os.environ.get(SCREENSHOT_DIR_VAR)
    folder = Path(keep) if keep else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sign_in(browser: Browser, srv: ServiceServer, user: str) -> Page:
    page = browser.new_context(viewport={"width": 1366, "height": 820}).new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(srv.url + "/ui")
    page.fill("#token", srv.tokens[user])
    page.click("#signin")
    expect(page.locator("#who")).to_have_text(user + (" (admin)" if user == "root" else ""))
    expect(page.locator("#login")).to_be_hidden()
    return page


def submit(srv: ServiceServer, user: str, work: Path, gate: str, **spec: object) -> int:
    body = {"command": [sys.executable, str(work / "gated.py"), str(work / gate)], **spec}
    with srv.client(user) as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


def test_sign_in_sets_an_http_only_strict_cookie(
    browser: Browser, srv: ServiceServer, shots: Path
) -> None:
    page = browser.new_context(viewport={"width": 1366, "height": 820}).new_page()
    page.goto(srv.url + "/ui")
    page.fill("#token", "not-a-token")
    page.click("#signin")
    expect(page.locator("#login-error")).to_have_text("Unknown token.")
    page.screenshot(path=str(shots / "dashboard-login.png"))
    page.fill("#token", srv.tokens["ann"])
    page.click("#signin")
    expect(page.locator("#who")).to_have_text("ann")
    cookie = next(c for c in page.context.cookies() if c["name"] == "hora_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert page.evaluate("document.cookie") == ""  # the script never sees the session
    assert srv.tokens["ann"] not in cookie["value"]
    # the session is for the dashboard only: the API still wants the bearer token
    assert page.request.get(srv.url + "/v1/jobs").status == 401
    page.context.close()


def test_job_goes_queued_running_succeeded_with_live_logs(
    browser: Browser, srv: ServiceServer, work: Path, shots: Path
) -> None:
    blocker = submit(srv, "ann", work, "gate-blocker", workers=2, name="blocker")
    with srv.client("ann") as c:
        wait_state(c, blocker, ("running",))
    job = submit(srv, "ann", work, "gate-job", workers=2, name="watched")
    page = sign_in(browser, srv, "ann")
    page.goto(srv.url + "/ui#/pool")
    expect(page.locator("#pool tbody tr.held")).to_have_count(2)
    expect(page.locator("#pool")).to_contain_text(f"job {blocker}")
    page.screenshot(path=str(shots / "dashboard-pool.png"), full_page=True)
    page.goto(srv.url + "/ui#/queue")
    expect(page.locator("#queue")).to_contain_text("waiting for 2 slot(s): 0 of 2 free")
    page.screenshot(path=str(shots / "dashboard-queue.png"), full_page=True)

    # one page, never reloaded, watches the job from queued to succeeded
    page.goto(srv.url + f"/ui#/job/{job}")
    page.evaluate("window.__same_page = true")
    expect(page.locator("#job-state")).to_have_text("queued")
    expect(page.locator("#queue-reason")).to_contain_text("waiting for 2 slot(s): 0 of 2 free")
    expect(page.locator("#queue-reason .kind")).to_have_text("slots")
    page.screenshot(path=str(shots / "dashboard-job-queued.png"), full_page=True)

    # the blocker is cancelled from its own page (a second tab)
    other = page.context.new_page()
    other.set_default_timeout(WAIT_MS)
    other.goto(srv.url + f"/ui#/job/{blocker}")
    expect(other.locator("#job-state")).to_have_text("running")
    expect(other.locator("#log-1")).to_contain_text("rank 1 line 2")
    other.click("#cancel")
    expect(other.locator("#job-state")).to_have_text("cancelled")
    expect(other.locator("#cancel")).to_be_hidden()
    other.screenshot(path=str(shots / "dashboard-job-cancelled.png"), full_page=True)

    expect(page.locator("#job-state")).to_have_text("running")
    for rank in (0, 1):
        expect(page.locator(f"#log-{rank}")).to_contain_text(f"rank {rank} line 2")
    assert "done" not in page.locator("#log-0").inner_text()  # the gate is still closed
    page.screenshot(path=str(shots / "dashboard-job-running.png"), full_page=True)
    (work / "gate-job").touch()
    expect(page.locator("#job-state")).to_have_text("succeeded")
    for rank in (0, 1):
        expect(page.locator(f"#log-{rank}")).to_contain_text(f"rank {rank} done")
    expect(page.locator("#exit-codes")).to_contain_text("0")
    expect(page.locator("#transitions")).to_contain_text("queued")
    assert page.evaluate("window.__same_page") is True
    log0 = page.locator("#log-0").inner_text()
    assert log0.count("rank 0 line 0") == 1  # streamed once, not re-appended by each poll
    page.screenshot(path=str(shots / "dashboard-job-succeeded.png"), full_page=True)

    # resubmit: the same spec as a new job, whose page opens (the gate is open: it succeeds)
    page.click("#resubmit")
    page.wait_for_url(lambda url: "#/job/" in url and not url.endswith(f"#/job/{job}"))
    again = int(page.url.rsplit("/", 1)[1])
    assert again > job
    expect(page.locator("#job-state")).to_have_text("succeeded")
    expect(page.locator("#log-1")).to_contain_text("rank 1 done")
    with srv.client("ann") as c:
        assert c.get(f"/v1/jobs/{again}").json()["spec"]["name"] == "watched"

    page.goto(srv.url + "/ui#/jobs")
    page.select_option("#filter-state", "cancelled")
    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    expect(page.locator("#jobs")).to_contain_text("blocker")
    page.select_option("#filter-state", "")
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    page.screenshot(path=str(shots / "dashboard-jobs.png"), full_page=True)
    page.context.close()


def test_another_user_sees_neither_the_job_nor_its_logs(
    browser: Browser, srv: ServiceServer, work: Path, shots: Path
) -> None:
    job = submit(srv, "ann", work, "gate-private", name="private")
    with srv.client("ann") as c:
        wait_state(c, job, ("running",))
    page = sign_in(browser, srv, "bob")
    page.goto(srv.url + f"/ui#/job/{job}")
    expect(page.locator("#page-error")).to_contain_text(f"job {job} not found")
    page.screenshot(path=str(shots / "dashboard-other-user.png"), full_page=True)
    assert page.request.get(f"{srv.url}/ui/api/jobs/{job}/logs?rank=0").status == 404
    assert page.request.get(f"{srv.url}/ui/api/jobs/{job}").status == 404
    with srv.client("bob") as c:
        assert c.get(f"/v1/jobs/{job}/logs", params={"rank": 0}).status_code == 404
    # who holds which slot is shown to everyone, nothing more
    page.goto(srv.url + "/ui#/pool")
    expect(page.locator("#pool")).to_contain_text("ann")
    expect(page.locator("#pool")).not_to_contain_text("private")
    mine = page.request.get(f"{srv.url}/ui/api/jobs").json()
    assert mine["items"] == []
    (work / "gate-private").touch()
    page.context.close()


def test_posts_need_the_csrf_token_and_the_same_origin(
    browser: Browser, srv: ServiceServer, work: Path
) -> None:
    job = submit(srv, "ann", work, "gate-csrf", name="csrf")
    page = sign_in(browser, srv, "ann")
    url = f"{srv.url}/ui/api/jobs/{job}/cancel"
    assert page.request.post(url).status == 403  # the cookie alone is not enough
    csrf = page.request.get(srv.url + "/ui/api/me").json()["csrf"]
    evil = {"X-Hora-CSRF": csrf, "Origin": "http://evil.example"}
    assert page.request.post(url, headers=evil).status == 403
    login = httpx.post(
        srv.url + "/ui/login",
        json={"token": srv.tokens["ann"]},
        headers={"Origin": "http://evil.example"},
    )
    assert login.status_code == 403
    with srv.client("ann") as c:
        assert c.get(f"/v1/jobs/{job}").json()["state"] != "cancelled"
    done = page.request.post(url, headers={"X-Hora-CSRF": csrf, "Origin": srv.url})
    assert done.status == 200 and done.json()["id"] == job
    page.context.close()


def test_admin_sees_users_and_a_job_timeline(
    browser: Browser, srv: ServiceServer, work: Path, shots: Path
) -> None:
    (work / "gate-trace").touch()
    job = submit(
        srv, "root", work, "gate-trace", workers=2, name="traced",
        env={"HOROVOD_TIMELINE": "trace.json"},
    )  # fmt: skip
    with srv.client("root") as c:
        wait_state(c, job, ("succeeded",))
    page = sign_in(browser, srv, "root")
    page.goto(srv.url + "/ui#/users")
    expect(page.locator("main table").first).to_contain_text("bob")
    expect(page.locator("main")).to_contain_text("max_running_jobs_per_user")
    page.screenshot(path=str(shots / "dashboard-users.png"), full_page=True)
    page.goto(srv.url + "/ui#/sessions")
    expect(page.locator("main h1")).to_have_text("Sessions")
    page.screenshot(path=str(shots / "dashboard-sessions.png"), full_page=True)
    page.goto(srv.url + f"/ui#/job/{job}")
    expect(page.locator("#timeline-box svg rect")).to_have_count(4)  # 2 ranks x 2 phases
    expect(page.locator("#timeline-box")).to_contain_text("rank 1")
    expect(page.locator("#timeline-box h2")).to_contain_text("1.90 ms, 4 events")
    page.screenshot(path=str(shots / "dashboard-timeline.png"), full_page=True)
    # an admin may cancel anyone's job, but a resubmit would run ann's command as root
    with srv.client("ann") as c:
        anns = c.get("/v1/jobs").json()["items"][0]["id"]
    csrf = page.request.get(srv.url + "/ui/api/me").json()["csrf"]
    refused = page.request.post(
        f"{srv.url}/ui/api/jobs/{anns}/resubmit", headers={"X-Hora-CSRF": csrf}
    )
    assert refused.status == 403
    # an admin may look at anyone's job, but the users page is theirs alone
    bob = sign_in(browser, srv, "bob")
    assert bob.request.get(srv.url + "/ui/api/users").status == 403
    expect(bob.locator("#nav-users")).to_be_hidden()
    bob.context.close()
    page.context.close()


def test_a_job_page_shows_its_preflight_and_scaling(
    browser: Browser, srv: ServiceServer, work: Path, shots: Path
) -> None:
    body = {"command": [sys.executable, str(work / "known_share.py")], "workers": 2,
            "name": "measured", "env": {"HOROVOD_TIMELINE": "known.json"}}
    with srv.client("ann") as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = int(r.json()["id"])
        done = wait_state(c, job, ("succeeded", "failed", "cancelled"), timeout=150)
    assert done["state"] == "succeeded", done
    page = sign_in(browser, srv, "ann")
    page.goto(srv.url + f"/ui#/job/{job}")
    expect(page.locator("#job-state")).to_have_text("succeeded")
    expect(page.locator("#job-preflight")).to_be_visible()
    expect(page.locator("#preflight-line")).to_contain_text("preflight (2 ranks, ")
    expect(page.locator("#preflight-line")).to_contain_text("SLOW: rank 1 (")
    expect(page.locator("#preflight-slow li").first).to_contain_text("rank 1 (")
    expect(page.locator("#preflight-failed")).to_have_count(0)
    expect(page.locator("#job-preflight")).not_to_contain_text("null")
    expect(page.locator("#transitions")).to_contain_text("SLOW: rank 1 (")  # the job's event
    expect(page.locator("#scaling-verdict")).to_contain_text("slowest rank 1 (compute: ")
    expect(page.locator("#scaling-verdict")).to_contain_text("estimated scaling efficiency")
    expect(page.locator("#scaling tbody tr")).to_have_count(2)
    expect(page.locator("#scaling")).to_contain_text("4.0 MiB")
    expect(page.locator("#scaling-bars .sbar")).to_have_count(2)
    expect(page.locator("#scaling-box")).to_contain_text("preflight busbw")
    page.screenshot(path=str(shots / "dashboard-job-preflight-scaling.png"), full_page=True)
    page.context.close()


def test_a_job_failed_by_the_preflight_threshold_names_the_rank(
    browser: Browser, work: Path, shots: Path, tmp_path: Path
) -> None:
    env = {"HORA_JOB_PREFLIGHT_FAIL_BELOW": "0.3", **baseline_env(tmp_path)}
    with ServiceServer(tmp_path, cpu_slots=2, env=env) as strict:
        body = {"command": [sys.executable, str(work / "known_share.py")], "workers": 2,
                "name": "refused"}
        with strict.client("ann") as c:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job = int(r.json()["id"])
            done = wait_state(c, job, ("succeeded", "failed", "cancelled"), timeout=150)
        assert done["state"] == "failed", done
        page = sign_in(browser, strict, "ann")
        page.goto(strict.url + f"/ui#/job/{job}")
        expect(page.locator("#job-state")).to_have_text("failed")
        expect(page.locator("#job-reason")).to_contain_text(
            "preflight: below 0.3 of the baseline: rank 1 ("
        )
        failed = page.locator("#preflight-failed")
        expect(failed).to_be_visible()
        expect(failed).to_contain_text("failed the job: preflight: below 0.3 of the baseline")
        expect(failed).to_contain_text("rank 1 (")
        expect(page.locator("#preflight-line")).to_contain_text("FAILED: threshold crossed")
        expect(page.locator("#preflight-slow li").first).to_contain_text("rank 1 (")
        page.screenshot(path=str(shots / "dashboard-job-preflight-failed.png"), full_page=True)
        page.context.close()
