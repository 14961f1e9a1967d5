"""hora as a JupyterHub service, for real: a team's hub, its proxy, PAM accounts, a browser.

A real ``jupyterhub`` (PAM authentication of fresh OS accounts whose passwords the test sets,
``LocalProcessSpawner``, the real ``configurable-http-proxy``) has a real ``hora serve
--hub`` (multi-user mode, as root) as its service ``hora`` at ``/services/hora/``, configured
by ``hora_service.hub.configure``. Debian's Chromium, through Playwright:

* alice signs in to the hub; her JupyterLab spawns as her account; a notebook with no set-up
  runs ``%dist_start -n 2`` and a ``%%distributed`` cell through the service: the engines run
  as alice's account; an interrupt of her kernel through the hub reaches them (her kernel
  signals them: the same account), and they stay usable; she opens the dashboard through the
  hub (OAuth) and sees her session;
* bob signs in and sees neither her session nor its logs (404, like a session that does not
  exist); his account cannot read her server's token, neither from her kernel's environment
  nor from any file it can open (her home, the hub's and hora's directories, /tmp, /dev/shm);
  her dashboard cookie is no use in his browser; he submits a job with a hub token of his;
  carol, a hub admin but no hora admin, gets no admin rights in hora (until hora is told
  ``HORA_HUB_ADMINS=1``, at the end);
* the hub's real idle culler (``jupyterhub-idle-culler``) culls alice's server: its kernel
  shuts down cleanly (SIGINT reaches a server that has ``hora.server_extension``) and parks
  the session (``HORA_PARK_ON_EXIT``, set by ``configure``), which frees her slots long
  before its lease could; bob's job runs on, untouched; her server's token stops working in
  hora.

Screenshots go to ``HORA_SCREENSHOT_DIR`` when set. Needs root (CI runs it as root).
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import nbformat
import psutil
import pytest
from helpers.hub import Account, Hub, Kernel, accounts, user_python
from helpers.service_server import ServiceServer
from playwright.sync_api import BrowserContext, Page, sync_playwright
from test_notebooks_jupyterlab import (
    CHROMIUM,
    CHROMIUM_ARGS,
    SCREENSHOT_DIR_VAR,
    _outputs_text,
    _wait_for_run,
    _wait_kernel_idle,
)

pytestmark = pytest.mark.timeout(900)

CELLS = [
    "%dist_start -n 2 --start-timeout 300",  # a loaded machine: torch imports slowly
    "%%distributed\nimport getpass, os\n"
    "who = hvd.allgather_object(f'{getpass.getuser()}:{os.getuid()}')\n"
    "print('engines run as', sorted(set(who)), 'on', hvd.size(), 'ranks')",
]
BOBS_JOB = [
    "/usr/bin/python3",
    "-c",
    'import time; print("bob\'s job", flush=True); time.sleep(900)',
]
# run as bob: every file he can open under ROOTS (in /tmp, /var/tmp and /dev/shm: only what
# alice owns there) is searched for alice's token; prints FOUND <path> for each one holding it
FIND_TOKEN = """\
import os, stat
token, roots, uid, shared = {token!r}.encode(), {roots!r}, {uid}, ("/tmp", "/var/tmp", "/dev/shm")
def search(path, depth):
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and depth < 12:
        try:
            names = os.listdir(path)
        except OSError:
            return
        for name in names:
            full = os.path.join(path, name)
            try:
                if path in shared and os.lstat(full).st_uid != uid:
                    continue
            except OSError:
                continue
            search(full, depth + 1)
    elif stat.S_ISREG(st.st_mode) and st.st_size < 64 << 20:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        with os.fdopen(fd, "rb") as f:
            if token in f.read():
                print("FOUND", path)
for root in roots:
    search(root, 0)
print("searched")
"""
LAB_SETTINGS = {  # no news toast; every cell in the DOM (for the screenshot)
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}',
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
}


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
    return value


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the hub test signs in OS accounts through PAM and needs root (CI runs it so)")
    where = Path(tempfile.mkdtemp(prefix="hora-hub-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def team(base: Path) -> Iterator[dict[str, Account]]:
    with accounts(["alice", "bob", "carol"]) as made:
        for who in made.values():
            home = Path(pwd_home(who))
            for rel, text in LAB_SETTINGS.items():
                path = home / ".jupyter" / "lab" / "user-settings" / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            subprocess.run(["chown", "-R", f"{who.name}:", str(home)], check=True)
        yield made


def pwd_home(who: Account) -> str:
    return pwd.getpwnam(who.name).pw_dir


@pytest.fixture(scope="module")
def stack(base: Path, team: dict[str, Account]) -> Iterator[tuple[ServiceServer, Hub]]:
    """hora serve --hub (as root, multi-user), then the hub that proxies it."""
    python = user_python(base)
    token = secrets.token_hex(32)
    (base / "work").mkdir(mode=0o755)
    tag = os.environ.get("HORA_TEST_TAG", secrets.token_hex(8))
    hub = Hub(base, team, ["carol"], token, python, tag)
    env = {
        "HORA_HUB": "1", "HORA_HUB_API_URL": hub.api_url, "HORA_HUB_API_TOKEN": token,
        "HORA_HUB_CACHE_S": "1", "HORA_USER_MODE": "multi", "HORA_WORK_ROOT": str(base / "work"),
        "HORA_SESSION_PYTHON": str(python), "HORA_SESSION_LEASE_S": "300",
        "HOME": str(base), "HORA_TEST_TAG": tag,
    }  # fmt: skip
    srv = ServiceServer(base / "hora", {"root": True}, 3, env).start()  # alice 2, bob 1
    try:
        hub.hora_url = srv.url
        with hub:
            yield srv, hub
    finally:
        srv.cancel_all()
        srv.stop()
        srv.assert_nothing_left()


SHOTS: list[Path] = []  # where screenshots go: HORA_SCREENSHOT_DIR, else the test's tmp


@pytest.fixture(autouse=True)
def screenshots(tmp_path: Path) -> None:
    SHOTS[:] = [Path(os.environ.get(SCREENSHOT_DIR_VAR) or tmp_path)]


def shot(page: Page, name: str) -> None:
    SHOTS[0].mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS[0] / f"hub-{name}.png"), full_page=True)


def sign_in(ctx: BrowserContext, hub: Hub, who: Account, next_url: str | None = None) -> Page:
    page = ctx.new_page()
    page.set_default_timeout(120_000)
    query = f"?next={next_url}" if next_url else ""
    page.goto(f"{hub.url}/hub/login{query}")
    page.fill("#username_input", who.name)
    page.fill("#password_input", who.password)
    page.click("#login_submit")
    return page


def get_json(ctx: BrowserContext, url: str) -> tuple[int, Any]:
    r = ctx.request.get(url)
    try:
        return r.status, r.json()
    except ValueError:
        return r.status, r.text()


def write_notebook(who: Account) -> str:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "hora", "display_name": "Python 3 (hora)"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    path = Path(pwd_home(who)) / "team.ipynb"
    nbformat.write(nb, path)
    os.chown(path, who.uid, who.uid)
    return path.name


def run_notebook(page: Page, hub: Hub, who: Account) -> str:
    name = write_notebook(who)
    page.goto(f"{hub.url}/user/{who.name}/lab/tree/{name}")
    try:
        page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
    except Exception:
        shot(page, "alice-failed")
        raise AssertionError(f"no notebook; the hub's log ends:\n{hub.output()}") from None
    _wait_kernel_idle(page)
    page.locator(".jp-StatusBar-Widget", has_text="Python 3 (hora) | Idle").first.wait_for()
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    _wait_for_run(page, timeout=420)
    shot(page, "alice-notebook")
    return _outputs_text(page)


def sessions_story(srv: ServiceServer) -> str:
    """The service's sessions and their engines' logs (for a failure's message)."""
    lines = []
    with srv.client("root") as c:
        for job in c.get("/v1/jobs").json()["items"]:
            lines.append(f"{job['id']} {job['user']} {job['state']} {job['reason']}")
            for rank in range(job["spec"]["workers"]):
                got = c.get(f"/v1/jobs/{job['id']}/logs", params={"rank": rank})
                lines.append(f"  rank {rank}: {got.text[-1500:]}")
    return "\n".join(lines) + "\n" + srv.output()[-3000:]


def engines_of(srv: ServiceServer) -> list[psutil.Process]:
    found = []
    for pid in srv.descendants():
        try:
            proc = psutil.Process(pid)
            if "session-engine" in proc.cmdline():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kernel_of(who: Account) -> psutil.Process:
    for proc in psutil.process_iter(["uids", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["uids"] and proc.info["uids"].real == who.uid and "ipykernel_launcher" in cmd:
            return proc
    raise AssertionError(f"no kernel of {who.name} is running")


def as_account(who: Account, code: str) -> str:
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", code], user=who.uid, group=who.uid,
                          extra_groups=[], capture_output=True, text=True, timeout=120)  # fmt: skip
    return done.stdout + done.stderr


def test_a_team_on_the_hub(stack: tuple[ServiceServer, Hub], team: dict[str, Account]) -> None:
    srv, hub = stack
    alice, bob, carol = team["alice"], team["bob"], team["carol"]
    ui = f"{hub.url}/services/hora/ui"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            # alice: sign in, her server spawns, the notebook gets engines with no set-up
            actx = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = sign_in(actx, hub, alice)
            page.wait_for_url(f"**/user/{alice.name}/lab**", timeout=180_000)
            text = run_notebook(page, hub, alice)
            ran = f"engines run as ['{alice.name}:{alice.uid}'] on 2 ranks"
            assert ran in text, f"{text}\n{sessions_story(srv)}"
            assert f"from the hora service at {hub.url}/services/hora" in text, text
            engines = engines_of(srv)
            assert len(engines) == 2 and {p.uids().real for p in engines} == {alice.uid}
            kernel = kernel_of(alice)
            assert kernel.uids().real == alice.uid
            with pytest.raises(KeyError):  # her own account, no hora-NAME beside it
                pwd.getpwnam(f"hora-{alice.name}")
            interrupt_through_the_hub(hub, alice)

            # her dashboard, through the hub's proxy, signed in through the hub's OAuth
            board = actx.new_page()
            board.goto(f"{ui}/#/sessions")
            board.locator("#who", has_text=alice.name).wait_for()
            status, sessions = get_json(actx, f"{ui}/api/sessions")
            assert status == 200 and len(sessions) == 1, sessions
            sid = sessions[0]["id"]
            assert sessions[0]["state"] == "running" and sessions[0]["user"] == alice.name
            board.locator("main", has_text=f"{sid}").first.wait_for()
            shot(board, "alice-dashboard")
            status, logs = get_json(actx, f"{ui}/api/jobs/{sid}/logs?rank=0")
            assert status == 200, logs
            alice_cookie = next(c for c in actx.cookies() if c["name"] == "hora_ui")
            assert alice_cookie["path"] == "/services/hora/ui" and alice_cookie["httpOnly"]

            # her server's token works in hora as her, and only her
            token = kernel_environ(kernel)["HORA_TOKEN"]
            mine = httpx.get(f"{srv.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
            assert mine.status_code == 200, mine.text
            assert {j["user"] for j in mine.json()["items"]} == {alice.name}

            # bob: nothing of hers, not her token, not her cookie
            bctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            bpage = sign_in(bctx, hub, bob, "/services/hora/ui/")
            bpage.wait_for_url("**/services/hora/ui/**")
            bpage.locator("#who", has_text=bob.name).wait_for()
            bpage.goto(f"{ui}/#/sessions")
            assert get_json(bctx, f"{ui}/api/sessions") == (200, [])
            assert get_json(bctx, f"{ui}/api/jobs/{sid}")[0] == 404
            assert get_json(bctx, f"{ui}/api/jobs/{sid}/logs?rank=0")[0] == 404
            status, jobs = get_json(bctx, f"{ui}/api/jobs?user={alice.name}")
            assert status == 200 and jobs["items"] == [], jobs
            shot(bpage, "bob-dashboard")
            leak = as_account(bob, f"print(open('/proc/{kernel.pid}/environ').read())")
            assert "PermissionError" in leak and token not in leak, leak
            roots = [pwd_home(alice), str(hub.base), "/tmp", "/var/tmp", "/dev/shm"]
            found = as_account(bob, FIND_TOKEN.format(token=token, roots=roots, uid=alice.uid))
            assert found.strip().endswith("searched") and "FOUND" not in found, found
            bctx.add_cookies([{**alice_cookie}])  # her dashboard cookie, beside his hub login
            assert get_json(bctx, f"{ui}/api/me")[0] == 401

            # carol: the hub's admin, not hora's
            cctx = browser.new_context()
            cpage = sign_in(cctx, hub, carol, "/services/hora/ui/")
            cpage.wait_for_url("**/services/hora/ui/**")
            status, me = get_json(cctx, f"{ui}/api/me")
            assert status == 200 and me["user"] == carol.name and me["is_admin"] is False, me
            assert get_json(cctx, f"{ui}/api/users")[0] == 403
            assert get_json(cctx, f"{ui}/api/jobs/{sid}")[0] == 404
            for ctx in (actx, bctx, cctx):
                ctx.close()
        finally:
            browser.close()

    bobs = api_checks(srv, hub, bob, sid)
    cull_and_check(srv, hub, alice, sid, token, engines)
    with srv.client("root") as c:  # bob's job ran on through alice's cull
        job = c.get(f"/v1/jobs/{bobs}").json()
        assert (job["user"], job["state"]) == (bob.name, "running"), job
        assert c.get(f"/v1/jobs/{bobs}/logs", params={"rank": 0}).text == "bob's job\n"
        assert c.post(f"/v1/jobs/{bobs}/cancel").status_code == 200
    hub_admins_when_asked(srv, hub, carol)


# 'started' inside the try: the interrupt, sent once both lines arrived, can land while the
# flushing print still waits for the IO thread
SLEEPS = (
    "%%distributed --all\nimport time\n"
    "try:\n    print('started', flush=True)\n    time.sleep(300)\n"
    "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    raise"
)


def interrupt_through_the_hub(hub: Hub, alice: Account) -> None:
    """Her notebook's kernel, interrupted through the hub (REST, as JupyterLab's button does),
    interrupts her engines, as under ``hora up``; they keep her session and stay usable."""
    scopes = [f"access:servers!user={alice.name}"]
    minted = hub.api("POST", f"/users/{alice.name}/tokens", json={"scopes": scopes})
    assert minted.status_code == 201, minted.text
    server, token = f"{hub.url}/user/{alice.name}/", str(minted.json()["token"])
    listed = httpx.get(f"{server}api/kernels", headers={"Authorization": f"token {token}"})
    (kernel_id,) = [k["id"] for k in listed.json()]
    kernel = Kernel(server, token, kernel_id, timeout=120)
    sent: list[bool] = []

    def on_output(text: str) -> None:
        if not sent and "[rank 0] started" in text and "[rank 1] started" in text:
            sent.append(True)
            kernel.interrupt()

    try:
        out = kernel.run(SLEEPS, on_output)
        assert "EnginesInterrupted: interrupted on ranks 0-1" in out, out
        assert "[rank 0] interrupted" in out and "[rank 1] interrupted" in out, out
        assert kernel.run("%%distributed\nprint(hvd.size())").strip() == "2"
    finally:
        kernel.close()


def api_checks(srv: ServiceServer, hub: Hub, bob: Account, sid: int) -> int:
    """The API through the hub: a hub token of bob's sees none of alice's; one without
    hora's scope is refused; a sign-in this browser did not start is refused.

    Returns:
        The id of a job bob submits with his hub token (it runs until cancelled).
    """

    def token_of(who: Account, scopes: list[str]) -> str:
        made = hub.api("POST", f"/users/{who.name}/tokens", json={"scopes": scopes})
        assert made.status_code == 201, made.text
        return str(made.json()["token"])

    api = f"{hub.url}/services/hora"  # through the hub's proxy
    his = {"Authorization": f"Bearer {token_of(bob, ['access:services!service=hora'])}"}
    assert httpx.get(f"{api}/v1/jobs/{sid}", headers=his).status_code == 404
    assert httpx.get(f"{api}/v1/jobs", headers=his).json()["items"] == []
    other = token_of(bob, [f"read:users:name!user={bob.name}"])
    refused = httpx.get(f"{api}/v1/jobs", headers={"Authorization": f"Bearer {other}"})
    assert refused.status_code == 401, refused.text
    forged = httpx.get(f"{api}/oauth_callback", params={"code": "c", "state": "s"})
    assert forged.status_code == 403 and "not started by this browser" in forged.text
    made = httpx.post(f"{api}/v1/jobs", headers=his, json={"command": BOBS_JOB})
    assert made.status_code == 201, made.text
    job = int(made.json()["id"])
    with srv.client("root") as c:
        wait_for("bob's job to run", lambda: c.get(f"/v1/jobs/{job}/logs", params={"rank": 0})
                 .text == "bob's job\n", 120)  # fmt: skip
        assert c.get(f"/v1/jobs/{job}").json()["user"] == bob.name
    return job


def hub_admins_when_asked(srv: ServiceServer, hub: Hub, carol: Account) -> None:
    """With HORA_HUB_ADMINS=1 the hub's admin carol is a hora admin; bob-like users are not."""
    srv.stop()
    srv.env["HORA_HUB_ADMINS"] = "1"
    srv.start()
    with closing(hub.browser_session(carol, "/services/hora/ui/")) as c:
        me = c.get("/services/hora/ui/api/me").json()
        assert me["user"] == carol.name and me["is_admin"] is True, me
        users = c.get("/services/hora/ui/api/users")
        assert users.status_code == 200 and carol.name in users.text, users.text


def kernel_environ(kernel: psutil.Process) -> dict[str, str]:
    return dict(kernel.environ())


def cull_and_check(
    srv: ServiceServer,
    hub: Hub,
    alice: Account,
    sid: int,
    token: str,
    engines: list[psutil.Process],
) -> None:
    """The hub's idle culler culls alice's server: her session is parked, her slots free."""
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": hub.culler_token}
    culler = subprocess.Popen(
        [sys.executable, "-m", "jupyterhub_idle_culler", f"--url={hub.url}/hub/api",
         "--timeout=5", "--cull-every=2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for("the culler to stop alice's server", lambda: hub.server(alice) is None, 120)
    finally:
        culler.terminate()
        culler.wait(timeout=30)
    with srv.client("root") as c:
        session = wait_for(
            "alice's session to be parked",
            lambda: (j := c.get(f"/v1/sessions/{sid}").json())["state"] != "running" and j,
        )
        # parked by her kernel as it shut down (not ended by its lease, 300 s)
        assert session["state"] == "parked", session
        assert "kernel exited" in session["reason"] and session["park"]["world"] == 2, session

        def free() -> list[dict[str, Any]] | None:  # of hers (bob's job holds one)
            slots = c.get("/v1/gpus").json()
            held = [x for x in slots if x["kind"] != "parked" and x["job_id"] == sid]
            return None if held else slots

        slots = wait_for("her slots to be free", free)
        assert [x["job_id"] for x in slots if x["kind"] == "parked"] == [sid], slots
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in engines)
    time.sleep(2)  # hub_cache_s = 1: the hub revoked her server's token when it stopped
    gone = httpx.get(f"{srv.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert gone.status_code == 401, gone.text
