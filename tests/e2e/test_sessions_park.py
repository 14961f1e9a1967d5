"""Parking notebooks: real kernels (nbclient) against a real service, its sessions parked and
resumed (issue 28).

A real uvicorn service on 127.0.0.1 with 2 CPU slots, real kernels started by nbclient with
``HORA_URL``/``HORA_TOKEN`` set, real ipyparallel engines started by the service's local
runtime, real jobs competing for the slots. Models are tiny (CPU, gloo) so that a park and a
resume take seconds. One server serves the module (restarted with kill -9 by one test).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e._notebook import Notebook
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from helpers.service_server import ServiceServer, wait_state

pytestmark = pytest.mark.timeout(900)

QUOTA = 4 << 20  # bytes of parked snapshots a user may keep here

TRAIN = """\
%%distributed
import random, numpy as np
torch.manual_seed(1 + hvd.rank()); random.seed(2); np.random.seed(3)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
def step(n):
    for _ in range(n):
        x = torch.randn(4, 8) + random.random() + float(np.random.rand())
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    return loss.item()
step(5)
"""
FINAL = """\
%%distributed --out final
step(5)
final = torch.cat([p.detach().flatten() for p in model.parameters()])
"""

GATE = """import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
print('job holds its slot', flush=True)
while not gate.exists():
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    env = {
        "HORA_SESSION_LEASE_S": "20",
        "HORA_SESSION_IDLE_WARN_S": "2",
        "HORA_SESSION_PARK_QUOTA": str(QUOTA),
        "HORA_SESSION_PREEMPT_IDLE_S": "3",
    }
    users = {"ann": False, "bob": False, "root": True}
    with ServiceServer(tmp_path_factory.mktemp("svc-park"), users, 2, env) as srv:
        yield srv


@pytest.fixture
def notebooks(server: ServiceServer, tmp_path: Path) -> Iterator[Opener]:
    tag = new_tag()
    box = Opener(server, tmp_path, tag)
    try:
        yield box
    finally:
        for nb in box.opened:
            nb.close()
        left = wait_gone(tag, timeout=30)
        kill_tagged(tag)
        server.cancel_all()
        with server.client("root") as c:  # parked sessions hold no process: end them too
            for s in c.get("/v1/sessions", params={"state": "parked"}).json()["items"]:
                c.delete(f"/v1/sessions/{s['id']}")
        assert left == [], "processes left behind:\n" + describe(left)


class Opener:
    def __init__(self, server: ServiceServer, where: Path, tag: str) -> None:
        self.server, self.where, self.tag = server, where, tag
        self.opened: list[Notebook] = []

    def open(self, user: str, **extra: str) -> Notebook:
        env = tagged_env(self.tag)
        env.update(
            HORA_URL=self.server.url, HORA_TOKEN=self.server.tokens[user],
            HORA_CONFIG=str(self.where / "no-config"), **extra,
        )  # fmt: skip
        nb = Notebook(env, self.where)
        nb.client.timeout = 600  # a cell that starts engines on a loaded machine
        self.opened.append(nb)
        nb.run("%load_ext hora")
        return nb


def holders(c: httpx.Client) -> list[str | None]:
    """Who holds each slot (parked sessions, listed after the slots, hold none)."""
    return [s["holder_kind"] for s in c.get("/v1/gpus").json() if s["index"] is not None]


def parked_rows(c: httpx.Client) -> list[dict]:
    return [s for s in c.get("/v1/gpus").json() if s["kind"] == "parked"]


def wait_for(what: str, check, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def final_weights(nb: Notebook) -> list[str]:
    out = nb.run(FINAL + "\n")
    assert "Error" not in out, out
    return nb.run("print([w.tolist() for w in final])").strip().splitlines()


def test_park_frees_the_slots_and_resume_trains_on_bit_for_bit(
    server: ServiceServer, notebooks: Opener, tmp_path: Path
) -> None:
    plain = notebooks.open("ann")
    start(plain, n=2)
    plain.run(TRAIN)
    expected = final_weights(plain)
    plain.run("%dist_stop")

    ann = notebooks.open("ann")
    start(ann, n=2)
    ann.run(TRAIN)
    out = ann.run("%dist_park")
    assert "parked session" in out and "slots freed" in out, out
    with server.client("ann") as c, server.client("bob") as b:
        (s,) = [x for x in c.get("/v1/sessions").json()["items"] if x["state"] == "parked"]
        assert s["park"]["bytes"] > 0 and s["park"]["world"] == 2 and s["slots"] == []
        assert holders(c) == [None, None]
        (row,) = parked_rows(c)
        assert (row["job_id"], row["user"]) == (s["id"], "ann")
        assert row["snapshot_bytes"] == s["park"]["bytes"]
        listed = c.get("/v1/jobs", params={"state": "parked"}).json()["items"]
        assert [j["id"] for j in listed] == [s["id"]] and listed[0]["park"]["world"] == 2
        dashboard = httpx.Client(base_url=server.url, headers={"Origin": server.url})
        with dashboard:
            assert dashboard.post("/ui/login", json={"token": server.tokens["bob"]}).is_success
            (shown,) = dashboard.get("/ui/api/pool").json()["parked"]  # bob sees who, since, size
            assert (shown["id"], shown["user"]) == (s["id"], "ann") and shown["since"]
            assert shown["bytes"] == row["snapshot_bytes"]
        script = tmp_path / "hello.py"
        script.write_text("print('bob ran on the freed slots')\n")
        job = b.post("/v1/jobs", json={"command": [sys.executable, str(script)], "workers": 2})
        done = wait_state(b, job.json()["id"], ("succeeded", "failed"))
        assert done["state"] == "succeeded", done
    resumed = final_weights(ann)
    assert resumed == expected
    first = ann.nb.cells[-2]  # the FINAL cell: it resumed the session first
    text = "".join(o.get("text", "") for o in first.outputs)
    assert f"session {s['id']} was parked at" in text and "parked by its user" in text, text
    assert f"resumed session {s['id']} in" in text and "names a rank" in text, text
    with server.client("ann") as c:
        now = c.get(f"/v1/sessions/{s['id']}").json()
        assert now["state"] == "running" and now["park"] is None


START = "%dist_start -n {n} --timeout 30 --start-timeout 300 --no-preflight{extra}"


def start(nb: Notebook, n: int = 1, extra: str = "") -> None:
    out = nb.run(START.format(n=n, extra=extra))
    assert f"{n} engines ready" in out, out


def in_state(c: httpx.Client, state: str) -> list[dict]:
    return [s for s in c.get("/v1/sessions").json()["items"] if s["state"] == state]


def session_of(c: httpx.Client, state: str = "running") -> dict:
    found = in_state(c, state)
    assert len(found) == 1, found
    return found[0]


def test_what_cannot_be_saved_is_named_and_nothing_stops_until_dropped(
    server: ServiceServer, notebooks: Opener, tmp_path: Path
) -> None:
    ann = notebooks.open("ann")
    start(ann)
    ann.run(
        "%%distributed\n"
        f"log = open({str(tmp_path / 'log.txt')!r}, 'w')\n"
        "batches = (i * i for i in range(10))\n"
        "big = torch.zeros(2 << 20)\n"  # 8 MiB: past this server's quota
        "w = torch.arange(4.0)"
    )
    refused = ann.run("%dist_park")
    assert "ParkRefusedError: these variables cannot be saved; nothing was parked" in refused
    assert "rank 0: log (_io.TextIOWrapper): an open file" in refused, refused
    assert "rank 0: batches (generator): a generator" in refused, refused
    assert "%dist_park --drop batches log" in refused, refused
    over = ann.run("%dist_park --drop log batches")
    assert "not parked: the snapshot is 8.0 MiB" in over and "4.0 MiB quota" in over, over
    assert "[0.0, 1.0, 2.0, 3.0]" in ann.run("%%distributed\nprint(w.tolist(), next(batches))")
    parked = ann.run("%dist_park --force --drop big")
    assert "parked session" in parked and "left out (not saved): batches (generator)" in parked
    with server.client("ann") as c:
        s = session_of(c, "parked")
        where = Path(s["park"]["directory"])
        assert where.is_dir() and {r["rank"] for r in s["park"]["ranks"]} == {0}
    back = ann.run("%%distributed\nprint(w.tolist(), 'log' in dir(), 'big' in dir())")
    assert "[0.0, 1.0, 2.0, 3.0] False False" in back, back
    assert "not restored (left out at the park): batches (generator), big (" in back, back
    ann.run("%dist_park")
    refused = ann.run("%dist_resume -n 2")  # another size: only elastic state may
    assert "was parked with 1 engines" in refused and "hvd.elastic.TorchState" in refused
    ann.run("%dist_resume")
    ann.run("%%distributed\nstate = hvd.elastic.TorchState(epoch=3, w=w)")
    ann.run("%dist_park")
    grown = ann.run("%dist_resume -n 2")
    assert "resumed session" in grown, grown
    both = ann.run("%%distributed --all\nprint('rank', hvd.rank(), state.epoch, w.tolist())")
    for rank in (0, 1):
        assert f"rank {rank} 3 [0.0, 1.0, 2.0, 3.0]" in both, both
    ann.run("%dist_park")
    assert ann.run("%dist_stop") == ""
    with server.client("ann") as c:
        wait_for("the snapshot to be deleted", lambda: not where.exists() and not any(
            p.name.startswith(f"session-{s['id']}-") for p in where.parent.iterdir()))
        assert c.get(f"/v1/sessions/{s['id']}").status_code == 404  # ended: deleted


def test_an_idle_session_is_parked_not_killed_and_resumes_after_kill_9_of_the_service(
    server: ServiceServer, notebooks: Opener
) -> None:
    ann = notebooks.open("ann")
    start(ann, extra=" --idle-timeout 20")
    ann.run("%%distributed\nsecret = 'kept across the park'")
    with server.client("ann") as c:
        s = wait_for("the idle session to be parked", lambda: [
            x for x in c.get("/v1/sessions").json()["items"] if x["state"] == "parked"], 180)[0]
        assert s["park"]["reason"].startswith("idle for") and holders(c) == [None, None]
    server.crash()
    server.restart()
    out = ann.run("%%distributed\nprint(secret)")
    assert f"session {s['id']} was parked at" in out and ": idle for" in out, out
    assert "kept across the park" in out, out


def test_a_higher_priority_job_parks_idle_sessions_but_never_interrupts_a_cell(
    server: ServiceServer, notebooks: Opener, tmp_path: Path
) -> None:
    ann, bob = notebooks.open("ann"), notebooks.open("bob")
    start(ann)
    start(bob)
    ann.run("%%distributed\nx = 41")
    done: dict[str, str] = {}
    # bob's cell computes, so the service sees his engine busy by its CPU time (a cell that
    # only sleeps looks idle to the service, whatever the kernel says: his session would be
    # asked to park too, and be parked once the cell ended)
    busy = "import time\nt0 = time.time()\nwhile time.time() - t0 < 15:\n    sum(range(1000))\n"
    cell = threading.Thread(target=lambda: done.update(
        out=bob.run(f"%%distributed\n{busy}y = 'finished'\nprint(y)")))
    cell.start()
    gate = tmp_path / "gate"
    script = tmp_path / "gate.py"
    script.write_text(GATE)
    body = {"command": [sys.executable, str(script), str(gate)], "workers": 2, "priority": "high"}
    with server.client("root") as root, server.client("ann") as a, server.client("bob") as b:
        # the kernel tells the service of the cell at once; the CPU sample follows
        wait_for("the service to see bob's cell", lambda: session_of(b)["idle_s"] < 1.0, 30)
        job = root.post("/v1/jobs", json=body).json()
        time.sleep(8)  # ann idles past 3 s, but parking her alone would not be enough
        assert session_of(b)["state"] == "running" and session_of(a)["state"] == "running"
        assert root.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued"
        cell.join(timeout=120)
        assert "finished" in done["out"] and "Error" not in done["out"], done["out"]
        wait_state(root, job["id"], ("running",), timeout=180)
        assert session_of(a, "parked")["park"]["reason"].startswith(
            f"its slots were wanted by job {job['id']} (root, priority high)")
        waiting: dict[str, str] = {}  # the job holds the slots: a resume waits in the queue
        resume = threading.Thread(target=lambda: waiting.update(out=ann.run("%dist_resume")))
        resume.start()
        wait_for("ann's resume to queue", lambda: in_state(a, "queued"))
        os.kill(ann.pid, signal.SIGINT)  # Ctrl-C: it leaves the queue and stays parked
        resume.join(timeout=60)
        assert "left the queue and stays parked" in waiting["out"], waiting["out"]
        assert session_of(a, "parked")["park"]["phase"] == "parked"
        gate.write_text("go")
        wait_state(root, job["id"], ("succeeded",), timeout=60)
    out = ann.run("%%distributed\nprint(x + 1)")
    assert f"its slots were wanted by job {job['id']}" in out and "42" in out, out


def test_a_kernel_exiting_parks_its_session_and_a_new_kernel_adopts_it(
    server: ServiceServer, notebooks: Opener
) -> None:
    first = notebooks.open("ann", HORA_PARK_ON_EXIT="1")  # as a JupyterHub culler sets it
    start(first, n=2)
    first.run("%%distributed\nw = torch.full((2,), float(hvd.rank()))")
    first.client.km.shutdown_wait_time = 300  # the kernel parks as it exits
    first.close()
    notebooks.opened.remove(first)
    with server.client("ann") as c:
        s = session_of(c, "parked")
    assert s["park"]["reason"] == "parked when its kernel exited (HORA_PARK_ON_EXIT)"
    second = notebooks.open("ann")
    listed = second.run("%dist_resume")
    assert "your parked sessions" in listed and str(s["id"]) in listed, listed
    out = second.run(f"%dist_resume {s['id']}")
    assert f"resumed session {s['id']}" in out, out
    second.run("%%distributed --out w\nw = w.tolist()\n")
    assert "[[0.0, 0.0], [1.0, 1.0]]" in second.run("print(w)")
    second.close()  # a parked-then-resumed session of a kernel without the setting: ended
    notebooks.opened.remove(second)
    with server.client("ann") as c:
        wait_for("the session to end", lambda: c.get(f"/v1/sessions/{s['id']}").status_code
                 == 404, 60)


SLOW = """\
%%distributed
import time
class Slow:
    def __reduce__(self):
        time.sleep(8)
        return (str, ('slow',))
slow = Slow()
z = torch.arange(3)
"""


def test_a_park_cut_short_or_a_damaged_part_is_never_restored(
    server: ServiceServer, notebooks: Opener
) -> None:
    ann = notebooks.open("ann")
    start(ann, n=2)
    ann.run(SLOW)
    root = server.data_dir.parent / ".hora-parked"
    with server.client("ann") as c:
        sid = session_of(c)["id"]
    mine = f"session-{sid}-"
    out: dict[str, str] = {}
    parking = threading.Thread(target=lambda: out.update(text=ann.run("%dist_park")))
    parking.start()
    wait_for("the park's directory", lambda: root.is_dir() and any(
        p.name.startswith(mine) for p in root.iterdir()), 180)
    server.crash()  # while the ranks write their parts
    parking.join(timeout=120)
    assert "was not confirmed" in out["text"], out["text"]
    server.restart()
    assert "tensor([0, 1, 2])" in ann.run("%%distributed\nprint(z)")  # the engines ran on
    wait_for("the unfinished park's parts to go", lambda: not any(
        p.name.startswith(mine) for p in root.iterdir()), 60)
    ann.run("%%distributed\ndel slow")
    assert "parked session" in ann.run("%dist_park")
    with server.client("ann") as c:
        s = session_of(c, "parked")
    part = Path(s["park"]["directory"]) / "rank1.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    failed = ann.run("%%distributed\nprint(z)")
    assert "ResumeError" in failed and "rank 1: OSError: rank1.pt does not match" in failed, failed
    assert "was not restored, on any rank" in failed and "it is deleted" in failed, failed
    assert "NameError" in ann.run("%%distributed\nprint(z)")  # nothing restored, on any rank
