"""A job's sockets, /tmp, /dev/shm and /proc are its own (issue 16, "Why" #1 and #4).

A real ``hora serve`` runs as root in multi-user mode with two fresh OS accounts (the
fixtures of :mod:`test_service_isolation`). The attacks are the ones a hostile user ran:

* another job (of another user, or of the same user) takes the rendezvous port of a
  2-rank training whose rank 1 is late, opens the store as a ``TCPStore`` client, lists its
  keys, calls ``add()`` on them, reads one, tries hora's own store client with a guessed
  secret, and calls ``hvd.init()`` with that ``MASTER_PORT`` and ``RANK=1``: it must get no
  answer at all and not join, and the training's allreduce must stay 2. With the network
  namespace the port is not even reachable; with it turned off (as on a shared network)
  the attempt's rendezvous store, which answers only holders of its secret, must hold;
* files a job leaves in ``/tmp`` and ``/dev/shm`` are invisible to another user's job while
  it runs and gone when it ends, and the other user's processes are not in its ``/proc``;
* ``hora run``, ``torchrun`` and ``mpirun`` started inside a job still work.

Jobs run the system's Python (the accounts cannot enter the test's own under /root) with
this checkout's ``kernels`` and the venv's packages on ``PYTHONPATH``. Needs root.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import hora
import httpx
import pytest
import test_service_isolation as iso
import torch
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(600)  # generous: a loaded 2-core machine imports torch slowly

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
PYTHONPATH = f"{Path(hora.__file__).parents[1]}:{Path(torch.__file__).parents[1]}"

VICTIM = """\
import os, pathlib, sys, time
import torch, hora.torch as hvd
work, attackers = pathlib.Path(sys.argv[1]), sys.argv[2:]
if os.environ["RANK"] == "0":
    (work / "victim.port").write_text(os.environ["MASTER_PORT"])
    (work / "victim.port").chmod(0o644)  # what /proc/net/tcp tells everyone, made certain
else:  # rank 1 comes late: rank 0 waits in init() meanwhile, as in the reproduction
    deadline = time.monotonic() + 300
    while not all((work / f"attack.done.{a}").exists() for a in attackers):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.05)
hvd.init()
for step in range(3):
    got = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    print(f"step {step} allreduce {got}", flush=True)
    if got != 2:
        sys.exit(5)
hvd.shutdown()
"""

ATTACK = """\
import datetime, os, pathlib, subprocess, sys, time
import torch.distributed as dist
work, victim_uid, me = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 240
while not (work / "victim.port").exists():
    assert time.monotonic() < deadline, "the victim never said its port"
    time.sleep(0.05)
port = int((work / "victim.port").read_text())
seen = 0  # what the hostile user looked at first: listening sockets of the victim's uid
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        seen += f[3] == "0A" and int(f[7]) == victim_uid
print("victim listeners seen", seen, flush=True)
try:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=2))
except Exception as e:
    print("store: refused", type(e).__name__, flush=True)
else:  # what the red team did: list the keys, add to them, read one
    keys = store.list_keys()
    print("LEAK store: listed", len(keys), "keys", flush=True)
    named = [k for k in keys if "arrived" in k or "/hb/" in k]
    print("LEAK store: named keys" if named else "store: keys opaque", named, flush=True)
    store.set_timeout(datetime.timedelta(seconds=1))
    for k in keys:
        try:
            store.add(k, 1)
            print("LEAK store: added to", k, flush=True)
        except Exception as e:
            print("store: cannot add", type(e).__name__, flush=True)
    try:
        got = store.get("hora/g1/hora/arrived/0")
    except Exception as e:
        print("store: cannot read", type(e).__name__, flush=True)
    else:
        print("LEAK store: read", got, flush=True)
try:  # hora's own store client, with a secret of its own
    from hora.torch._authstore import AuthStore
    from hora.torch._sealed import store_key
    AuthStore("127.0.0.1", port, store_key("a guess"), datetime.timedelta(seconds=2)).check(["x"])
    print("LEAK store: hora's client in without the secret", flush=True)
except Exception as e:
    print("store: hora's client refused", type(e).__name__, flush=True)
join = '''
import torch, hora.torch as hvd
hvd.init()
print("JOINED as rank", hvd.rank(), flush=True)
for _ in range(3):
    hvd.allreduce(torch.full((1,), 1000.0), op=hvd.Sum)
'''
env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1",
       "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
       "HORA_START_TIMEOUT": "2", "HORA_TIMEOUT": "2"}
r = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True,
                   timeout=240)
print("LEAK join: joined" if "JOINED" in r.stdout else f"join: failed ({r.returncode})",
      flush=True)
print(r.stderr.strip().splitlines()[-1:] if r.returncode else "", flush=True)
(work / f"attack.done.{me}").write_text("1")
"""


def _serve(base: Path, accounts: dict[str, int], **env: str) -> ServiceServer:
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    return ServiceServer(
        base,
        users={**{name: False for name in accounts}, "root": True},
        accounts=accounts,
        cpu_slots=4,
        env={"HORA_WORK_ROOT": str(base / "work"), "HOME": str(home), **env},
    )


def _job(c: httpx.Client, command: list[str], workers: int = 1) -> int:
    env = {"PYTHONPATH": PYTHONPATH, "HORA_START_TIMEOUT": "300", "OMP_NUM_THREADS": "1"}
    return iso.submit(c, command=command, workers=workers, env=env)


def _log(c: httpx.Client, job: int, rank: int = 0) -> str:
    return c.get(f"/v1/jobs/{job}/logs", params={"rank": rank}).text


def _wait_file(c: httpx.Client, job: int, path: Path, timeout: float = 240) -> None:
    """Wait for a file the job writes; on a timeout, say how the job is doing."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        state = c.get(f"/v1/jobs/{job}").json()
        assert time.monotonic() < deadline, f"{path} never appeared: {state}\n{_log(c, job)}"
        time.sleep(0.1)


@pytest.mark.parametrize("private", ["true", "false"])
def test_another_job_cannot_read_or_join_a_training(
    base: Path, accounts: dict[str, int], private: str
) -> None:
    """With the namespace, another user's job and the same user's other job both try; without
    it (as on a shared network), another user's job against the sealed store alone."""
    ann, bob = accounts
    work = iso.work_dir(base)
    (work / "victim.py").write_text(VICTIM)
    attack = work / "attack.py"
    attack.write_text(ATTACK)
    env = {"HORA_JOB_PRIVATE_NETWORK": private}
    with _serve(base, accounts, **env) as srv, srv.client(ann) as a, srv.client(bob) as b:
        attackers = {"other-user": b, "same-user": a} if private == "true" else {"other-user": b}
        victim = _job(a, [iso.JOB_PY, str(work / "victim.py"), str(work), *attackers], workers=2)
        _wait_file(a, victim, work / "victim.port")
        attacks = {
            name: _job(c, [iso.JOB_PY, str(attack), str(work), str(accounts[ann]), name])
            for name, c in attackers.items()
        }
        for name, c in attackers.items():
            done = wait_state(c, attacks[name], ("succeeded", "failed"), timeout=300)
            log = _log(c, attacks[name])
            assert done["state"] == "succeeded", (name, log)
            assert "LEAK" not in log, (name, log)
            assert "join: failed" in log, (name, log)
            if private == "true":  # nothing of the victim's can even be reached
                assert "store: refused" in log and "victim listeners seen 0" in log, (name, log)
            else:  # reachable, as on a shared network: the store answers no one without
                # the secret (no listing, no add(), no read), whatever client asks
                assert "store: refused" in log, log
                assert "store: hora's client refused" in log, log
        job = wait_state(a, victim, ("succeeded", "failed"), timeout=300)
        got = _log(a, victim)
        assert job["state"] == "succeeded", got
        assert [line for line in got.splitlines() if "allreduce" in line] == [
            f"step {s} allreduce 2.0" for s in range(3)
        ], got


PLANT = """\
import os, pathlib, sys, time
work, tag = pathlib.Path(sys.argv[1]), sys.argv[2]
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    pathlib.Path(d, f"planted-{tag}").write_bytes(b"x" * (8 << 20))
print("own /tmp", sorted(os.listdir("/tmp")), flush=True)
(work / "planted").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (work / "looked").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""

LOOK = """\
import os, pathlib, sys
work, tag, victim_uid = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    names = os.listdir(d)
    print(("LEAK" if f"planted-{tag}" in names else "hidden"), d, flush=True)
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
uids = []
for p in pids:
    try:
        uids.append(os.stat(f"/proc/{p}").st_uid)
    except OSError:
        pass
print("victim processes", uids.count(victim_uid), flush=True)
print("root processes", uids.count(0), flush=True)
print("own process", os.getpid() in pids, flush=True)
(work / "looked").write_text("1")
"""


def test_tmp_shm_and_proc_are_private_and_gone_after_the_job(
    base: Path, accounts: dict[str, int]
) -> None:
    ann, bob = accounts
    work = iso.work_dir(base)
    (work / "plant.py").write_text(PLANT)
    (work / "look.py").write_text(LOOK)
    tag = secrets.token_hex(4)
    with _serve(base, accounts) as srv, srv.client(ann) as a, srv.client(bob) as b:
        planter = _job(a, [iso.JOB_PY, str(work / "plant.py"), str(work), tag])
        _wait_file(a, planter, work / "planted")
        looker = _job(b, [iso.JOB_PY, str(work / "look.py"), str(work), tag, str(accounts[ann])])
        assert wait_state(b, looker, ("succeeded", "failed"))["state"] == "succeeded"
        seen = _log(b, looker)
        assert "LEAK" not in seen and seen.count("hidden") == 3, seen
        assert "victim processes 0" in seen and "own process True" in seen, seen
        assert "root processes 0" in seen, seen  # not even the rank's shim
        assert wait_state(a, planter, ("succeeded", "failed"))["state"] == "succeeded"
        assert f"planted-{tag}" in _log(a, planter)  # it did write into its own /tmp
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(d, f"planted-{tag}").exists(), d


FILL = """\
import errno, os
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    with open(os.path.join(d, "small"), "wb") as f:
        f.write(b"x" * (2 << 20))
    try:
        with open(os.path.join(d, "big"), "wb") as f:
            for _ in range(16):
                f.write(b"x" * (1 << 20))
                f.flush()
        print("LEAK unlimited", d, flush=True)
    except OSError as e:
        print("full", d, errno.errorcode.get(e.errno), flush=True)
"""


def test_a_jobs_private_tmp_holds_at_most_job_disk_limit(
    base: Path, accounts: dict[str, int]
) -> None:
    """The red team's concern, no disk limit per job: with job_disk_limit each of the job's
    /tmp, /var/tmp and /dev/shm takes 2 MiB and refuses 16 more (8 MiB each)."""
    ann, _ = accounts
    work = iso.work_dir(base)
    (work / "fill.py").write_text(FILL)
    with _serve(base, accounts, HORA_JOB_DISK_LIMIT="8m") as srv, srv.client(ann) as a:
        job = _job(a, [iso.JOB_PY, str(work / "fill.py")])
        done = wait_state(a, job, ("succeeded", "failed"), timeout=120)
        got = _log(a, job)
    assert done["state"] == "succeeded", got
    assert "LEAK" not in got, got
    assert [line for line in got.splitlines() if line.startswith("full")] == [
        f"full {d} ENOSPC" for d in ("/tmp", "/var/tmp", "/dev/shm")
    ], got


AR = """\
import torch, hora.torch as hvd
hvd.init()
got = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
print(f"rank {hvd.rank()} of {hvd.size()} got {got}", flush=True)
assert got == 2, got
"""

LAUNCHERS = """\
import os, subprocess, sys
py, ar = sys.executable, sys.argv[1]
# the job's own RANK / WORLD_SIZE would win over Open MPI's in hora.env.detect_world
outer = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
mpi_env = {k: v for k, v in os.environ.items() if k not in outer}
runs = {
    "hora run": [py, "-m", "hora.cli", "run", "-np", "2", py, ar],
    "torchrun": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 ar],
    "mpirun": ["mpirun", "-np", "2", "--oversubscribe", "--mca", "btl", "self,vader",
               "--mca", "oob_tcp_if_include", "lo", py, ar],
}
for name, argv in runs.items():
    env = mpi_env if name == "mpirun" else None
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    ok = r.returncode == 0 and r.stdout.count("got 2.0") == 2
    print(name, "ok" if ok else f"FAILED {r.returncode}\\n{r.stdout[-1500:]}{r.stderr[-1500:]}",
          flush=True)
"""


def test_launchers_inside_a_job_still_work(base: Path, accounts: dict[str, int]) -> None:
    ann, _ = accounts
    work = iso.work_dir(base)
    (work / "ar.py").write_text(AR)
    (work / "launchers.py").write_text(LAUNCHERS)
    with _serve(base, accounts) as srv, srv.client(ann) as a:
        job = _job(a, [iso.JOB_PY, str(work / "launchers.py"), str(work / "ar.py")])
        wait_state(a, job, ("succeeded", "failed"), timeout=170)
        log = _log(a, job)
        for name in ("hora run", "torchrun", "mpirun"):
            assert f"{name} ok" in log, log
