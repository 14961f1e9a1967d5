"""`%dist_submit`: the cells that trained on real engines run again as a job of a real service.

Real ipyparallel engines (CPU, gloo; a session of the service, since HORA_URL is set), a real
uvicorn service on 127.0.0.1 with 4 CPU slots (2 for the engines, 2 for the job), and
the job's ranks started by its local runtime.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from _magics_util import wait_gone
from helpers.service_server import ServiceServer, wait_state
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(240)

SETUP = """%%distributed
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters()
)
g = torch.Generator().manual_seed(100 + hvd.rank())
x = torch.randn(64, 4, generator=g)
y = x.sum(1, keepdim=True) * scale
"""
TRAIN = """%%distributed
for step in range(25):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
final = hvd.allreduce(loss.detach(), op=hvd.Average).item()
print(f"final loss {final:.8f}")
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(tmp_path_factory.mktemp("svc-submit"), cpu_slots=4) as srv:
        yield srv


@pytest.fixture
def ip(server: ServiceServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # the magic finds the service like hora.Client() does: HORA_URL / HORA_TOKEN
    monkeypatch.setenv("HORA_URL", server.url)
    monkeypatch.setenv("HORA_TOKEN", server.tokens["ann"])
    monkeypatch.setenv("HORA_CONFIG", str(tmp_path / "no-config"))
    monkeypatch.chdir(tmp_path)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output():
        shell.run_line_magic("dist_start", "-n 2 --timeout 30")
    from hora import magics

    pids = magics._MAGICS.cluster.pids
    yield shell
    shell.run_line_magic("unload_ext", "hora")
    assert wait_gone(pids) == []


def _output(job, rank: int) -> str:
    """A rank's log: only what the job printed (the preflight's figures go to the service)."""
    return job.logs(rank=rank).strip()


def run(ip: InteractiveShell, cell: str):
    with capture_output() as cap:
        result = ip.run_cell(cell)
    return result, cap


def test_submitted_cells_reach_the_same_loss_as_in_the_notebook(ip, tmp_path: Path) -> None:
    ip.run_cell("lr = 0.05\nscale = 3.0")
    ip.run_line_magic("dist_push", "lr")
    ip.run_line_magic("dist_push", "scale --rank 1")
    ip.run_line_magic("dist_push", "scale --rank 0")
    assert run(ip, SETUP)[0].success
    failed, _ = run(ip, "%%distributed\nraise ValueError('a failed cell is not carried')")
    assert not failed.success
    result, cap = run(ip, TRAIN)
    assert result.success, cap.stdout
    in_notebook = cap.stdout.strip()
    assert in_notebook.startswith("final loss ")
    ip.run_cell("lr = 99.0")  # changed after the push: the job gets the pushed value
    with capture_output() as sub:
        job = ip.run_line_magic("dist_submit", "--name replay --wait")
    assert f"submitted job {job.id} (replay): 2 cells of this notebook" in sub.stdout
    assert f"hora logs -f {job.id}" in sub.stdout
    assert sub.stdout.rstrip().endswith(f"job {job.id}: succeeded")
    assert _output(job, 0) == in_notebook
    assert _output(job, 1) == in_notebook
    info = job.status()
    assert info.spec.workers == 2 and info.spec.name == "replay"
    script = next((tmp_path / "hora-jobs").glob("replay-*.py")).read_text()
    assert "a failed cell is not carried" not in script


def test_what_cannot_be_carried_is_named(ip) -> None:
    assert run(ip, "%%distributed\n%time z = 1")[0].success  # fine on the engines
    with pytest.raises(UsageError, match=r"cell \[\d+\] uses IPython syntax"):
        ip.run_line_magic("dist_submit", "")
    ip.run_line_magic("dist_restart", "")  # a fresh start forgets what the engines ran
    with pytest.raises(UsageError, match="no %%distributed cell has run"):
        ip.run_line_magic("dist_submit", "")
    ip.run_cell("f = lambda v: v + 1")
    ip.run_line_magic("dist_push", "f")  # ipyparallel carries a lambda; pickle does not
    assert run(ip, "%%distributed\nprint(f(1))")[0].success
    with pytest.raises(UsageError, match=r"%dist_push f in cell \[\d+\] cannot be carried"):
        ip.run_line_magic("dist_submit", "")


def test_cells_lost_to_an_engine_restart_are_not_replayed(ip) -> None:
    from hora import magics

    assert run(ip, "%%distributed\nbefore = 1")[0].success
    magics._MAGICS.cluster.restart()  # what a stuck interrupt does: fresh engines
    assert run(ip, "%%distributed\nafter = 2")[0].success
    history = magics._MAGICS.history
    assert [r.code.strip() for r in history] == ["after = 2"]


def test_submit_after_dist_stop_still_replays_the_cells(ip) -> None:
    ip.run_cell("lr = 0.05\nscale = 3.0")
    ip.run_line_magic("dist_push", "lr")
    ip.run_line_magic("dist_push", "scale")
    assert run(ip, SETUP)[0].success
    result, cap = run(ip, TRAIN)
    assert result.success, cap.stdout
    ip.run_line_magic("dist_stop", "")  # the cells are still the notebook's
    with capture_output() as sub:
        job = ip.run_line_magic("dist_submit", "--name after-stop --wait")
    assert f"submitted job {job.id} (after-stop): 2 cells of this notebook" in sub.stdout
    assert sub.stdout.rstrip().endswith(f"job {job.id}: succeeded")
    assert _output(job, 0) == cap.stdout.strip()
    assert job.status().spec.workers == 2  # as many ranks as the stopped engines


def test_handoff_gives_the_session_slots_straight_to_the_job(
    ip, server: ServiceServer, tmp_path: Path
) -> None:
    from hora import magics

    session = magics._MAGICS.cluster.session
    gate = tmp_path / "gate"
    waiter = tmp_path / "wait.py"
    waiter.write_text(
        "import pathlib, sys, time\n"
        "end = time.monotonic() + 120\n"
        "while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < end:\n"
        "    time.sleep(0.05)\n"
    )
    body = {"command": [sys.executable, str(waiter), str(gate)], "workers": 2}
    with server.client("ann") as ann, server.client("root") as root:
        blocker = ann.post("/v1/jobs", json=body).json()["id"]
        wait_state(ann, blocker, ("running",))  # the 2 slots the session does not hold
        first = root.post("/v1/jobs", json=body).json()["id"]  # queued first, needs 2
        assert root.get(f"/v1/jobs/{first}").json()["state"] == "queued"
        try:
            assert run(ip, "%%distributed\nprint(f'rank {hvd.rank()} of {hvd.size()}')")[0].success
            _dashboard_shows_the_session(server, session.id)
            with capture_output() as sub:
                job = ip.run_line_magic("dist_submit", "--handoff --name handed --wait")
            assert f"session {session.id}'s slots handed to job {job.id}" in sub.stdout
            assert sub.stdout.rstrip().endswith(f"job {job.id}: succeeded")
            assert "rank 1 of 2" in job.logs(rank=1)
            # the job queued before it got no slot until the handed job was done with them
            older = root.get(f"/v1/jobs/{first}").json()["started_at"]
            done = job.status().finished_at
            assert older is None or datetime.fromisoformat(older) >= done, (older, done)
            ended = ann.get(f"/v1/sessions/{session.id}").json()
            assert ended["reason"] == f"stopped: its slots were handed to job {job.id}"
            assert magics._MAGICS.cluster is None
        finally:
            gate.touch()


def _dashboard_shows_the_session(server: ServiceServer, session_id: int) -> None:
    """The dashboard's sessions and pool data name the running session (idle time, culling)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as web:
        assert web.post("/ui/login", json={"token": server.tokens["ann"]}).status_code == 200
        mine = {s["id"]: s for s in web.get("/ui/api/sessions").json()}
        assert mine[session_id]["state"] == "running"
        assert mine[session_id]["idle_s"] is not None
        assert 0 < mine[session_id]["stop_in_s"] <= 3600  # the service's default idle timeout
        slots = web.get("/ui/api/pool").json()["nodes"][0]["slots"]
        held = [s for s in slots if s["holder"] and s["holder"]["id"] == session_id]
        assert len(held) == 2 and all(s["holder"]["kind"] == "session" for s in held)
