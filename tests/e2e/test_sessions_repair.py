"""A service session's dead engine is replaced: the survivors keep their processes and variables.

A real uvicorn service on 127.0.0.1 with 2 CPU slots, a real kernel run by nbclient whose
``%dist_start`` goes through it, real engines started by the service's local runtime, and
real SIGKILLs. Between cells the kernel rebuilds the survivors' process group and asks the
service for a new engine in the dead one's slot (``POST /v1/sessions/{id}/replace``); during a
cell that runs ``hvd.elastic.run`` the survivors wait for it and training carries on.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e._notebook import Notebook, hora_notebook, wait_for
from helpers.service_server import ServiceServer

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    env = {
        "HORA_SESSION_LEASE_S": "10",
        "HORA_JOB_ENV_PASSTHROUGH": "PYTHONPATH,OMP_NUM_THREADS,PYTHONUNBUFFERED",
    }
    with ServiceServer(tmp_path_factory.mktemp("svc-repair"), {"ann": False}, 2, env) as srv:
        yield srv


@pytest.fixture
def notebook(server: ServiceServer, tmp_path: Path) -> Iterator[Notebook]:
    with hora_notebook(
        server, tmp_path, start="%dist_start -n 2 --timeout 30", ready="2 engines ready"
    ) as nb:
        yield nb


def engine_pids(nb: Notebook) -> dict[int, int]:
    out = nb.run("%%distributed --all\nimport os\nprint('pid', os.getpid())")
    found = {int(r): int(p) for r, p in re.findall(r"\[rank (\d)\] pid (\d+)", out)}
    assert sorted(found) == [0, 1], out
    return found


def session_of(c: httpx.Client) -> dict:
    items = c.get("/v1/sessions", params={"state": "running"}).json()["items"]
    assert len(items) == 1, items
    return items[0]


def events(c: httpx.Client, session_id: int) -> list[str]:
    job = c.get(f"/v1/jobs/{session_id}").json()
    return [t["reason"] or "" for t in job["transitions"]]


def test_engine_killed_between_cells_is_replaced_in_its_slot(
    server: ServiceServer, notebook: Notebook
) -> None:
    notebook.run("%%distributed\nmine = 100 + hvd.rank()")
    old = engine_pids(notebook)
    with server.client("ann") as c:
        before = session_of(c)
        os.kill(old[1], signal.SIGKILL)
        sid = before["id"]
        wait_for(
            "the service to keep the dead engine's slot",
            lambda: any("its slot is kept" in e for e in events(c, sid)),
        )
        assert session_of(c)["state"] == "running"  # not ended by the death
        out = notebook.run(
            "%%distributed --all\nimport os\n"
            "total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()\n"
            "print('after', os.getpid(), hvd.size(), total, globals().get('mine'))"
        )
        assert f"rank 1 (pid {old[1]}) died (gone; its exit status" in out, out
        assert "engine replaced; variables lost on rank 1: mine, os; rank 0 kept theirs" in out, out
        new = engine_pids(notebook)
        assert new[0] == old[0] and new[1] != old[1]
        assert f"[rank 0] after {old[0]} 2 2.0 100" in out, out
        assert f"[rank 1] after {new[1]} 2 2.0 None" in out, out
        after = session_of(c)
        assert after["id"] == sid and after["slots"] == before["slots"]
        said = events(c, sid)
        assert any("engine rank 1 was killed by SIGKILL; its slot is kept" in e for e in said)
        assert any(e.startswith("rank 1: new engine started (asked by the notebook") for e in said)
        # the replacement is the session's event, never a line in the rank's log
        log = c.get(f"/v1/jobs/{sid}/logs", params={"rank": 1})
        assert log.status_code == 200 and "[hora]" not in log.text, log.text
        # a running engine is not replaced twice, and a rank that does not exist is named
        body = {"rank": 0, "master_port": 40000}
        r = c.post(f"/v1/sessions/{sid}/replace", json=body)
        assert r.status_code == 409 and "rank 0's engine" in r.json()["detail"]
        r = c.post(f"/v1/sessions/{sid}/replace", json={"rank": 5, "master_port": 40000})
        assert r.status_code == 422 and "rank" in str(r.json()["detail"])


ELASTIC_CELL = """%%distributed --all
import os, signal
torch.manual_seed(1234 + hvd.rank())  # the new engine's model starts different: sync fixes it
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = hvd.elastic.TorchState(model, opt, step=0)

@hvd.elastic.run
def train(state):
    while state.step < 30:
        if state.step == 10 and hvd.rank() == 1 and globals().get("mine") is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        grad = hvd.allreduce(torch.ones(1), op=hvd.Sum)
        with torch.no_grad():
            model.weight.add_(0.01 * grad)
        state.step += 1
        state.commit()

train(state)
weights = hvd.allgather_object(round(model.weight.sum().item(), 4))
print('done', os.getpid(), hvd.size(), state.step, weights[0], len(set(weights)),
      globals().get("mine"))
"""


def test_engine_killed_in_elastic_run_is_replaced_and_training_carries_on(
    notebook: Notebook,
) -> None:
    import torch

    notebook.run("%%distributed\nmine = 100 + hvd.rank()")
    old = engine_pids(notebook)
    out = notebook.run(ELASTIC_CELL)
    new = engine_pids(notebook)
    assert new[0] == old[0] and new[1] != old[1], out
    assert f"rank 1 (pid {old[1]}) died during the cell (gone; its exit status" in out, out
    assert "rank 0 kept their processes and variables" in out, out
    torch.manual_seed(1234)
    w = round(torch.nn.Linear(4, 1).weight.sum().item() + 30 * 4 * 0.01 * 2, 4)
    # no committed step lost or done twice: rank 0's weights plus 30 steps of two ranks
    assert f"[rank 0] done {old[0]} 2 30 {w} 1 100" in out, out
    assert f"[rank 1] done {new[1]} 2 30 {w} 1 None" in out, out
