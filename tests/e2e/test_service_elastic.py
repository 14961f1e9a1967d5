"""Elastic jobs in the service: a real uvicorn, real SQLite, real workers on gloo, real SIGKILLs.

An elastic job (``elastic: {min_workers, max_workers}``) runs ``hora run``'s elastic driver
under the rank shim; the service offers it slots through a file and reads each new world
from the driver's log. The training script is tests/dist/_elastic_train.py: whatever the
world size and however often it re-forms, its final weights equal those of one process
training alone from the same commits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.service_server import REPO, ServiceServer, wait_state

SCRIPT = REPO / "tests" / "dist" / "_elastic_train.py"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(
        tmp_path_factory.mktemp("svc-elastic"), {"ann": False, "root": True}, cpu_slots=3
    ) as srv:
        yield srv


@pytest.fixture
def ann(server: ServiceServer) -> Iterator[httpx.Client]:
    with server.client("ann") as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    """The weights of one process training alone, without failures."""
    spec = importlib.util.spec_from_file_location("_elastic_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [torch.tensor(w) for w in module.reference()]


def _submit(c: httpx.Client, out: Path, *args: str, **fields: Any) -> dict[str, Any]:
    body = {
        "command": [sys.executable, str(SCRIPT), str(out), *args],
        "elastic": {"min_workers": 2, "max_workers": 3},
        "env": {"HORA_TIMEOUT": "30"},
        **fields,
    }
    r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _until(c: httpx.Client, job_id: int, ok: Callable[[dict[str, Any]], bool],
           what: str, timeout: float = 90.0) -> dict[str, Any]:  # fmt: skip
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if ok(job):
            return job
        assert job["state"] not in ("failed", "cancelled", "succeeded"), (what, job)
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id}: {what} not seen in {timeout}s: {job}")


def _step(out: Path) -> int:
    try:
        return int((out / "progress").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return -1


def _results(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("w*.json")}


def _same_weights(results: dict[str, dict[str, Any]], reference: list[torch.Tensor]) -> None:
    for wid, r in results.items():
        assert r["step"] == 16, (wid, r)
        for got, want in zip(r["weights"], reference, strict=True):
            torch.testing.assert_close(
                torch.tensor(got), want, rtol=1e-5, atol=1e-5, msg=f"{wid}'s weights differ"
            )


def test_a_sigkilled_rank_is_replaced_and_the_survivors_keep_their_processes(
    server: ServiceServer, ann: httpx.Client, tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """Min 2, max 3 on 3 free slots: it starts with 3; w1 is SIGKILLed after a commit; w0
    and w2 go on in the same processes, the replacement w3 joins at a commit (the script
    waits there for the world to be 3 again), and the weights are those of a run alone."""
    job = _submit(ann, tmp_path, "--sleep", "0.4", "--wait-size", "3")
    job = _until(ann, job["id"], lambda j: (j.get("elastic") or {}).get("size") == 3, "3 workers")
    first = {m["worker"]: m["pid"] for m in job["elastic"]["members"]}
    assert sorted(first) == ["w0", "w1", "w2"], job["elastic"]
    assert job["elastic"]["slots"] == 3 and len(job["slots"]) == 3
    deadline = time.monotonic() + 60
    while _step(tmp_path) < 2:  # a commit happened: the kill loses uncommitted work only
        assert time.monotonic() < deadline, "no commit within 60 s"
        time.sleep(0.05)
    os.kill(first["w1"], signal.SIGKILL)

    done = wait_state(ann, job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
    log = ann.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
    assert done["state"] == "succeeded", (done, log[-4000:])
    results = _results(tmp_path)
    assert sorted(results) == ["w0", "w2", "w3"], log[-4000:]
    for wid in ("w0", "w2"):  # the survivors finished in the processes that started
        assert results[wid]["pid"] == first[wid] and results[wid]["resets"] >= 1, results[wid]
    _same_weights(results, reference)

    elastic = done["elastic"]
    assert (elastic["min_workers"], elastic["max_workers"], elastic["size"]) == (2, 3, 3)
    sizes = [(c["size"], c["reason"]) for c in elastic["history"] if c["generation"]]
    assert sizes[0] == (3, "start"), sizes
    lost = [i for i, (n, why) in enumerate(sizes) if n == 2 and "w1" in why]
    assert lost, sizes
    assert any(n == 3 and "w3 joined" in why for n, why in sizes[lost[0] :]), sizes
    assert {m["worker"] for m in elastic["members"]} == {"w0", "w2", "w3"}


def test_it_starts_with_what_is_free_and_grows_when_a_slot_frees(
    server: ServiceServer, ann: httpx.Client, tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """One of the 3 slots is held by another job: the elastic job starts with 2; once that
    job ends the slot is offered to it and the world grows to 3 at a commit."""
    blocker = ann.post("/v1/jobs", json={"command": [sys.executable, "-c",
                                                     "import time; time.sleep(120)"]})  # fmt: skip
    assert blocker.status_code == 201, blocker.text
    wait_state(ann, blocker.json()["id"], ("running",))
    job = _submit(ann, tmp_path, "--sleep", "0.2", "--wait-size", "3", "--say")
    job = _until(ann, job["id"], lambda j: (j.get("elastic") or {}).get("size") == 2, "2 workers")
    assert len(job["slots"]) == 2 and job["elastic"]["slots"] == 2
    table = _hora_jobs(server)
    assert "size 2/2..3" in table, table
    _every_live_rank_s_log_is_shown(server, ann, job)
    ann.post(f"/v1/jobs/{blocker.json()['id']}/cancel")

    done = wait_state(ann, job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
    log = ann.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
    assert done["state"] == "succeeded", (done, log[-4000:])
    history = done["elastic"]["history"]
    grants = [c for c in history if c["generation"] is None]
    assert [c["slots"] for c in grants] == [2, 3], history
    assert [c["size"] for c in history if c["generation"]][-1] == 3, history
    _same_weights(_results(tmp_path), reference)


def test_it_shrinks_at_a_commit_for_a_job_of_higher_priority_then_grows_back(
    server: ServiceServer, ann: httpx.Client, tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """A low-priority elastic job holds the 3 slots; a normal job needs one: the elastic job
    gives one back at its next commit (its newest worker leaves, the others go on), the job
    runs, and the slot comes back to the elastic job, which grows to 3 again."""
    job = _submit(ann, tmp_path, "--sleep", "0.4", "--wait-size", "3", priority="low")
    job = _until(ann, job["id"], lambda j: (j.get("elastic") or {}).get("size") == 3, "3 workers")
    first = {m["worker"]: m["pid"] for m in job["elastic"]["members"]}
    deadline = time.monotonic() + 60
    while _step(tmp_path) < 2:
        assert time.monotonic() < deadline, "no commit within 60 s"
        time.sleep(0.05)
    other = ann.post("/v1/jobs", json={"command": [sys.executable, "-c", "print('in')"]})
    assert other.status_code == 201, other.text
    assert wait_state(ann, other.json()["id"], ("succeeded",), timeout=60)

    done = wait_state(ann, job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
    log = ann.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
    assert done["state"] == "succeeded", (done, log[-4000:])
    results = _results(tmp_path)
    for wid in ("w0", "w1"):  # the oldest stay; the newest (w2) left at a commit
        assert results[wid]["pid"] == first[wid], results[wid]
    assert "w2" not in results, log[-4000:]
    _same_weights(results, reference)
    history = done["elastic"]["history"]
    reasons = [c["reason"] for c in history]
    shrink = next(i for i, why in enumerate(reasons) if why.startswith("shrinking to 2"))
    assert f"job {other.json()['id']}" in reasons[shrink], reasons
    gave = next(i for i, why in enumerate(reasons) if why.startswith("gave back slot"))
    assert any(c["size"] == 2 and c["generation"] for c in history[shrink:gave]), history
    assert [c["size"] for c in history if c["generation"]][-1] == 3, history


def test_a_restarted_service_adopts_the_elastic_job_and_reads_on(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """The service is SIGKILLed while an elastic job runs: the driver and its workers live
    on; the restarted service re-adopts the driver, and a worker killed after the restart is
    replaced and shows in the history after those recorded before the crash."""
    out = tmp_path / "out"
    out.mkdir()
    with ServiceServer(tmp_path / "svc", {"ann": False, "root": True}, cpu_slots=3) as srv:
        with srv.client("ann") as c:
            job = _submit(c, out, "--sleep", "0.4", "--wait-size", "3")
            job = _until(c, job["id"], lambda j: (j.get("elastic") or {}).get("size") == 3, "3")
        first = {m["worker"]: m["pid"] for m in job["elastic"]["members"]}
        srv.crash()
        srv.restart()
        with srv.client("ann") as c:
            assert c.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
            deadline = time.monotonic() + 60
            while _step(out) < 2:
                assert time.monotonic() < deadline, "no commit within 60 s"
                time.sleep(0.05)
            os.kill(first["w1"], signal.SIGKILL)
            done = wait_state(c, job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
            log = c.get(f"/v1/jobs/{job['id']}/logs", params={"rank": 0}).text
        assert done["state"] == "succeeded", (done, log[-4000:])
        results = _results(out)
        assert results["w0"]["pid"] == first["w0"] and results["w2"]["pid"] == first["w2"]
        _same_weights(results, reference)
        sizes = [(c["size"], c["reason"]) for c in done["elastic"]["history"] if c["generation"]]
        assert sizes[0] == (3, "start") and sizes[-1][0] == 3, sizes
        assert any(n == 2 and "w1" in why for n, why in sizes), sizes


def _hora(server: ServiceServer, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
    env.update(HORA_URL=server.url, HORA_TOKEN=server.tokens["ann"], HOME=str(server.data_dir))
    return subprocess.run([sys.executable, "-m", "hora.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def _hora_jobs(server: ServiceServer) -> str:
    res = _hora(server, "jobs")
    assert res.returncode == 0, res.stderr
    return res.stdout


def _every_live_rank_s_log_is_shown(
    server: ServiceServer, ann: httpx.Client, job: dict[str, Any]
) -> None:
    """At size 2 (min 2, max 3): ranks 0 and 1 are its current world's, each its worker's
    lines (read from the driver's log, prefixes gone; rank 0 has the driver's own lines
    too), in the API, ``hora logs --rank`` and the dashboard's rows; rank 2 does not exist
    yet. The preflight's figures are the service's, in no log."""
    jid = job["id"]
    at = {m["rank"]: m["worker"] for m in job["elastic"]["members"]}
    _until(ann, jid, lambda j: f"{at[1]} rank 1 step" in ann.get(
        f"/v1/jobs/{jid}/logs", params={"rank": 1}).text, "rank 1's commits in its log")
    for rank in (0, 1):
        text = ann.get(f"/v1/jobs/{jid}/logs", params={"rank": rank}).text
        said = [line for line in text.splitlines() if " step " in line]
        assert said and all(line.startswith(f"{at[rank]} rank ") for line in said), text
        assert "<stdout>:" not in text and "HORA_PREFLIGHT" not in text, text
        cli = _hora(server, "logs", "--rank", str(rank), str(jid))
        assert cli.returncode == 0 and f"{at[rank]} rank {rank} step" in cli.stdout, cli
    assert "hora run: generation" in ann.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}).text
    beyond = ann.get(f"/v1/jobs/{jid}/logs", params={"rank": 2})
    assert beyond.status_code == 422, beyond.text
    assert "has ranks 0..1 now; rank 2 does not exist" in beyond.text, beyond.text
    cli = _hora(server, "logs", "--rank", "2", str(jid))
    assert cli.returncode == 1 and "has ranks 0..1 now" in cli.stderr, cli
    with httpx.Client(base_url=server.url, timeout=30) as page:  # what the dashboard reads
        assert page.post("/ui/login", json={"token": server.tokens["ann"]}).status_code == 200
        (row,) = [r for r in page.get("/ui/api/jobs").json()["items"] if r["id"] == jid]
    assert (row["workers"], row["size"]) == (2, "2/2..3"), row
    assert _until(ann, jid, lambda j: j["preflight"] is not None, "preflight figures")


@pytest.mark.parametrize(
    ("elastic", "extra", "field"),
    [
        ({"min_workers": 3, "max_workers": 2}, {}, ["elastic", "max_workers"]),
        ({"min_workers": 0, "max_workers": 2}, {}, ["elastic", "min_workers"]),
        ({"min_workers": 2, "max_workers": 4}, {}, ["elastic", "max_workers"]),  # 3 slots here
        ({"min_workers": 2}, {}, ["elastic", "max_workers"]),
        ({"min_workers": 2, "max_workers": 3}, {"workers": 3}, ["workers"]),
        ({"min_workers": 2, "max_workers": 3, "most": 9}, {}, ["elastic", "most"]),
    ],
)
def test_bad_elastic_fields_are_a_422_naming_the_field(
    ann: httpx.Client, elastic: dict[str, int], extra: dict[str, Any], field: list[str]
) -> None:
    r = ann.post("/v1/jobs", json={"command": ["true"], "elastic": elastic, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", *field], r.text
