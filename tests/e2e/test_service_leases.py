"""One holder per slot on a machine: real services, a real kernel, one lease directory.

Every process here shares the test's own lease directory (``HORA_LEASE_DIR``, see
tests/conftest.py), as every hora on one machine shares the machine's. Checked with real
uvicorn processes on real SQLite files, real rank processes and a real Jupyter kernel with
real engines: a second service on a data directory is refused at once, naming the running
one, and leaves ``~/.hora/config`` alone; two services with data directories of their own
never run jobs on one slot at once (the second one's job waits, saying who holds the slots,
and runs when they are free); the leases outlive a restart of the service while its job runs,
and a holder killed with SIGKILL (a service with its ranks, a kernel with its engines) leaves
no lease behind; kernel-local engines and a service never share a CPU slot or a GPU (a fake
``nvidia-smi`` stands in for the GPUs, which this machine has not).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from _magics_util import wait_gone
from helpers.service_server import ServiceServer, free_port, wait_state
from jupyter_client.manager import KernelManager, start_new_kernel

PY = sys.executable
pytestmark = pytest.mark.timeout(300)

GATE = """\
import pathlib, sys, time
d = pathlib.Path(sys.argv[1])
print("ready", flush=True)
while not (d / "release").exists():
    time.sleep(0.05)
"""

FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-gpu=index,uuid*) printf '0, GPU-aaaa\\n1, GPU-bbbb\\n' ;;
  *query-gpu*) printf '0, Fake GPU\\n1, Fake GPU\\n' ;;
  *query-compute-apps*) ;;
  *) exit 2 ;;
esac
"""


class Gates:
    """Jobs that run until their gate opens: ``submit(c, "a")`` then ``open("a")``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.script = root / "gate.py"
        self.script.write_text(GATE)

    def submit(self, c: httpx.Client, name: str, workers: int = 2) -> int:
        (self.root / name).mkdir()
        body = {"command": [PY, str(self.script), str(self.root / name)], "workers": workers}
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def open(self, name: str) -> None:
        (self.root / name / "release").touch()


@pytest.fixture
def gates(tmp_path: Path) -> Gates:
    return Gates(tmp_path)


def waits_for(c: httpx.Client, job_id: int, needle: str, timeout: float = 60) -> str:
    """The queued job's reason once it names ``needle``; fails if the job starts meanwhile."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "queued", f"job {job_id} started on slots another holds: {job}"
        reason = (job.get("queue") or {}).get("reason") or ""
        if needle in reason:
            return str(reason)
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} waits, but its reason never named {needle!r}: {job}")


def stays_queued(c: httpx.Client, job_id: int, passes: int = 20) -> None:
    """The job is still queued over ``passes`` looks (each after the monitor's interval)."""
    for _ in range(passes):
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "queued", f"job {job_id} started on slots another holds: {job}"
        time.sleep(0.1)


def held_by(c: httpx.Client) -> dict[str, str | None]:
    """Slot name -> who holds it outside this service (``/v1/gpus``)."""
    return {s["name"]: s.get("holder") for s in c.get("/v1/gpus").json()}


def pool_holders(srv: ServiceServer) -> dict[str, Any]:
    """Slot name -> its holder as the dashboard's pool shows it (signed in as ann)."""
    with httpx.Client(base_url=srv.url, timeout=30) as web:
        assert web.post("/ui/login", json={"token": srv.tokens["ann"]}).status_code == 200
        slots = web.get("/ui/api/pool").json()["nodes"][0]["slots"]
    return {s["name"]: s["holder"] for s in slots}


def lease_pids(lease_dir: Path) -> dict[str, int]:
    """Lease name -> the pid its file names (what any hora on the machine would read)."""
    out = {}
    for f in sorted(lease_dir.glob("*.lock")):
        text = f.read_text()
        if text.strip():
            out[f.stem] = int(json.loads(text)["pid"])
    return out


def two_services(stack: ExitStack, tmp_path: Path, **kw: Any) -> tuple[ServiceServer, ...]:
    a = stack.enter_context(ServiceServer(tmp_path / "a", cpu_slots=2, **kw))
    b = stack.enter_context(ServiceServer(tmp_path / "b", cpu_slots=2, **kw))
    return a, b


# --- one service per data directory ---------------------------------------------------------


def _up_env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HORA_", "JUPYTER")) or k == "HORA_LEASE_DIR"
    }
    env.update({"HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return env


def _wait_line(path: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text(errors="replace"):
        assert proc.poll() is None, path.read_text(errors="replace")
        assert time.monotonic() < deadline, path.read_text(errors="replace")
        time.sleep(0.2)


def test_a_second_service_on_a_data_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    home, data = tmp_path / "home", tmp_path / "data"
    home.mkdir()
    env = _up_env(home)
    port = free_port()
    up = [PY, "-m", "hora.cli", "up", "--no-lab", "--data-dir", str(data), "--cpu-slots", "2"]
    out = tmp_path / "first.log"
    with out.open("wb") as log:
        first = subprocess.Popen(
            [*up, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        _wait_line(out, "Press Ctrl-C to stop", first, 120)
        config = (home / ".hora" / "config").read_bytes()
        url = f"http://127.0.0.1:{port}"
        for argv in ([*up, "--port", str(free_port())],
                     [PY, "-m", "hora.cli", "serve", "--data-dir", str(data),
                      "--port", str(free_port())]):  # fmt: skip
            second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            assert second.returncode == 1, second.stdout + second.stderr
            assert f"pid {first.pid}" in second.stderr and url in second.stderr, second.stderr
            assert str(data) in second.stderr and "Traceback" not in second.stderr
        assert (home / ".hora" / "config").read_bytes() == config
        urls = subprocess.run(
            [PY, "-m", "hora.cli", "up", "--print-urls", "--data-dir", str(data)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert urls.returncode == 0 and f"hora service: {url}" in urls.stdout, urls.stderr
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 0, out.read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)


# --- two services, data directories of their own --------------------------------------------


def test_two_services_never_hold_one_slot_at_once(tmp_path: Path, gates: Gates) -> None:
    with ExitStack() as stack:
        a, b = two_services(stack, tmp_path)
        ca, cb = stack.enter_context(a.client("ann")), stack.enter_context(b.client("ann"))
        ja = gates.submit(ca, "ga")
        wait_state(ca, ja, ("running",))
        jb = gates.submit(cb, "gb")
        reason = waits_for(cb, jb, f"pid {a.proc.pid}")
        assert a.url in reason and "0 of 2 free" in reason, reason
        shown = held_by(cb)
        assert all(h is not None and a.url in h for h in shown.values()), shown
        pool = pool_holders(b)  # the dashboard's pool: held, and by whom
        assert all(h is not None and h["what"] == shown[n] for n, h in pool.items()), pool
        gates.open("ga")
        wait_state(ca, ja, ("succeeded",))
        wait_state(cb, jb, ("running",))
        assert all(h is not None and b.url in h for h in held_by(ca).values()), held_by(ca)
        ja2 = gates.submit(ca, "ga2", workers=1)  # now A's job waits for B's
        assert b.url in waits_for(ca, ja2, f"pid {b.proc.pid}")
        gates.open("gb")
        wait_state(cb, jb, ("succeeded",))
        wait_state(ca, ja2, ("running",))
        gates.open("ga2")
        wait_state(ca, ja2, ("succeeded",))


def test_leases_outlive_a_restart_of_the_service_while_its_job_runs(
    tmp_path: Path, gates: Gates, _own_lease_dir: Path
) -> None:
    with ExitStack() as stack:
        a, b = two_services(stack, tmp_path)
        cb = stack.enter_context(b.client("ann"))
        with a.client("ann") as ca:
            ja = gates.submit(ca, "ga")
            wait_state(ca, ja, ("running",))
        jb = gates.submit(cb, "gb")
        waits_for(cb, jb, f"pid {a.proc.pid}")
        old = a.proc.pid
        a.stop()  # `hora serve` stops; its job's ranks run on, and hold the slots
        stays_queued(cb, jb)
        assert lease_pids(_own_lease_dir) == {"cpu0": old, "cpu1": old}
        a.restart()  # re-adopts the job: its leases now name the new service
        with a.client("ann") as ca:
            assert ca.get(f"/v1/jobs/{ja}").json()["state"] == "running"
            assert [s["job_id"] for s in ca.get("/v1/gpus").json()] == [ja, ja]
            waits_for(cb, jb, f"pid {a.proc.pid}")
            assert lease_pids(_own_lease_dir) == {"cpu0": a.proc.pid, "cpu1": a.proc.pid}
            gates.open("ga")
            wait_state(ca, ja, ("succeeded",))
        wait_state(cb, jb, ("running",))
        gates.open("gb")
        wait_state(cb, jb, ("succeeded",))


def test_kill_9_of_a_service_and_its_ranks_frees_their_leases(
    tmp_path: Path, gates: Gates
) -> None:
    with ExitStack() as stack:
        a, b = two_services(stack, tmp_path)
        cb = stack.enter_context(b.client("ann"))
        with a.client("ann") as ca:
            ja = gates.submit(ca, "ga")
            wait_state(ca, ja, ("running",))
        jb = gates.submit(cb, "gb")
        waits_for(cb, jb, f"pid {a.proc.pid}")
        a.crash()  # kill -9 of the service alone: its ranks still run on the slots
        stays_queued(cb, jb)
        assert "not running" in waits_for(cb, jb, f"pid {a.proc.pid}")
        for rank in (0, 1):  # and now the ranks too, shims and all, with no clean-up
            pid = int((a.data_dir / "logs" / str(ja) / "1" / f"rank{rank}.pid").read_text())
            os.killpg(pid, signal.SIGKILL)
        wait_state(cb, jb, ("running",))
        gates.open("gb")
        wait_state(cb, jb, ("succeeded",))
        a.restart()  # A finds its job's ranks gone (and lets the slots go)
        with a.client("ann") as ca:
            assert wait_state(ca, ja, ("failed",))["state"] == "failed"


# --- a service and kernel-local engines -----------------------------------------------------


class Kernel:
    """A real Jupyter kernel (jupyter_client) that runs magics and returns their output."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.km: KernelManager
        self.km, self.kc = start_new_kernel(
            kernel_name="python3", startup_timeout=60, env={**os.environ, **(env or {})}
        )

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 120) -> tuple[str, str]:
        """``(status, text)``: the reply's status, and what the cell printed or raised."""
        parts: list[str] = []

        def keep(msg: dict[str, Any]) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                parts.append(content["text"])
            elif msg["msg_type"] == "error":
                parts.append(f"{content['ename']}: {content['evalue']}")

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=keep)
        return reply["content"]["status"], "".join(parts)

    def engine_pids(self) -> list[int]:
        status, out = self.run("from hora import magics; print(magics._MAGICS.cluster.pids)")
        assert status == "ok", out
        return [int(p) for p in out.strip().strip("[]").split(",") if p.strip()]

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernels() -> Iterator[list[Kernel]]:
    started: list[Kernel] = []
    yield started
    for k in started:
        k.close()


def test_a_service_and_kernel_local_engines_never_share_a_cpu_slot(
    tmp_path: Path, gates: Gates, kernels: list[Kernel], _own_lease_dir: Path
) -> None:
    with ServiceServer(tmp_path / "a", cpu_slots=2) as a, a.client("ann") as ca:
        k = Kernel()
        kernels.append(k)
        status, out = k.run("%load_ext hora\n%dist_start --local -n 2 --timeout 20")
        assert status == "ok", out
        engines = k.engine_pids()
        assert lease_pids(_own_lease_dir) == {"cpu0": k.pid, "cpu1": k.pid}
        ja = gates.submit(ca, "ga")
        reason = waits_for(ca, ja, f"pid {k.pid}")
        assert "kernel" in reason, reason
        # kill -9 of the kernel and its engines, no clean-up: the slots are free again
        for pid in [k.pid, *engines]:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone([k.pid, *engines]) == []
        wait_state(ca, ja, ("running",))
        # the service holds cpu0 and cpu1 now: a new kernel's engines take other slots
        k2 = Kernel()
        kernels.append(k2)
        status, out = k2.run("%load_ext hora\n%dist_start --local -n 2 --timeout 20")
        assert status == "ok", out
        leases = lease_pids(_own_lease_dir)
        assert leases["cpu0"] == leases["cpu1"] == a.proc.pid, leases
        assert {n for n, p in leases.items() if p == k2.pid} == {"cpu2", "cpu3"}, leases
        status, out = k2.run("%dist_stop")
        assert status == "ok", out
        gates.open("ga")
        wait_state(ca, ja, ("succeeded",))


def test_kernel_local_engines_refuse_a_gpu_the_service_holds(
    tmp_path: Path, gates: Gates, kernels: list[Kernel]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    # both see two GPUs, 0 and 1: the service by hand, the kernel from the fake nvidia-smi
    gpus = {"HORA_GPUS": "2"}
    with ServiceServer(tmp_path / "a", env=gpus) as a, a.client("ann") as ca:
        ja = gates.submit(ca, "ga", workers=1)
        wait_state(ca, ja, ("running",))
        k = Kernel({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
        kernels.append(k)
        status, out = k.run("%load_ext hora\n%dist_start --local -n 2 --timeout 20")
        assert status == "error" and "NotEnoughGpusError" in out, out
        assert f"GPU 0 held by hora service pid {a.proc.pid}" in out and a.url in out, out
        assert "pass -n 1" in out, out
        status, out = k.run("%dist_start --local -n 1 --backend gloo --timeout 20")
        assert status == "ok", out
        jb = gates.submit(ca, "gb", workers=1)  # gpu1 is the kernel's now
        assert "kernel" in waits_for(ca, jb, f"pid {k.pid}")
        status, out = k.run("%dist_stop")
        assert status == "ok", out
        wait_state(ca, jb, ("running",))
        gates.open("ga")
        gates.open("gb")
        wait_state(ca, ja, ("succeeded",))
        wait_state(ca, jb, ("succeeded",))
