"""Elastic ``hora run``: real workers, real SIGKILLs, repair instead of restart.

Each test runs ``hora run -np N --min-np A --max-np B -- python _elastic_train.py OUT --die
...`` (the script kills or fails the worker it is told to, at the step it is told to) and
checks, from the files the workers write at the end:

* the job succeeded (exit 0) and the survivors finished in the processes ``hora run``
  started (their pids, from its log, are the ones that wrote the results), having gone
  through a reset (their memory was kept: ``steps_run`` counts the replayed steps too);
* the final weights equal those of one process training alone without failures: a step
  covers the same 12 samples at any world size (ElasticSampler, deterministic order), so
  a world that went back to its last commit and on with other members lands on the same
  weights; no committed progress is lost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).with_name("_elastic_train.py")
TIMEOUT = 150


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "RANK", "WORLD_SIZE", "MASTER_", "HORA_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HORA_TIMEOUT="30")
    return env


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    """The weights of one process training alone, without failures (here, no launcher)."""
    spec = importlib.util.spec_from_file_location("_elastic_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [torch.tensor(w) for w in module.reference()]


def _run(out: Path, flags: list[str], *script_args: str) -> tuple[subprocess.CompletedProcess[str],
                                                                dict[str, Any], dict[str, int]]:
    argv = [sys.executable, "-m", "hora.cli", "run", *flags, "--",
            sys.executable, str(SCRIPT), str(out), *script_args]  # fmt: skip
    res = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                         cwd=out)  # fmt: skip
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("w*.json")}
    started = {m[0]: int(m[1]) for m in re.findall(r"started worker (w\d+) \(pid (\d+)\)",
                                                    res.stderr)}  # fmt: skip
    return res, results, started


def _check(res: subprocess.CompletedProcess[str], results: dict[str, Any], started: dict[str, int],
           survivors: list[str], reference: list[torch.Tensor]) -> None:
    log = f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert res.returncode == 0, log
    for wid in survivors:
        assert wid in results, f"survivor {wid} wrote no result\n{log}"
        r = results[wid]
        assert r["pid"] == started[wid], f"{wid} is not the process hora run started\n{log}"
        assert r["resets"] >= 1 and r["step"] == 16, (r, log)
    for wid, r in results.items():
        for got, want in zip(r["weights"], reference, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5,
                                       msg=f"{wid}'s weights differ from the reference")


def test_a_sigkilled_worker_is_replaced_and_survivors_keep_their_processes(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """SIGKILL of w1 at step 4: w0 and w2 go on at size 2 from the last commit; the
    replacement w3 joins at a later commit (the script waits for it there)."""
    flags = ["-np", "3", "--min-np", "2", "--max-np", "3"]
    res, results, started = _run(tmp_path, flags, "--die", "w1@4:kill", "--sleep", "0.05",
                                 "--wait-size", "3")  # fmt: skip
    _check(res, results, started, ["w0", "w2"], reference)
    assert "w1" not in results and "w3" in results, res.stderr[-3000:]
    assert results["w0"]["sizes"] == [3, 2, 3], results["w0"]
    assert re.search(r"generation \d+: 2 workers \(worker w1 on localhost exited with code 137",
                     res.stderr)  # fmt: skip
    assert "worker w3 joined" in res.stderr


def test_two_failures_in_a_row_a_process_group_kill_then_an_exception(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """w1's whole process group is SIGKILLed at step 3, then w2 raises at step 6: w0 goes on
    (alone if need be, --min-np 1) and replacements join."""
    flags = ["-np", "3", "--min-np", "1", "--max-np", "3"]
    res, results, started = _run(tmp_path, flags, "--die", "w1@3:killpg", "--die", "w2@6:raise",
                                 "--sleep", "0.05")  # fmt: skip
    _check(res, results, started, ["w0"], reference)
    assert "w1" not in results and "w2" not in results
    assert "injected failure of w2 at 6" in res.stderr
    assert results["w0"]["resets"] >= 2, results["w0"]


def test_a_failure_while_the_world_re_forms(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """w1 dies at step 3; then w0, rank 0 of the new world (its store's host), dies in its
    reset callback, before the sync: w2 re-forms the world once more and goes on."""
    flags = ["-np", "3", "--min-np", "1", "--max-np", "3"]
    res, results, started = _run(tmp_path, flags, "--die", "w1@3:kill", "--die", "w0@reset:kill",
                                 "--sleep", "0.05")  # fmt: skip
    _check(res, results, started, ["w2"], reference)
    assert "w0" not in results and "w1" not in results
    assert results["w2"]["resets"] >= 2, results["w2"]


def _discovery(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "discover.py"
    script.write_text(f"#!{sys.executable}\nimport os, time\nout = {str(tmp_path)!r}\n{body}")
    script.chmod(0o755)
    return script


def test_hosts_added_then_removed_by_the_discovery_script(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """A second host appears at the first commit (the world grows at a later one: the script
    waits for it there) and goes 4 steps after (its worker leaves at a commit, exit 0):
    nothing is lost, nobody fails."""
    script = _discovery(tmp_path, (
        "p, grew = os.path.join(out, 'progress'), os.path.join(out, 'grew')\n"
        "step, size = map(int, open(p).read().split()) if os.path.exists(p) else (0, 2)\n"
        "if size == 3 and not os.path.exists(grew):\n    open(grew, 'w').write(str(step))\n"
        "gone = os.path.exists(grew) and step >= int(open(grew).read()) + 4\n"
        "print('localhost:2')\n"
        "if step >= 2 and not gone:\n    print('127.0.0.1:1')\n"))  # fmt: skip
    flags = ["-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(script)]
    res, results, started = _run(tmp_path, flags, "--sleep", "0.2", "--wait-size", "3")
    _check(res, results, started, ["w0", "w1"], reference)
    assert results["w0"]["sizes"] == [2, 3, 2], (results["w0"], res.stderr[-3000:])
    assert "worker w2 left (removed) with code 0" in res.stderr
    assert "exited with code" not in res.stderr


@pytest.mark.parametrize(("max_np", "first"), [(None, 3), ("2", 2)])
def test_the_first_world_takes_every_slot_offered_up_to_max_np(
    tmp_path: Path, max_np: str | None, first: int
) -> None:
    """Horovod's rule: a discovery script printing localhost:3 with -np 2 starts 3 workers at
    once (no --max-np: no limit), in one first world; --max-np 2 starts 2."""
    script = _discovery(tmp_path, "print('localhost:3')\n")
    flags = ["-np", "2", "--host-discovery-script", str(script),
             *(["--max-np", max_np] if max_np else [])]  # fmt: skip
    res, results, started = _run(tmp_path, flags, "--sleep", "0.05")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(started) == [f"w{i}" for i in range(first)], res.stderr[-3000:]
    assert {wid: r["sizes"] for wid, r in results.items()} == {w: [first] for w in started}
    assert re.findall(r"started worker w\d \(pid \d+\) on \S+: (\w+)", res.stderr) == [
        "start"] * first


def test_the_job_starts_once_np_slots_are_offered(tmp_path: Path) -> None:
    """Horovod's rule: -np 3 waits for 3 slots (the script offers 2 for its first 2 s), then
    starts all 3 in one first world, although --min-np 1 would allow a smaller one."""
    script = _discovery(tmp_path, (
        "t = os.path.join(out, 'first-asked')\n"
        "if not os.path.exists(t):\n    open(t, 'w').close()\n"
        "print('localhost:3' if time.time() - os.path.getmtime(t) > 2 else 'localhost:2')\n"))
    flags = ["-np", "3", "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(script)]
    res, results, started = _run(tmp_path, flags, "--sleep", "0.05")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(started) == ["w0", "w1", "w2"], res.stderr[-3000:]
    assert re.findall(r"started worker w\d \(pid \d+\) on \S+: (\w+)", res.stderr) == [
        "start"] * 3  # none started before the third slot was offered
    assert {wid: r["sizes"] for wid, r in results.items()} == {w: [3] for w in started}


def test_below_min_np_survivors_wait_for_capacity(
    tmp_path: Path, reference: list[torch.Tensor]
) -> None:
    """horovod#3494: with --min-np 2, the survivor of a 2-worker job waits (no deadlock, no
    abort) while the discovery script offers one slot, and goes on once it offers two."""
    script = _discovery(tmp_path, (
        "d = os.path.join(out, 'died')\n"
        "short = os.path.exists(d) and time.time() - os.path.getmtime(d) < 4\n"
        "print('localhost:1' if short else 'localhost:2')\n"))  # fmt: skip
    flags = ["-np", "2", "--min-np", "2", "--max-np", "2", "--host-discovery-script", str(script)]
    res, results, started = _run(tmp_path, flags, "--die", "w1@4:capacity", "--sleep", "0.05")
    _check(res, results, started, ["w0"], reference)
    assert "waiting for capacity (1 of --min-np 2 workers)" in res.stderr
    assert "capacity returned" in res.stderr
    assert results["w0"]["sizes"] == [2, 2], results["w0"]


def test_the_reset_limit_stops_the_job(tmp_path: Path) -> None:
    """--reset-limit 0: the first re-formed world is one too many; the job fails, saying so."""
    flags = ["-np", "2", "--min-np", "1", "--reset-limit", "0"]
    res, results, _ = _run(tmp_path, flags, "--die", "w1@3:kill", "--sleep", "0.05")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "reset limit 0 reached (1 re-formed world); stopping the job" in res.stderr
    assert results == {}
