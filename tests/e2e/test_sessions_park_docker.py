"""A docker session parks and resumes (issue 28): engines in containers of ``hora:cpu``.

A real kernel (nbclient) asks a real service for a session on the docker runtime
(``%dist_start --runtime docker --image hora:cpu``); its engine runs in a container as the
job account, on the host's network, with the working directory mounted. ``%dist_park`` has the
engine write its part there (in ``.hora-parked``, given to the containers' account), the
container goes and its slot is freed; the next cell starts a new container whose engine reads
the part back. A Docker engine and ``hora:cpu`` built from this checkout are needed (CI has
both; the tests fail, saying why, without them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e._notebook import Notebook, close_checked
from e2e._notebooks_procs import new_tag, tagged_env
from helpers.docker_engine import Engine
from helpers.service_server import ServiceServer

pytestmark = pytest.mark.timeout(900)


def test_a_docker_session_parks_and_resumes_in_a_new_container(
    tmp_path: Path, docker_engine: Engine
) -> None:
    env = {
        "HORA_DOCKER_HOST": docker_engine.host, "HORA_DOCKER_PULL": "never",
        "HORA_DOCKER_SHM_SIZE": "64m", "HORA_WORK_ROOT": str(tmp_path),
        "HORA_SESSION_LEASE_S": "30",
    }  # fmt: skip
    tmp_path.chmod(0o755)
    tag = new_tag()
    with ServiceServer(tmp_path, {"ann": False, "root": True}, cpu_slots=1, env=env) as srv:
        kernel_env = tagged_env(tag)
        kernel_env.update(HORA_URL=srv.url, HORA_TOKEN=srv.tokens["ann"],
                          HORA_CONFIG=str(tmp_path / "no-config"))  # fmt: skip
        nb = Notebook(kernel_env, tmp_path)
        nb.client.timeout = 600
        try:
            nb.run("%load_ext hora")
            out = nb.run("%dist_start -n 1 --runtime docker --image hora:cpu --timeout 60 "
                         "--start-timeout 300 --no-preflight")  # fmt: skip
            assert "1 engines ready" in out, out
            nb.run("%%distributed\nimport socket\nwhere = socket.gethostname()\n"
                   "model = torch.nn.Linear(3, 2)\nw = model.weight.detach().clone()")  # fmt: skip
            with srv.client("ann") as c:
                first = c.get("/v1/jobs").json()["items"][0]["container_id"]
                assert first, "the session runs in a container"
                assert "parked session" in nb.run("%dist_park")
                (s,) = [x for x in c.get("/v1/sessions").json()["items"] if x["state"] == "parked"]
                assert Path(s["park"]["directory"]).is_relative_to(tmp_path / ".hora-parked")
                back = nb.run("%%distributed\nprint(torch.equal(model.weight, w), "
                              "where != socket.gethostname() or 'same host')")  # fmt: skip
                assert f"resumed session {s['id']}" in back and "True" in back, back
                again = c.get(f"/v1/jobs/{s['id']}").json()
                assert again["state"] == "running" and again["attempt"] == 2
                assert again["container_id"] and again["container_id"] != first
            nb.run("%dist_stop")
        finally:
            close_checked(nb, tag)
