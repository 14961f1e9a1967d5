"""A notebook's session on Slurm parks and resumes (issue 28): the allocation ends at the park,
a new Slurm job starts at the resume.

A real kernel (nbclient), a real service whose ``slurm`` session is one Slurm job on the real
two-node cluster: ``%dist_park`` has each engine (on n1 and n2) write its part into the
working directory the nodes share, then the Slurm job ends (nothing is left on either node);
the next cell submits a new job whose engines read their parts back, each rank its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
from e2e._notebook import Notebook
from helpers.service_server import ServiceServer
from helpers.slurm_cluster import Cluster, slurm_env

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    tmp = tmp_path_factory.mktemp("svc-slurm-park")
    os.chmod(tmp, 0o755)
    env = slurm_env(slurm, HORA_SESSION_LEASE_S="20", HORA_WORK_ROOT=str(tmp))
    with ServiceServer(tmp, {"ann": False, "root": True}, 2, env) as srv:
        yield srv
    slurm.wait_idle()


def slurm_job(c: httpx.Client, sid: int) -> str:
    return str(c.get(f"/v1/jobs/{sid}").json()["container_id"])


def test_a_slurm_session_parks_its_allocation_away_and_resumes_in_a_new_job(
    server: ServiceServer, slurm: Cluster, notebook: Notebook
) -> None:
    notebook.client.timeout = 300  # a cell that parks or resumes across two nodes
    out = notebook.run("%dist_start -n 4 --runtime slurm --no-preflight --timeout 30 "
                       "--start-timeout 180")  # fmt: skip
    assert "4 engines ready" in out, out
    notebook.run("%%distributed\nimport socket\nnode = socket.gethostname()\n"
                 "w = torch.full((2,), float(hvd.rank()))")  # fmt: skip
    with server.client("ann") as c:
        (s,) = c.get("/v1/sessions").json()["items"]
        first = slurm_job(c, s["id"])
        assert first.startswith("slurm:"), first
        parked = notebook.run("%dist_park")
        assert "parked session" in parked, parked
        assert c.get(f"/v1/sessions/{s['id']}").json()["state"] == "parked"
        deadline = time.monotonic() + 30
        while slurm.queue() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slurm.queue() == [], "the allocation outlived the park"
        assert not any(slurm.leftovers().values())
        back = notebook.run("%%distributed --all\nprint('rank', hvd.rank(), node, w.tolist())")
        assert f"resumed session {s['id']}" in back, back
        for rank, node in enumerate(["n1", "n1", "n2", "n2"]):
            assert f"rank {rank} {node} [{float(rank)}, {float(rank)}]" in back, back
        second = slurm_job(c, s["id"])
        assert second.startswith("slurm:") and second != first
    notebook.run("%dist_stop")
