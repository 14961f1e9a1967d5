"""``/metrics`` has label sets bounded by the service's own state, whatever jobs report (issue 25).

The third red-team round took the preflight gauge from 1,500 to 7,500 series with 5 jobs:
each rank's preflight names its host, and the service kept every host name a job invented.
Here jobs of a real ``hora serve`` as root in multi-user mode (OS accounts made by hora's own
useradd path, the fixtures of :mod:`test_service_isolation`) replace ``socket.gethostname``
before ``hvd.init()``, so every rank's preflight names a host of its own invention, then
end. The exposition is read back with ``prometheus_client``'s parser: no series carries an
invented host, the preflight gauge holds only this machine (from an honest job) and the
paths a preflight measures, and nothing the ended jobs reported outlives them. Each job's
own page still shows what it reported (the job's data, to the job).
"""

from __future__ import annotations

import socket
from pathlib import Path

import hora
import pytest
import test_service_isolation as iso
import torch
from helpers.service_server import wait_state
from hora.spec import JobState
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(600)  # torch jobs of OS accounts, one after the other

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
PYTHONPATH = f"{Path(hora.__file__).parents[1]}:{Path(torch.__file__).parents[1]}"

TRAIN = """\
import secrets, socket, sys
if sys.argv[1:] == ["invent"]:  # every rank names a host of its own
    name = "invented-" + secrets.token_hex(6)
    socket.gethostname = lambda: name
import torch
import hora.torch as hvd
torch.set_num_threads(1)
hvd.init()
hvd.shutdown()
print("done", flush=True)
"""


def series(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Each sample name's label sets, as prometheus_client's parser reads the exposition."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).add(tuple(sorted(s.labels.items())))
    return out


def test_invented_hosts_and_ended_jobs_leave_no_series(
    base: Path, accounts: dict[str, int]
) -> None:
    ann = next(iter(accounts))
    work = iso.work_dir(base)
    (work / "train.py").write_text(TRAIN)
    with iso.serve(base, accounts) as srv, srv.client(ann) as a:
        body = {"command": [iso.JOB_PY, "train.py"], "workers": 2, "working_dir": ".",
                "env": {"PYTHONPATH": PYTHONPATH, "HORA_TIMEOUT": "120"}}  # fmt: skip
        ids = [iso.submit(a, **{**body, "command": [*body["command"], "invent"]})
               for _ in range(2)] + [iso.submit(a, **body)]  # fmt: skip
        *hostile, honest = [wait_state(a, j, ("succeeded", "failed"), timeout=400) for j in ids]
        assert all(j["state"] == "succeeded" for j in [*hostile, honest]), [*hostile, honest]
        text = a.get("/metrics").text
    for job in hostile:  # the service read each job's figures: they name invented hosts
        hosts = {r["host"] for p in job["preflight"]["paths"] for r in p["ranks"]}
        assert len(hosts) == 2 and all(h.startswith("invented-") for h in hosts), hosts
    found = series(text)
    assert "invented-" not in text
    gauge = found["hora_preflight_bandwidth_gbps"]
    assert {dict(labels)["node"] for labels in gauge} == {socket.gethostname()}, gauge
    assert {dict(labels)["path"] for labels in gauge} <= {"gloo", "nccl", "mpi", "ucc", "shm"}
    for name, label_sets in found.items():  # nothing names a job, or grew with the jobs
        for labels in label_sets:
            assert not {k for k, _ in labels} & {"job", "job_id", "id"}, (name, labels)
    assert len(found["hora_jobs"]) == len(JobState)  # one series per state, whatever ran
