"""A real two-node Slurm cluster for the slurm e2e tests (``scripts/slurm-cluster.sh``).

:func:`cluster` reuses the cluster whose directory ``HORA_TEST_SLURM_DIR`` names when it
answers (``.ci/run`` starts one and exports the variable), else starts its own in a new
directory under /tmp and, at the end, stops it and checks that nothing is left: no daemon,
no node namespace, no bridge, no /etc/hosts line. Root is needed (network namespaces); where
it cannot start, the tests fail with the reason: they are never skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
BRIDGE = "hslbr0"
HOSTS_TAG = "# hora-slurm-cluster"


class ClusterUnavailable(RuntimeError):
    """The test cluster cannot be started or reached here (the message says why)."""


@dataclass
class Cluster:
    """A running test cluster: its directory, config and nodes."""

    dir: Path
    owned: bool
    nodes: tuple[str, ...] = ("n1", "n2")
    started: list[float] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """An environment for Slurm's clients (and a service that runs them)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30) -> str:
        """Run a Slurm client command; its stdout (raises on failure)."""
        proc = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def netns(self, node: str) -> str:
        return f"hsl-{node}"

    def node_pids(self, node: str) -> list[int]:
        """Pids of every process in a node's network namespace (slurmd included)."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns(node)], capture_output=True, text=True, timeout=10
        ).stdout
        return [int(p) for p in out.split()]

    def task_pids(self, node: str) -> list[int]:
        """Processes on a node other than its slurmd: what jobs left there."""
        left = []
        for pid in self.node_pids(node):
            try:
                name = psutil.Process(pid).name()
            except psutil.NoSuchProcess:
                continue
            if name != "slurmd":
                left.append(pid)
        return left

    def leftovers(self, within: float = 10.0) -> dict[str, list[int]]:
        """Each node's :meth:`task_pids`, once they are all empty or ``within`` seconds pass.

        slurmctld records a job ended when the nodes report its steps done; a node's
        ``slurmstepd`` may still be exiting for a moment after that (seen on a loaded 2-core
        machine), so "nothing is left" is checked over a short, bounded wait.
        """
        deadline = time.monotonic() + within
        while True:
            left = {n: self.task_pids(n) for n in self.nodes}
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def slurmd_pid(self, node: str) -> int:
        return int((self.dir / "run" / f"slurmd-{node}.pid").read_text())

    def queue(self) -> list[str]:
        """Job ids Slurm still holds (pending or running)."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until no job is queued or running and no task is left on any node."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.queue() and not any(self.task_pids(n) for n in self.nodes):
                return
            time.sleep(0.1)
        left = {n: self.task_pids(n) for n in self.nodes}
        raise AssertionError(f"cluster not idle after {timeout}s: queue {self.queue()}, {left}")

    @contextmanager
    def hidden_on(self, node: str, path: Path) -> Iterator[None]:
        """Hide ``path`` from one node (an empty tmpfs over it in the node's mount namespace)."""
        target = ["nsenter", f"--mount=/proc/{self.slurmd_pid(node)}/ns/mnt", "--"]
        subprocess.run([*target, "mount", "-t", "tmpfs", "hidden", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run([*target, "umount", "-l", str(path)], check=True)


def slurm_env(slurm: Cluster, **extra: str) -> dict[str, str]:
    """Service settings for a service whose slurm jobs go to ``slurm``.

    The slots of a node are left to the slurm runtime's default: what Slurm reports (each
    node's ``Gres=gpu:2``).
    """
    return {
        "SLURM_CONF": str(slurm.conf),
        "HORA_SLURM_CONF": str(slurm.conf),
        "HORA_JOB_ENV_PASSTHROUGH": "PYTHONPATH,OMP_NUM_THREADS,PYTHONUNBUFFERED",
        **extra,
    }


def _answers(conf: Path) -> bool:
    if not conf.is_file():
        return False
    proc = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%T"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True, text=True, timeout=15, check=False,
    )  # fmt: skip
    return proc.returncode == 0 and proc.stdout.split().count("idle") >= 2


def _script(cmd: str, where: Path) -> str:
    proc = subprocess.run(
        [str(SCRIPT), cmd, str(where)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise ClusterUnavailable(f"slurm-cluster.sh {cmd} failed: {proc.stderr.strip()}")
    return proc.stdout


def leftovers(where: Path) -> list[str]:
    """What a stopped cluster left behind (empty when nothing)."""
    found = []
    if where.exists():
        found.append(f"directory {where}")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {n}" for n in re.findall(r"^(hsl-\S+)", netns, re.M)]
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    hosts = Path("/etc/hosts").read_text()
    found += [f"/etc/hosts: {line}" for line in hosts.splitlines() if line.endswith(HOSTS_TAG)]
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(where) in cmdline and proc.pid != os.getpid():
            found.append(f"process {proc.pid}: {cmdline}")
    return found


@contextmanager
def cluster() -> Iterator[Cluster]:
    """The CI's cluster (``HORA_TEST_SLURM_DIR``) if it answers, else a private one."""
    shared = os.environ.get("HORA_TEST_SLURM_DIR")
    if shared and _answers(Path(shared) / "etc" / "slurm.conf"):
        yield Cluster(Path(shared), owned=False)
        return
    for tool in ("sbatch", "slurmd", "slurmctld", "munged"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(
                f"{tool} not found: install slurm-wlm, slurm-client and munge "
                "(scripts/install.sh test does)"
            )
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster needs root (network namespaces)")
    where = Path(tempfile.mkdtemp(prefix="hora-slurm-")) / "cluster"
    where.parent.chmod(0o755)  # munged wants every directory above its socket o+x
    t0 = time.monotonic()
    try:
        _script("start", where)  # a failed start cleans up after itself
    except ClusterUnavailable:
        shutil.rmtree(where.parent, ignore_errors=True)
        raise
    made = Cluster(where, owned=True, started=[time.monotonic() - t0])
    try:
        yield made
    finally:
        _script("stop", where)
        shutil.rmtree(where.parent, ignore_errors=True)
        left = leftovers(where)
        assert not left, f"the test cluster left: {left}"
