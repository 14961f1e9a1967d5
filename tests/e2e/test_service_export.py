"""A job runs where and with what it was submitted (issue 25, Why 1 and 3; Deliver 1).

A real service whose own ``PATH`` is the system's (``/usr/bin:/bin``: its ``python3`` is
Debian's, and it has no ``python``) and a real ``hora`` CLI in a subprocess whose ``PATH``
and ``VIRTUAL_ENV`` are this test's activated venv, run from a subdirectory of the work root
(the README's quickstart, step 3, in miniature): the job's ``python`` is the venv's, it runs
in that subdirectory, and it imports ``hora``. ``--export NONE`` gives the service's
environment and default directory back; a submission from outside the work root runs in the
default one and says so, naming the setting. ``hora.Client`` from a subdirectory does the
same as the CLI. ``hora logs -f`` started after a retry has happened still shows the first
attempt's output and its ``retrying`` state (``--wait`` under load, Why 8).
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hora
import pytest
from helpers.service_server import ServiceServer, wait_state
from hora import jobs_cli
from hora.client import Client, Job

pytestmark = pytest.mark.timeout(240)

VENV = Path(sys.prefix)
SERVICE_PATH = "/usr/bin:/bin"
WHERE = """\
import os, sys
print("prefix", sys.prefix, flush=True)
print("cwd", os.getcwd(), flush=True)
try:
    import hora
    print("hora from", os.path.dirname(hora.__file__), flush=True)
except ImportError as e:
    print("no hora:", e, flush=True)
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    base = tmp_path_factory.mktemp("export")
    work = base / "work"
    (work / "proj" / "sub").mkdir(parents=True)
    (work / "proj" / "sub" / "where.py").write_text(WHERE)
    env = {"HORA_WORK_ROOT": str(work), "PATH": SERVICE_PATH, "HORA_JOB_ENV_PASSTHROUGH": ""}
    with ServiceServer(base, {"ann": False, "root": True}, cpu_slots=2, env=env) as server:
        yield server


def work_of(srv: ServiceServer) -> Path:
    return srv.data_dir.parent / "work"


def hora_in(srv: ServiceServer, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``hora`` CLI in a terminal at ``cwd`` where the venv was activated."""
    env = {
        "HOME": str(srv.data_dir.parent),
        "HORA_URL": srv.url,
        "HORA_TOKEN": srv.tokens["ann"],
        "HORA_CONFIG": str(srv.data_dir.parent / "no-config"),
        "PATH": f"{VENV / 'bin'}:{SERVICE_PATH}",
        "VIRTUAL_ENV": str(VENV),
    }
    return subprocess.run(
        [str(VENV / "bin" / "hora"), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_the_job_runs_in_the_submitting_directory_with_its_venv_s_python(
    srv: ServiceServer,
) -> None:
    sub = work_of(srv) / "proj" / "sub"
    out = hora_in(srv, sub, "submit", "--wait", "--workers", "2", "--name", "where", "--",
                  "python", "where.py")  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert f"prefix {VENV}\n" in out.stdout and f"cwd {sub}\n" in out.stdout, out.stdout
    assert f"hora from {Path(hora.__file__).parent}" in out.stdout, out.stdout
    assert "note:" not in out.stderr and "outside the work root" not in out.stderr, out.stderr


def test_export_none_runs_with_the_service_s_environment_in_the_default_directory(
    srv: ServiceServer,
) -> None:
    sub, work = work_of(srv) / "proj" / "sub", work_of(srv)
    out = hora_in(srv, sub, "submit", "--wait", "--export", "NONE", "--",
                  "python3", str(sub / "where.py"))  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "prefix /usr\n" in out.stdout and f"cwd {work}\n" in out.stdout, out.stdout
    # the service's PATH has no `python`: refused before it runs, naming the field
    out = hora_in(srv, sub, "submit", "--export", "NONE", "--", "python", "where.py")
    assert out.returncode == 1 and "command" in out.stderr, out.stderr
    assert "'python' is not found on the job's PATH (/usr/bin:/bin)" in out.stderr, out.stderr


def test_a_job_submitted_outside_the_work_root_runs_in_the_default_and_says_so(
    srv: ServiceServer,
) -> None:
    outside, work = srv.data_dir.parent, work_of(srv)
    script = str(work / "proj" / "sub" / "where.py")
    out = hora_in(srv, outside, "submit", "--", "python", script)
    assert out.returncode == 0, out.stderr
    note = out.stderr.strip()
    assert note.startswith("hora submit: note: submitted from ") and str(outside) in note, note
    assert f"outside the work root {work} (setting work_root, HORA_WORK_ROOT)" in note, note
    waited = hora_in(srv, outside, "submit", "--wait", "--", "python", script)
    assert waited.returncode == 0, waited.stderr
    assert f"cwd {work}\n" in waited.stdout and f"prefix {VENV}\n" in waited.stdout
    assert "queued: submitted from" in waited.stderr, waited.stderr  # among the states


def test_the_python_client_exports_its_own_python_and_directory(
    srv: ServiceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = work_of(srv) / "proj" / "sub"
    monkeypatch.chdir(sub)
    monkeypatch.setenv("PATH", SERVICE_PATH)  # a kernel started as .venv/bin/hora up
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    with Client(srv.url, srv.tokens["ann"]) as c:
        job = c.submit(["python", "where.py"], name="client")
        assert job.info is not None and job.info.spec.submit_dir == str(sub)
        assert job.wait(timeout=120).state.value == "succeeded"
        log = job.logs()
        none = c.submit(["python3", str(sub / "where.py")], export="NONE").wait(timeout=120)
        none_log = c.job(none.id).logs()
    assert f"prefix {VENV}\n" in log and f"cwd {sub}\n" in log, log
    assert "prefix /usr\n" in none_log and f"cwd {work_of(srv)}\n" in none_log, none_log


FLAKY = """\
import os, pathlib, sys, time
n = os.environ["HORA_RESTART_COUNT"]
print(f"attempt with restart count {n}", flush=True)
if n == "0":
    sys.exit(1)
while not pathlib.Path("go").exists():  # the second attempt waits for the test
    time.sleep(0.05)
"""


def test_following_after_a_retry_shows_every_attempt_and_state(srv: ServiceServer) -> None:
    """What ``hora submit --wait`` does, begun only once the first attempt has ended."""
    sub = work_of(srv) / "proj" / "sub"
    (sub / "flaky.py").write_text(FLAKY)
    with Client(srv.url, srv.tokens["ann"]) as c, srv.client("ann") as http:
        job = c.submit(["python", "flaky.py"], max_retries=1, working_dir="proj/sub")
        deadline = time.monotonic() + 120
        while (info := job.status()).attempt < 2 or info.state.value != "running":
            assert time.monotonic() < deadline and not info.state.terminal, info
            time.sleep(0.1)
        (sub / "go").touch()
        out, err = io.StringIO(), io.StringIO()
        final = jobs_cli.follow_job(Job(c, job.id), 0, out, err)
        assert wait_state(http, job.id, ("succeeded",))["attempt"] == 2
    assert final.state.value == "succeeded", err.getvalue()
    text = out.getvalue()
    assert text.index("restart count 0") < text.index("restart count 1"), text
    states = err.getvalue()
    assert states.index(": running") < states.index(": retrying") < states.rindex(": succeeded")
