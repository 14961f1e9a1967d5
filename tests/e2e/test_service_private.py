"""Private by default, and bounded (issue 16, items 3 and 5): homes, working directories,
umask, checks before a job starts, and memory and pids limits per attempt.

A real ``hora serve`` runs as root in multi-user mode with the local runtime; its two users
are made by the real ``hora user add`` (fresh OS accounts ``hora-...``, removed afterwards),
and one of them gets a memory limit of their own with ``hora user set``. The work root is
root's and not writable by the job accounts, as on a real machine. Each reproduction of the
issue is a test: another user's home, default working directory and the files jobs write
there; ``working_dir`` into a directory only another account may reach; a program the job's
account cannot execute; a job forking past its pids limit; one allocating past its memory
limit; a user filling their disk limit (their working directory is a loop-mounted file
system); and the digits example saving its checkpoint in its working directory with no
``working_dir`` given.

These tests need root (CI runs as root); without it they fail and say so.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.checkout import require_reachable
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# the job accounts cannot run the test's own interpreter: it lives under /root
JOB_PY = "/usr/bin/python3"
# ... but they can import this checkout's packages (torch, sklearn, hora) from the venv
JOB_PATH = f"{Path(torch.__file__).parents[1]}:{ROOT / 'kernels'}"
PIDS_LIMIT = 1000
OWN_MEMORY = "256m"  # bob's own limit (hora user set); the service's default is 2g
DONE = ("succeeded", "failed", "cancelled")
DISK = "64m"  # each user's working directory: a file system of this size

PROBE = """\
import json, os, sys
for name, path in json.loads(sys.argv[1]).items():
    try:
        got = os.listdir(path) if os.path.isdir(path) else open(path).read()
    except OSError as e:
        print("blocked", name, type(e).__name__, flush=True)
    else:
        print("LEAK", name, repr(got)[:100], flush=True)
"""

WRITE_OUTPUT = """\
import os, sys
open("out.txt", "w").write(sys.argv[1])
print("cwd", os.getcwd(), "umask", oct(os.umask(0)), flush=True)
"""

FORKS = """\
import os, time
n = 0
try:
    while n < 1500:
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "60"])
        n += 1
except OSError as e:
    print(f"fork failed after {n} processes: {e}", flush=True)
    raise SystemExit(1)
print(f"forked {n} processes", flush=True)
"""

ALLOCATE = """\
chunks = []
for i in range(16):  # 1 GiB in 64 MiB steps, every page written
    chunks.append(b"x" * (64 << 20))
    print(f"holding {(i + 1) * 64} MiB", flush=True)
"""


@dataclass
class World:
    srv: ServiceServer
    base: Path
    work: Path
    ann: str
    bob: str
    accounts: dict[str, pwd.struct_passwd]

    def client(self, user: str) -> httpx.Client:
        return self.srv.client(user)


def hora_user(data_dir: Path, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
    env.update(HORA_USER_MODE="multi", HORA_WORK_ROOT=str(work), HORA_USER_DISK_LIMIT=DISK)
    return subprocess.run(
        [sys.executable, "-m", "hora.cli", "user", *args, "--data-dir", str(data_dir)],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.fail("these tests run jobs as other OS accounts and need root (CI runs as root)")
    require_reachable()
    base = Path(tempfile.mkdtemp(prefix="hora-private-"))
    base.chmod(0o755)
    work = base / "work"
    work.mkdir(mode=0o755)  # root's: the job accounts cannot write in it
    names = [f"pv{secrets.token_hex(3)}{who}" for who in "ab"]
    env = {
        "HORA_USER_MODE": "multi",
        "HORA_WORK_ROOT": str(work),
        "HORA_JOB_ENV_PASSTHROUGH": "",
        "HORA_JOB_PIDS_LIMIT": str(PIDS_LIMIT),
        "HORA_JOB_MEMORY_LIMIT": "2g",
        "HORA_KILL_GRACE_S": "1",
        "HORA_USER_DISK_LIMIT": DISK,
    }
    srv = ServiceServer(base, users={"root": True}, cpu_slots=2, env=env)
    made: list[str] = []
    try:
        for name in names:
            done = hora_user(srv.data_dir, work, "add", name)
            assert done.returncode == 0, done.stderr
            made.append(name)
            srv.tokens[name] = done.stdout.strip()
        limited = hora_user(srv.data_dir, work, "set", names[1], "--memory", OWN_MEMORY)
        assert limited.returncode == 0, limited.stderr
        accounts = {n: pwd.getpwnam(f"hora-{n}") for n in names}
        # what an older hora left: a home any account could list
        Path(accounts[names[0]].pw_dir).chmod(0o755)
        with srv:
            yield World(srv, base, work, names[0], names[1], accounts)
    finally:
        for name in made:
            subprocess.run(["umount", str(work / name)], capture_output=True)
            subprocess.run(["userdel", "--remove", "--force", f"hora-{name}"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def submit(c: httpx.Client, **body: Any) -> int:
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def run(c: httpx.Client, timeout: float = 120, **body: Any) -> tuple[dict[str, Any], str]:
    job_id = submit(c, **body)
    job = wait_state(c, job_id, DONE, timeout=timeout)
    return job, c.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text


def refused(c: httpx.Client, **body: Any) -> tuple[str, str]:
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    return str(detail["loc"][-1]), str(detail["msg"])


def test_homes_and_working_directories_are_private(world: World) -> None:
    ann, bob = world.accounts[world.ann], world.accounts[world.bob]
    home = Path(ann.pw_dir)
    # an account hora made is 0700 again once the service started, as new ones are
    assert (home.stat().st_mode & 0o777, Path(bob.pw_dir).stat().st_mode & 0o777) == (0o700,) * 2
    secret = home / "secret.txt"
    secret.write_text("ann's secret")
    os.chown(secret, ann.pw_uid, ann.pw_gid)
    own = world.work / world.ann
    st = own.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (ann.pw_uid, 0o700)
    with world.client(world.ann) as a, world.client(world.bob) as b:
        job, log = run(a, command=[JOB_PY, "-c", WRITE_OUTPUT, "ann's output"])
        assert job["state"] == "succeeded", (job, log)
        # no working_dir: the user's own directory; files there are the account's alone
        assert f"cwd {own} umask 0o77" in log, log
        out = own / "out.txt"
        assert (out.stat().st_uid, out.stat().st_mode & 0o777) == (ann.pw_uid, 0o600)
        targets = {"home": home, "secret": secret, "workdir": own, "output": out}
        targets = {k: str(v) for k, v in targets.items()}
        job, log = run(b, command=[JOB_PY, "-c", PROBE, json.dumps(targets)], working_dir=".")
        assert "LEAK" not in log, log
        assert {ln.split()[1] for ln in log.splitlines() if ln.startswith("blocked")} == set(
            targets
        ), log


def test_working_dir_only_another_account_reaches_is_a_422(world: World) -> None:
    ann = world.accounts[world.ann]
    apriv = world.work / "apriv"
    (apriv / "proj").mkdir(parents=True)
    (apriv / "proj" / "data.txt").write_text("ann's data")
    for p in (apriv, apriv / "proj", apriv / "proj" / "data.txt"):
        os.chown(p, ann.pw_uid, ann.pw_gid)
    apriv.chmod(0o700)
    (apriv / "proj").chmod(0o755)
    with world.client(world.ann) as a, world.client(world.bob) as b:
        read = [JOB_PY, "-c", "print(open('data.txt').read())"]
        field, msg = refused(b, command=read, working_dir="apriv/proj")
        assert field == "working_dir" and str(apriv / "proj") in msg, msg
        assert "Permission denied" in msg and f"hora-{world.bob}" in msg, msg
        job, log = run(a, command=read, working_dir="apriv/proj")  # its owner gets in
        assert job["state"] == "succeeded" and "ann's data" in log, (job, log)
        # a check that passed for ann a moment ago is not bob's (checks are per account)
        ann_job = submit(a, command=read, working_dir="apriv/proj")
        field, msg = refused(b, command=read, working_dir="apriv/proj")
        assert field == "working_dir" and f"hora-{world.bob}" in msg, msg
        assert wait_state(a, ann_job, DONE)["state"] == "succeeded"


def test_a_program_the_account_cannot_execute_is_refused_naming_it(world: World) -> None:
    tools = world.base / "tools"
    tools.mkdir(mode=0o755)
    prog = tools / "prog"
    prog.write_text("#!/bin/sh\necho ran\n")
    prog.chmod(0o755)
    with world.client(world.bob) as b:
        # the service's own interpreter lives under /root: a bare "exit code 127" before
        field, msg = refused(b, command=[sys.executable, "-c", "pass"])
        assert field == "command" and sys.executable in msg, msg
        field, msg = refused(b, command=["no-such-program-hora", "x"])
        assert field == "command" and "not found on the job's PATH" in msg, msg
        # a program that becomes unreachable while the job waits fails at once, at launch
        # in bob's working directory: the job's /tmp is its own, the rest of the host's unseen
        release = world.work / world.bob / "release"
        hold = [JOB_PY, "-c", f"import os, time\nwhile not os.path.exists({str(release)!r}): "
                "time.sleep(0.05)"]  # fmt: skip
        blocker = submit(b, command=hold, workers=2, working_dir=".")
        wait_state(b, blocker, ("running",))
        waiting = submit(b, command=[str(prog)], working_dir=".")
        tools.chmod(0o700)
        release.touch()
        job = wait_state(b, waiting, DONE)
        assert job["state"] == "failed" and job["attempt"] == 1, job
        assert "command" in job["reason"] and str(prog) in job["reason"], job
        assert wait_state(b, blocker, DONE)["state"] == "succeeded"


def test_a_job_forking_past_its_pids_limit_is_stopped_with_the_reason(world: World) -> None:
    with world.client(world.ann) as a:
        job, log = run(a, command=[JOB_PY, "-c", FORKS])
    assert job["state"] == "failed", (job, log)
    assert "fork failed after" in log and "Resource temporarily unavailable" in log, log
    n = int(log.split("fork failed after ")[1].split()[0])
    assert n < PIDS_LIMIT, log
    assert f"pids limit ({PIDS_LIMIT} processes and threads per attempt)" in job["reason"], job


def test_a_job_allocating_past_its_memory_limit_is_killed_with_the_reason(world: World) -> None:
    with world.client(world.bob) as b:
        job, log = run(b, command=[JOB_PY, "-c", ALLOCATE])
    assert job["state"] == "failed", (job, log)
    assert "holding 1024 MiB" not in log, log
    assert job["reason"] == "rank 0 was killed by the memory limit (256 MiB per attempt)", job


def test_training_saves_its_checkpoint_in_the_default_working_dir(world: World) -> None:
    ann = world.accounts[world.ann]
    digits = ROOT / "examples" / "train_digits.py"
    cmd = [JOB_PY, str(digits), "--epochs", "1", "--checkpoint-dir", "."]
    with world.client(world.ann) as a:
        job, log = run(a, timeout=240, command=cmd, env={"PYTHONPATH": JOB_PATH})
    assert job["state"] == "succeeded", (job, log)
    checkpoint = world.work / world.ann / "checkpoint.pt"
    st = checkpoint.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (ann.pw_uid, 0o600)


FILL = """\
import os
with open("big.bin", "wb") as f:
    for i in range(128):  # 128 MiB into a 64 MiB working directory
        f.write(b"x" * (1 << 20))
        f.flush()
"""


def test_a_user_filling_their_disk_limit_gets_enospc_alone(world: World) -> None:
    own = world.work / world.bob
    assert own.is_mount() and (world.work / ".hora-disks").stat().st_mode & 0o777 == 0o700
    with world.client(world.bob) as b, world.client(world.ann) as a:
        job, log = run(b, command=[JOB_PY, "-c", FILL])
        assert job["state"] == "failed" and "No space left on device" in log, (job, log)
        assert (own / "big.bin").stat().st_size < 64 << 20
        job, log = run(a, command=[JOB_PY, "-c", "open('fine.txt', 'w').write('x' * 4096)"])
        assert job["state"] == "succeeded", (job, log)
