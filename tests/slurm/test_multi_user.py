"""A slurm job of a multi-user service runs as its owner's OS account on every node."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.service_server import ServiceServer, wait_state
from helpers.slurm_cluster import Cluster, slurm_env
from helpers.slurm_jobs import log, submit
from hora_service import identity

# the job runs as another account: the system python (the venv may be under a private home)
PY = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
pytestmark = pytest.mark.timeout(120)

WHO = (
    "import os, socket, tempfile; t = os.environ['TMPDIR']; tempfile.mkstemp(dir=t); "
    "print('who', os.getuid(), os.getgid(), socket.gethostname(), os.getcwd(), t, "
    "os.stat(t).st_uid, oct(os.stat(t).st_mode & 0o777))"
)


@pytest.fixture
def account() -> Iterator[tuple[str, int, int]]:
    name = f"sl{secrets.token_hex(3)}"
    made = identity.create_account(name)
    try:
        yield name, made.uid, made.gid
    finally:
        subprocess.run(
            ["userdel", "--remove", "--force", identity.account_name(name)], capture_output=True
        )


def test_the_ranks_run_as_the_jobs_owner_on_both_nodes(
    slurm: Cluster, account: tuple[str, int, int]
) -> None:
    name, uid, gid = account
    base = Path(tempfile.mkdtemp(prefix="hora-slurm-mu-"))
    try:
        base.chmod(0o755)
        work = base / "work"
        work.mkdir(mode=0o755)
        env = {**slurm_env(slurm), "HORA_WORK_ROOT": str(work), "HORA_JOB_ENV_PASSTHROUGH": ""}
        srv = ServiceServer(base, users={name: False, "root": True}, accounts={name: uid}, env=env)
        with srv, srv.client(name) as c:
            job_id = submit(c, [PY, "-c", WHO], workers=4)
            job = wait_state(c, job_id, ("succeeded", "failed"), timeout=60)
            lines = [log(c, job_id, r).strip() for r in range(4)]
        assert job["state"] == "succeeded", (job, lines)
        seen = [ln.split()[1:] for ln in lines]
        assert [s[:2] for s in seen] == [[str(uid), str(gid)]] * 4, lines
        assert [s[2] for s in seen] == ["n1", "n1", "n2", "n2"], lines
        assert {s[3] for s in seen} == {str(work / name)}, lines  # the owner's own directory
        # each rank's TMPDIR on its node is its own (its account's, 0700), gone at its end
        assert [s[5:] for s in seen] == [[str(uid), "0o700"]] * 4, lines
        assert len({s[4] for s in seen}) == 4 and not [s for s in seen if Path(s[4]).exists()]
    finally:
        shutil.rmtree(base, ignore_errors=True)
