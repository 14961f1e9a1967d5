"""Elastic jobs in multi-user mode: the driver runs as the job's account and reads the slots
the service offers through the shim's descriptor of the run directory, which it cannot write.

A real ``hora serve`` runs as root in multi-user mode with two fresh OS accounts (the
fixtures of :mod:`test_service_isolation`). Ann's elastic job (min 2, max 3) trains with
tests/dist/_elastic_train.py; each of its workers first attacks its own slot file (write it,
append to it, rename it, replace it with a new file, change its mode): every attack must
fail. Bob's job tries to read the slot file by its path and through ``/proc`` of Ann's
driver: both must fail. Then a worker is SIGKILLed: a replacement joins and the job
succeeds with the weights of one process training alone.

Jobs run the system's Python (the accounts cannot enter the test's own under /root) with
this checkout's ``kernels`` and the venv's packages on ``PYTHONPATH``; the driver too
(``HORA_SESSION_PYTHON``). Needs root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time
from pathlib import Path

import hora
import psutil
import pytest
import test_service_isolation as iso
import torch
from helpers.service_server import REPO, ServiceServer, wait_state

pytestmark = pytest.mark.timeout(300)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
PYTHONPATH = f"{Path(hora.__file__).parents[1]}:{Path(torch.__file__).parents[1]}"
SCRIPT = REPO / "tests" / "dist" / "_elastic_train.py"

# each worker attacks the slot file its driver reads, then trains
OWN = """\
import os, runpy, sys
def attempt(name, fn):
    try:
        got = fn()
    except OSError as e:
        print("blocked", name, type(e).__name__, flush=True)
    else:
        print("LEAK", name, repr(got)[:200], flush=True)
def slot_file():
    fds = f"/proc/{os.getppid()}/fd"  # the driver's (this account's) descriptors
    for fd in os.listdir(fds):
        path = os.path.join(fds, fd, "elastic.hosts")
        if os.path.isfile(path):
            return path
    raise SystemExit("no slot file among the driver's descriptors")
def write(path, how):
    with open(path, how) as f:
        return f.write("localhost:64\\n")
path = slot_file()
where = os.path.dirname(path)
with open(path) as f:
    print("read-slots", f.read().strip(), flush=True)
attempt("write-slots", lambda: write(path, "w"))
attempt("append-slots", lambda: write(path, "a"))
attempt("new-file", lambda: write(os.path.join(where, "evil.hosts"), "w"))
attempt("rename-slots", lambda: os.rename(path, os.path.join(where, "old.hosts")))
attempt("unlink-slots", lambda: os.unlink(path))
attempt("chmod-slots", lambda: os.chmod(path, 0o666))
print("attacks done", flush=True)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""

# another user's job reads the slot file by its path and through the driver's descriptor
OTHER = """\
import json, sys
args = json.loads(sys.argv[1])
for name in ("other-slots", "other-slots-proc"):
    try:
        with open(args[name]) as f:
            print("LEAK", name, f.read()[:200], flush=True)
    except OSError as e:
        print("blocked", name, type(e).__name__, flush=True)
"""


def _reference() -> list[torch.Tensor]:
    spec = importlib.util.spec_from_file_location("_elastic_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [torch.tensor(w) for w in module.reference()]


def _size(c: object, job_id: int, size: int, timeout: float = 120.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    job: dict[str, object] = {}
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()  # type: ignore[attr-defined]
        if (job.get("elastic") or {}).get("size") == size:  # type: ignore[union-attr]
            return job
        assert job["state"] not in ("succeeded", "failed", "cancelled"), job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} never had {size} workers: {job}")


def _driver_fd(shim_pid: int, run_dir: Path) -> tuple[int, int]:
    """The driver's pid and its descriptor of the run directory (read as root)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(shim_pid).children():
            for fd in os.listdir(f"/proc/{child.pid}/fd"):
                try:
                    if os.readlink(f"/proc/{child.pid}/fd/{fd}") == str(run_dir):
                        return child.pid, int(fd)
                except OSError:
                    continue
        time.sleep(0.1)
    raise TimeoutError("the driver holds no descriptor of its run directory")


def test_an_elastic_job_of_one_account_replaces_a_killed_worker_and_cannot_touch_its_slots(
    base: Path, accounts: dict[str, int]
) -> None:
    ann, bob = accounts
    work = iso.work_dir(base)
    out = work / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    (work / "own.py").write_text(OWN)
    (work / "other.py").write_text(OTHER)
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    env = {"HORA_WORK_ROOT": str(work), "HOME": str(home), "HORA_JOB_ENV_PASSTHROUGH": "",
           "HORA_SESSION_PYTHON": iso.JOB_PY}  # fmt: skip
    users = {**{name: False for name in accounts}, "root": True}
    with (
        ServiceServer(base, users=users, accounts=accounts, cpu_slots=4, env=env) as srv,
        srv.client(ann) as a,
        srv.client(bob) as b,
    ):
        command = [iso.JOB_PY, "own.py", str(SCRIPT), str(out), "--sleep", "0.4",
                   "--wait-size", "3"]  # fmt: skip
        job_id = iso.submit(
            a,
            command=command,
            working_dir=".",
            elastic={"min_workers": 2, "max_workers": 3},
            env={"PYTHONPATH": PYTHONPATH, "HORA_TIMEOUT": "60"},
        )
        job = _size(a, job_id, 3)
        first = {m["worker"]: m["pid"] for m in job["elastic"]["members"]}  # type: ignore[index]
        assert sorted(first) == ["w0", "w1", "w2"], job
        assert psutil.Process(first["w0"]).uids().real == accounts[ann]

        run_dir = srv.data_dir / "logs" / str(job_id) / "1"
        shim = int(iso.wait_file(run_dir / "rank0.pid"))
        driver, fd = _driver_fd(shim, run_dir)
        assert psutil.Process(driver).uids().real == accounts[ann]
        args = {
            "other-slots": str(run_dir / "elastic.hosts"),
            "other-slots-proc": f"/proc/{driver}/fd/{fd}/elastic.hosts",
        }
        other = iso.submit(b, command=[iso.JOB_PY, "other.py", json.dumps(args)], working_dir=".")
        wait_state(b, other, ("succeeded", "failed"), timeout=60)
        seen = b.get(f"/v1/jobs/{other}/logs", params={"rank": 0}).text
        assert "LEAK" not in seen, seen
        assert "blocked other-slots " in seen and "blocked other-slots-proc " in seen, seen

        deadline = time.monotonic() + 90
        while not (out / "progress").exists():  # a commit: the kill loses uncommitted work only
            assert time.monotonic() < deadline, "no commit within 90 s"
            time.sleep(0.1)
        os.kill(first["w1"], signal.SIGKILL)

        done = wait_state(a, job_id, ("succeeded", "failed", "cancelled"), timeout=180)
        log = a.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text
        assert done["state"] == "succeeded", (done, log[-4000:])
        assert "LEAK" not in log, log[-4000:]
        blocked = set(re.findall(r"blocked (\S+) ", log))  # lines with the driver's prefix
        assert blocked >= {"write-slots", "append-slots", "new-file", "rename-slots",
                           "unlink-slots", "chmod-slots"}, log[-4000:]  # fmt: skip
        assert "read-slots localhost:3" in log, log[-4000:]
        elastic = done["elastic"]
        assert {m["worker"] for m in elastic["members"]} == {"w0", "w2", "w3"}, elastic
        sizes = [(c["size"], c["reason"]) for c in elastic["history"] if c["generation"]]
        assert any(n == 2 and "w1" in why for n, why in sizes), sizes

        # the slot file and its directory stay the service's, readable by Ann's group only
        gid = iso._gid(accounts[ann])
        st = (run_dir / "elastic.hosts").stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, 0o640)
        st = run_dir.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, 0o750)
        assert (run_dir / "elastic.hosts").read_text() == "localhost:3\n"
        assert sorted(p.name for p in run_dir.glob("*.hosts")) == ["elastic.hosts"]

    results = {p.stem: json.loads(p.read_text()) for p in out.glob("w*.json")}
    assert sorted(results) == ["w0", "w2", "w3"], results
    for wid, r in results.items():
        assert r["step"] == 16, (wid, r)
        for got, want in zip(r["weights"], _reference(), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)


def test_a_driver_python_the_account_cannot_run_is_a_422_naming_elastic(
    base: Path, accounts: dict[str, int]
) -> None:
    ann = next(iter(accounts))
    iso.work_dir(base)
    hidden = base / "hidden"
    hidden.mkdir(mode=0o700)  # root's: the job accounts cannot enter it
    (hidden / "python3").symlink_to(iso.JOB_PY)
    with iso.serve(base, accounts, HORA_SESSION_PYTHON=str(hidden / "python3")) as srv:
        with srv.client(ann) as a:
            body = {"command": [iso.JOB_PY, "-c", "pass"], "working_dir": ".",
                    "elastic": {"min_workers": 1, "max_workers": 2}}  # fmt: skip
            r = a.post("/v1/jobs", json=body)
            assert r.status_code == 422, r.text
            detail = r.json()["detail"][0]
            assert detail["loc"][-1] == "elastic" and str(hidden) in detail["msg"], r.text
            # the same job without elastic starts: only the driver's Python was refused
            plain = iso.submit(a, command=[iso.JOB_PY, "-c", "pass"], working_dir=".")
            assert wait_state(a, plain, ("succeeded", "failed"))["state"] == "succeeded"
