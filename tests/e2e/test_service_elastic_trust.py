"""Elastic slots are decided from what the service sees, never from what a job prints (issue 25).

The third red-team round had a ``sitecustomize.py`` on a job's ``PYTHONPATH`` print fake
``membership`` lines from its elastic driver: the service took them for a finished shrink and
gave bob's slots to alice's job of higher priority while all 4 of his workers still ran. And
a shrink whose workers ignored it left the higher-priority job queued for ever, with every
other shrink waiting behind it. Reproduced here against a real ``hora serve`` as root in
multi-user mode with OS accounts made by hora's own useradd path (the fixtures of
:mod:`test_service_isolation`):

* the hostile driver (its ``sitecustomize``) never stops a worker asked to leave, and may
  print forged membership lines; its workers sleep and never look at a shrink;
* the test counts the workers itself, as processes of the job's account, and checks at every
  look that no slot is held twice: the higher-priority job never runs while more of bob's
  workers run than the slots he keeps;
* after ``elastic_shrink_timeout_s`` the service stops the extra workers (and says so in the
  job's history); meanwhile another job's shrink proceeds.

Jobs run the system's Python with this checkout's ``kernels`` on ``PYTHONPATH`` (the job
accounts cannot enter the test's own interpreter under /root); the driver too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hora
import httpx
import psutil
import pytest
import test_service_isolation as iso
from helpers.service_server import ServiceServer

pytestmark = pytest.mark.timeout(300)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
KERNELS = str(Path(hora.__file__).parents[1])

# in the elastic driver only (python -m hora.launch): never stop a worker asked to leave;
# with FAKE_MEMBERSHIP set, claim every half second that the world shrank to one worker
SITECUSTOMIZE = """\
import json, os, sys, threading, time
if "hora.launch" in sys.orig_argv:
    import hora.launch.elastic as _driver
    _driver._REMOVED_GRACE_S = 1e9
    def _lie():
        n = 1000
        while True:
            n += 1
            body = {"generation": n, "size": 1, "reason": "forged", "at": time.time(),
                    "members": [["w0", 999999999]]}
            sys.stderr.write("hora run: membership " + json.dumps(body) + "\\n")
            sys.stderr.flush()
            time.sleep(0.5)
    if os.environ.get("FAKE_MEMBERSHIP"):
        threading.Thread(target=_lie, daemon=True).start()
"""

# a worker that ignores every shrink: it sleeps until killed
STUBBORN = "import sys, time\nprint('worker up', sys.argv[1], flush=True)\ntime.sleep(600)\n"

# a worker that leaves as soon as its driver marks it removed (what a commit does)
POLITE = """\
import os, sys, time
mark = os.path.join(os.environ["HORA_ELASTIC_DIR"], "removed." + os.environ["HORA_ELASTIC_WORKER"])
print("worker up", sys.argv[1], flush=True)
while not os.path.exists(mark):
    time.sleep(0.1)
print("worker leaves", flush=True)
"""


@pytest.fixture
def work(base: Path) -> Path:
    work = iso.work_dir(base)
    hostile = work / "hostile"
    hostile.mkdir(mode=0o755)
    (hostile / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (work / "stubborn.py").write_text(STUBBORN)
    (work / "polite.py").write_text(POLITE)
    return work


@pytest.fixture
def srv(base: Path, accounts: dict[str, int], work: Path) -> Iterator[ServiceServer]:
    home = base / "service-home"
    home.mkdir(mode=0o755, exist_ok=True)
    env = {"HORA_WORK_ROOT": str(work), "HOME": str(home), "HORA_JOB_ENV_PASSTHROUGH": "",
           "HORA_SESSION_PYTHON": iso.JOB_PY, "HORA_ELASTIC_SHRINK_TIMEOUT_S": "25"}  # fmt: skip
    users = {**{name: False for name in accounts}, "root": True}
    with ServiceServer(base, users=users, accounts=accounts, cpu_slots=4, env=env) as server:
        yield server


def elastic(c: httpx.Client, script: str, tag: str, most: int, priority: str,
            fake: bool = False) -> int:  # fmt: skip
    # hostile/ is relative to the working directory (the work root)
    env = {"PYTHONPATH": f"hostile:{KERNELS}", "HORA_TIMEOUT": "60"}
    if fake:
        env["FAKE_MEMBERSHIP"] = "1"
    return iso.submit(c, command=[iso.JOB_PY, script, tag], working_dir=".", priority=priority,
                      elastic={"min_workers": 1, "max_workers": most}, env=env)  # fmt: skip


def workers(tag: str) -> list[int]:
    """The test's own count: live worker processes started with ``tag``, oldest first."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "create_time"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and cmd[-1:] == [tag] and len(cmd) == 3:
            found.append((p.info["create_time"], p.pid))
    return [pid for _, pid in sorted(found)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running(c: httpx.Client, jobs: tuple[int, ...], tags: tuple[str, ...]) -> tuple[int, int]:
    """(jobs of ``jobs`` running, workers of ``tags``), the workers counted before and after
    the jobs (the smaller count: a world that grows back in between is not double-counted)."""
    before = sum(len(workers(t)) for t in tags)
    busy = sum(state(c, j) == "running" for j in jobs)
    return busy, min(before, sum(len(workers(t)) for t in tags))


def until(what: str, ok: Callable[[], Any], check: Callable[[], None] = lambda: None,
          timeout: float = 120) -> Any:  # fmt: skip
    """Wait for ``ok()`` to be true, running ``check()`` (which asserts) at every look."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


def state(c: httpx.Client, job: int) -> str:
    return str(c.get(f"/v1/jobs/{job}").json()["state"])


def reasons(c: httpx.Client, job: int) -> list[str]:
    return [h["reason"] for h in c.get(f"/v1/jobs/{job}").json()["elastic"]["history"]]


def test_forged_membership_lines_free_no_slot_while_the_workers_run(
    srv: ServiceServer, accounts: dict[str, int]
) -> None:
    alice, bob = accounts
    with srv.client(alice) as a, srv.client(bob) as b:
        held = elastic(b, "stubborn.py", "bob-held", 4, "low", fake=True)
        first = until("bob's 4 workers", lambda: len(workers("bob-held")) == 4 and
                      workers("bob-held"))  # fmt: skip
        until("the forged lines read", lambda: b.get(f"/v1/jobs/{held}").json()["elastic"]
              ["generation"] > 1000)  # fmt: skip
        urgent = iso.submit(a, command=[iso.JOB_PY, "-c", "import time; time.sleep(2)"],
                            workers=3, priority="high", working_dir=".")  # fmt: skip

        def one_holder() -> None:  # 4 slots: alice's 3 only once 3 of bob's workers are gone
            busy, bobs = running(a, (urgent,), ("bob-held",))
            assert bobs + 3 * busy <= 4, f"alice's job runs beside {bobs} of bob's workers"

        until("alice's job to end", lambda: state(a, urgent) == "succeeded", one_holder)
        assert alive(first[0]) and not any(alive(pid) for pid in first[1:]), first
        why = reasons(b, held)
        assert any(r.startswith("shrinking to 1 slot(s)") for r in why), why
        stopped = ", ".join(map(str, first[1:]))  # the newest 3, oldest first
        assert any(r.startswith(f"stopped worker process(es) {stopped}") for r in why), why
        assert state(b, held) == "running"


def test_a_stuck_shrink_blocks_no_other_shrink_and_is_enforced(
    srv: ServiceServer, accounts: dict[str, int]
) -> None:
    alice, bob = accounts
    with srv.client(alice) as a, srv.client(bob) as b:
        stuck = elastic(b, "stubborn.py", "bob-stuck", 2, "low")
        stuck_first = until("bob's 2 workers", lambda: len(workers("bob-stuck")) == 2 and
                            workers("bob-stuck"))  # fmt: skip
        polite = elastic(b, "polite.py", "bob-polite", 2, "normal")
        polite_first = until("bob's other 2 workers", lambda: len(workers("bob-polite")) == 2
                             and workers("bob-polite"))  # fmt: skip
        sleep = [iso.JOB_PY, "-c", "import time; time.sleep(600)"]  # until cancelled
        first = iso.submit(a, command=sleep, priority="high", working_dir=".")
        until("the stuck shrink to begin", lambda: any(
            r.startswith("shrinking to 1") for r in reasons(b, stuck)))  # fmt: skip
        second = iso.submit(a, command=sleep, priority="high", working_dir=".")

        def one_holder() -> None:  # 4 slots: never more than 4 workers and jobs at once
            busy, bobs = running(a, (first, second), ("bob-stuck", "bob-polite"))
            assert bobs + busy <= 4, f"{busy} high jobs run beside {bobs} of bob's workers"

        def how_many() -> int:
            return sum(state(a, j) == "running" for j in (first, second))

        # the polite job's shrink proceeds while the stuck one's workers all still run
        until("a high job to run", lambda: how_many() or not all(map(alive, stuck_first)),
              one_holder)  # fmt: skip
        assert all(map(alive, stuck_first)), "the stuck shrink was enforced first"
        assert any(r.startswith("gave back slot") for r in reasons(b, polite))
        assert alive(polite_first[0]) and not alive(polite_first[1])
        # then the bound: the stuck job's newest worker is stopped, the other high job runs
        until("both high jobs to run", lambda: how_many() == 2, one_holder)
        assert alive(stuck_first[0]) and not alive(stuck_first[1])
        why = reasons(b, stuck)
        assert any(r.startswith(f"stopped worker process(es) {stuck_first[1]}") for r in why)
        assert state(b, stuck) == state(b, polite) == "running"
