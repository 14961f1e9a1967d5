"""A parked session's snapshot is its owner's alone (issue 28): multi-user mode, real accounts.

A real ``hora serve`` runs as root in multi-user mode with two fresh OS accounts (the fixtures
of :mod:`test_service_isolation`); the session engines run as their owner's account with the
system's Python. Ann's notebook (a real kernel, nbclient) parks its session: the snapshot lies
in her own working directory, mode 0700 and her account's all the way down. Bob can neither
read it (a job of his, as his account, tries to list and open it) nor see, resume or delete
it through the API; Ann's next cell resumes it, her engines (as her account) reading it back.
Needs root.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import hora
import pytest
import test_service_isolation as iso
import torch
from e2e._notebook import Notebook
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(900)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
PYTHONPATH = f"{Path(hora.__file__).parents[1]}:{Path(torch.__file__).parents[1]}"
PROBE = """\
import json, os, sys
for what, path in json.loads(sys.argv[1]).items():
    try:
        got = os.listdir(path) if what.startswith("list") else open(path, "rb").read(16)
    except OSError as e:
        print("blocked", what, type(e).__name__, flush=True)
    else:
        print("LEAK", what, repr(got)[:80], flush=True)
"""


@pytest.fixture
def served(base: Path, accounts: dict[str, int]) -> Iterator[ServiceServer]:
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    users = {**{name: False for name in accounts}, "root": True}
    env = {
        "HORA_WORK_ROOT": str(base / "work"), "HOME": str(home), "PYTHONPATH": PYTHONPATH,
        "HORA_SESSION_PYTHON": iso.JOB_PY, "HORA_SESSION_LEASE_S": "60",
    }  # fmt: skip
    iso.work_dir(base)
    with ServiceServer(base, users=users, accounts=accounts, cpu_slots=2, env=env) as srv:
        yield srv


def test_another_user_can_neither_read_nor_resume_a_parked_session(
    served: ServiceServer, accounts: dict[str, int], base: Path
) -> None:
    ann, bob = accounts
    tag = new_tag()
    env = tagged_env(tag)
    env.update(HORA_URL=served.url, HORA_TOKEN=served.tokens[ann],
               HORA_CONFIG=str(base / "no-config"))  # fmt: skip
    nb = Notebook(env, base)
    nb.client.timeout = 600
    try:
        nb.run("%load_ext hora")
        out = nb.run("%dist_start -n 1 --timeout 30 --start-timeout 300 --no-preflight")
        assert "1 engines ready" in out, out
        nb.run("%%distributed\nimport os\nsecret = 'only ann' + str(os.getuid())")
        assert "parked session" in nb.run("%dist_park")
        with served.client(ann) as a:
            (s,) = [x for x in a.get("/v1/sessions").json()["items"] if x["state"] == "parked"]
        where = Path(s["park"]["directory"])
        for d in (where, where.parent, where.parent.parent):  # snapshot, .hora-parked, WORK/ann
            st = d.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (accounts[ann], 0o700), d
        assert (where / "rank0.pt").stat().st_uid == accounts[ann]
        _bob_is_kept_out(served, bob, ann, s["id"], where, base)
        back = nb.run("%%distributed\nprint(secret)")
        assert f"only ann{accounts[ann]}" in back and f"resumed session {s['id']}" in back, back
    finally:
        nb.close()
        left = wait_gone(tag, timeout=30)
        kill_tagged(tag)
        assert left == [], "processes left behind:\n" + describe(left)


def _bob_is_kept_out(
    srv: ServiceServer, bob: str, ann: str, sid: int, where: Path, base: Path
) -> None:
    conn = {"interface": "tcp://127.0.0.1", "registration": 40001, "control": 40002,
            "mux": 40003, "task": 40004, "iopub": 40005, "hb_ping": 40006, "hb_pong": 40007,
            "key": "k"}  # fmt: skip
    with srv.client(bob) as b:
        assert b.get(f"/v1/sessions/{sid}").status_code == 404
        assert b.post(f"/v1/sessions/{sid}/resume", json={"connection": conn}).status_code == 404
        assert b.delete(f"/v1/sessions/{sid}/snapshot").status_code == 404
        assert b.delete(f"/v1/sessions/{sid}").status_code == 404
        assert b.post("/v1/sessions/park", params={"user": ann}).status_code == 403
        probe = base / "work" / "probe.py"
        probe.write_text(PROBE)
        probe.chmod(0o644)
        paths = {"list home": str(where.parent.parent), "list parked": str(where.parent),
                 "list snapshot": str(where), "read part": str(where / "rank0.pt")}  # fmt: skip
        job = iso.submit(b, command=[iso.JOB_PY, str(probe), json.dumps(paths)])
        done = wait_state(b, job, ("succeeded", "failed"), timeout=180)
        log = b.get(f"/v1/jobs/{job}/logs", params={"rank": 0}).text
    assert done["state"] == "succeeded", log
    assert "LEAK" not in log and log.count("blocked") == 4, log
