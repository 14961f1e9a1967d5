"""A job's timeline is read as the job's account would read it, never as root (issue 25).

The third red-team round read, through ``HOROVOD_TIMELINE`` and the ``<path>.rank<R>.part``
files beside it, what the service (root) could and the job's account could not: another
user's 0600 trace in her 0700 directory, a root-only file outside the work root through a
``.part`` symlink, the same through a trace swapped for a symlink while it was read; a FIFO
named as the timeline froze the API for everyone after 48 requests; a part linked to
``/dev/zero`` would be read until memory ran out. Each is reproduced here against a real
``hora serve`` as root in multi-user mode, with OS accounts made by hora's own useradd path
(the fixtures of :mod:`test_service_isolation`); the jobs plant their files themselves, as
their own accounts, except the device node, which only root can make (a job could where it
has ``CAP_MKNOD``, in a container of its own).

Every refusal is an error of that job's request alone, naming the file and what it is; the
owner reading her own trace still sees it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_service_isolation as iso
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(300)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
SECRET = f"ROOT-SECRET-{secrets.token_hex(4)}"
ALICE = f"ALICE-SECRET-{secrets.token_hex(4)}"


def events(rank: int, name: str) -> str:
    """A timeline of one rank with one allreduce called ``name`` (JSON lines, as parts are)."""
    rows = [
        {"ph": "i", "pid": rank, "name": "TIMELINE_START", "ts": 0},
        {"ph": "X", "pid": rank, "tid": 1, "name": name, "ts": 10, "dur": 5,
         "args": {"tensor": "g", "bytes": 4096}},
        {"ph": "i", "pid": rank, "name": "TIMELINE_STOP", "ts": 100},
    ]  # fmt: skip
    return "".join(json.dumps(r) + ",\n" for r in rows)


@pytest.fixture
def secret_file(base: Path) -> Path:
    """A root-only file outside the work root that reads as a timeline."""
    where = base / "root-only"
    where.mkdir(mode=0o700)
    path = where / "secret.json"
    path.write_text(events(0, SECRET))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def service(base: Path, accounts: dict[str, int]) -> Iterator[ServiceServer]:
    iso.work_dir(base)
    with iso.serve(base, accounts) as srv:
        yield srv


def own(base: Path, user: str, name: str) -> str:
    """A file in ``user``'s own working directory (the default one, ``WORK_ROOT/<user>``)."""
    return str(base / "work" / user / name)


def run_job(c: httpx.Client, code: str, timeline: str, **body: Any) -> int:
    """A job of ``c``'s user that runs ``code`` in its own working directory, to its end."""
    job = iso.submit(c, command=[iso.JOB_PY, "-c", code], env={"HOROVOD_TIMELINE": timeline},
                     **body)  # fmt: skip
    done = wait_state(c, job, ("succeeded", "failed"), timeout=60)
    assert done["state"] == "succeeded", done
    return job


@contextlib.contextmanager
def page(srv: ServiceServer, user: str, timeout: float = 30) -> Iterator[httpx.Client]:
    """The dashboard's session of ``user`` (what its job page reads)."""
    with httpx.Client(base_url=srv.url, timeout=timeout) as web:
        assert web.post("/ui/login", json={"token": srv.tokens[user]}).status_code == 200
        yield web


def refused(srv: ServiceServer, user: str, job: int, *words: str) -> None:
    """Both readers refuse the job's timeline, naming why, and show nothing of it."""
    with srv.client(user) as c, page(srv, user) as web:
        r = c.get(f"/v1/jobs/{job}/scaling")
        shown = web.get(f"/ui/api/jobs/{job}/timeline")
    assert SECRET not in shown.text and ALICE not in shown.text, f"leaked: {shown.text[:300]}"
    assert r.status_code == 409, r.text
    assert shown.status_code == 200 and shown.json()["events"] == [], shown.text
    for text in (r.json()["detail"], shown.json()["error"]):
        assert "the service did not read it" in text and all(w in text for w in words), text


def test_another_users_private_trace_is_not_read_for_bob(
    base: Path, accounts: dict[str, int]
) -> None:
    alice, bob = accounts
    write = f"open('trace.json', 'w').write({events(0, ALICE)!r})"
    with service(base, accounts) as srv, srv.client(alice) as a, srv.client(bob) as b:
        trace = own(base, alice, "trace.json")
        mine = run_job(a, write, trace)  # in her own directory (0700), umask 077
        assert stat.S_IMODE(os.stat(trace).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(Path(trace).parent).st_mode) == 0o700
        for given in (trace, f"../{alice}/trace.json"):  # absolute; relative to his directory
            theirs = run_job(b, "pass", given)
            refused(srv, bob, theirs, f"/{alice}", "cannot enter")
        with page(srv, alice) as web:  # she reads her own, as her account may
            shown = web.get(f"/ui/api/jobs/{mine}/timeline").json()
        assert [e["name"] for e in shown["events"]] == [ALICE], shown
        assert a.get(f"/v1/jobs/{mine}/scaling").status_code == 200


def test_a_part_or_trace_linked_to_a_root_only_file_is_not_followed(
    base: Path, accounts: dict[str, int], secret_file: Path
) -> None:
    bob = list(accounts)[1]
    plant = (
        f"import os\nopen('trace.json', 'w').write({events(0, 'MINE')!r})\n"
        f"os.symlink({str(secret_file)!r}, 'trace.json.rank0.part')\n"
        f"os.symlink({str(secret_file)!r}, 'link.json')\n"
    )
    with service(base, accounts) as srv, srv.client(bob) as b:
        part = run_job(b, plant, own(base, bob, "trace.json"))
        refused(srv, bob, part, "trace.json.rank0.part", "symbolic link")
        linked = run_job(b, "pass", own(base, bob, "link.json"))
        refused(srv, bob, linked, "link.json", "symbolic link")


# swaps trace.json and its part, each in one step, between its own files (both at once for a
# moment) and symlinks to the secret, as fast as it can, until the test says stop
SWAPPER = """\
import os, sys, time
secret, mine = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 120
open("started", "w").close()
while not os.path.exists("stop") and time.monotonic() < deadline:
    for name in ("trace.json", "trace.json.rank0.part"):
        with open(name + ".tmp", "w") as f:
            f.write(mine)
        os.replace(name + ".tmp", name)
    for name in ("trace.json", "trace.json.rank0.part"):
        os.symlink(secret, name + ".lnk")
        os.replace(name + ".lnk", name)
"""


def test_a_trace_swapped_for_a_symlink_while_it_is_read_never_leaks(
    base: Path, accounts: dict[str, int], secret_file: Path
) -> None:
    bob = list(accounts)[1]
    with service(base, accounts) as srv, srv.client(bob) as b, page(srv, bob) as web:
        home = base / "work" / bob
        body = {"command": [iso.JOB_PY, "-c", SWAPPER, str(secret_file), events(0, "MINE")],
                "env": {"HOROVOD_TIMELINE": str(home / "trace.json")}}  # fmt: skip
        job = iso.submit(b, **body)
        deadline = time.monotonic() + 60
        while not (home / "started").exists():
            assert time.monotonic() < deadline, "the swapping job never started"
            time.sleep(0.05)
        answers = [web.get(f"/ui/api/jobs/{job}/timeline") for _ in range(200)]
        (home / "stop").touch()
        wait_state(b, job, ("succeeded", "failed"), timeout=60)
    leaked = [r.text for r in answers if SECRET in r.text]
    assert not leaked, f"{len(leaked)} of {len(answers)} answers held the secret: {leaked[0]}"
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers][:3]
    read = [r.json() for r in answers if r.json()["events"]]
    assert read and all({e["name"] for e in x["events"]} == {"MINE"} for x in read), read[:3]
    assert any("symbolic link" in r.json().get("error", "") for r in answers)


def test_a_fifo_named_as_the_timeline_blocks_no_one(base: Path, accounts: dict[str, int]) -> None:
    alice, bob = accounts
    fifo = "import os\nos.mkfifo('trace.json')\nos.mkfifo('trace.json.rank0.part')\n"
    with service(base, accounts) as srv, srv.client(bob, timeout=15) as b:
        where = base / "work" / bob / "trace.json"
        job = run_job(b, fifo, str(where))
        try:
            with concurrent.futures.ThreadPoolExecutor(48) as pool:
                asks = [pool.submit(b.get, f"/v1/jobs/{job}/scaling") for _ in range(48)]
                got = [f.exception() or f.result() for f in asks]
            with srv.client(alice, timeout=15) as a:  # everyone else is answered at once
                assert len(a.get("/v1/gpus").json()) == 2
                assert "hora_jobs" in a.get("/metrics").text
                assert a.get("/v1/jobs").status_code == 200
                assert iso.submit(a, command=[iso.JOB_PY, "-c", "pass"]) > job
        finally:
            _release(where)
    hung = [g for g in got if isinstance(g, Exception)]
    assert not hung, f"{len(hung)} of 48 requests never answered: {hung[0]!r}"
    details = {g.json()["detail"] for g in got if isinstance(g, httpx.Response)}
    assert {g.status_code for g in got if isinstance(g, httpx.Response)} == {409}
    assert details == {f"{where} is a named pipe (FIFO); the service did not read it"}, details


def _release(fifo: Path) -> None:
    """Open the FIFO for writing until no reader waits on it (what freed the old service)."""
    for _ in range(100):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody reads it
            return
        os.close(fd)
        time.sleep(0.05)


def test_a_device_a_link_to_dev_zero_or_an_oversized_timeline_is_refused(
    base: Path, accounts: dict[str, int]
) -> None:
    bob = list(accounts)[1]
    plant = (
        f"import os\nopen('trace.json', 'w').write({events(0, 'MINE')!r})\n"
        "os.symlink('/dev/zero', 'trace.json.rank0.part')\n"
        "with open('big.json', 'wb') as f:\n    f.truncate(64 << 20)\n"
    )
    with service(base, accounts) as srv, srv.client(bob) as b:
        zero = run_job(b, plant, own(base, bob, "trace.json"))
        refused(srv, bob, zero, "trace.json.rank0.part", "symbolic link")
        big = run_job(b, "pass", own(base, bob, "big.json"))
        refused(srv, bob, big, "big.json", "larger than")
        # /dev/zero's own node, owned by the job's account
        node = base / "work" / bob / "zero.json"
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        os.chown(node, accounts[bob], -1)
        dev = run_job(b, "pass", str(node))
        refused(srv, bob, dev, "zero.json", "a character device")
        # a root-owned file in his own directory is not his
        theirs = base / "work" / bob / "root.json"
        theirs.write_text(events(0, SECRET))
        planted = run_job(b, "pass", str(theirs))
        refused(srv, bob, planted, "root.json", "uid 0")
