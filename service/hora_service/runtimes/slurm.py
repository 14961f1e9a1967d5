"""The slurm runtime: a job is one ``sbatch`` submission, its ranks one ``srun`` (control plane).

Slurm owns its nodes and GPUs: a slurm job takes none of the service's own slots, and
``workers`` may exceed one machine (``nodes x ranks per node``, see
:func:`~hora_service.runtimes.sbatch.layout_for`). Before submitting, the service writes
one launch file per rank into the attempt's run directory, which must be on a filesystem the
service and every node share; on the node, the rank launcher
(:mod:`hora_service.runtimes.slurm_rank`) fills in the rank's place and runs the rank
shim, so pid, log and exit files land where the local runtime puts them.

State comes from Slurm itself: ``squeue`` (every state Slurm still holds, one call per
monitor pass for all jobs), then ``scontrol show job`` (``sacct`` needs slurmdbd, which
many clusters, and the test cluster, lack). A rank's exit code comes from the shim's file;
a Slurm job that ended without one explains why (cancelled outside hora, preempted,
Slurm's time limit, a node that cannot see the run directory). Signals go through
``scancel``: SIGTERM to the job's steps (the ranks, not the batch script: an srun signalled
with SIGTERM would SIGKILL its tasks at once), SIGKILL ends the job.
A restarted service finds an attempt's job again by the id in ``slurm.jobid``, or by its
unique job name when the service died right after ``sbatch``: it never submits twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hora.env import RankEnv
from hora.errors import HoraError, SpecError
from hora.net import route_source
from hora.spec import JobSpec
from hora.words import count

from hora_service.models import SlotInfo
from hora_service.runtimes import scratch
from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, RankStatus, Runtime
from hora_service.runtimes.core import rank_environment, read_exit, read_pid
from hora_service.runtimes.launchfile import LaunchFile, private_file
from hora_service.runtimes.sbatch import (
    Layout,
    SlurmOptions,
    instance_of,
    job_name,
    layout_for,
    render_sbatch,
)
from hora_service.runtimes.slurm_facts import (
    Partition,
    expand_hosts,
    fields,
    gpu_holders,
    node_addresses,
    parse_partition,
)
from hora_service.scheduling.reasons import runtime_reason

if TYPE_CHECKING:
    from hora_service.settings import Settings

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("slurm_rank.py")
ACTIVE = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
    "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
    "UNREACHABLE",  # hora's: slurmctld does not answer; the job is held as it was
}  # fmt: skip
DOWN_RETRY_S = 5.0  # after a failed squeue, the monitor asks again only this much later
CACHE_S = 0.3
CMD_TIMEOUT_S = 20.0
SIGNAL_EVERY_S = 1.0
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")  # where Slurm's commands look without SLURM_CONF
FACTS_S = 30.0  # how long what the partition offers is kept (a failed look: DOWN_RETRY_S)
CONFIGURE = (
    "set HORA_SLURM_CONF to the cluster's slurm.conf (and HORA_SLURM_BIN_DIR to where "
    "sbatch is) for the slurm runtime"
)


class SlurmError(HoraError):
    """Slurm's commands failed (missing, the controller down); the message says which."""


class NodeRouteError(SlurmError):
    """Which address the nodes reach this machine at could not be told.

    The message carries the tool's own words (for the service's log); ``brief`` says what
    failed in words fit for any user, without Slurm's output.
    """

    def __init__(self, brief: str, detail: str) -> None:
        super().__init__(f"{brief}: {detail}")
        self.brief = brief


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job: its state, reason (pending reason or why it ended), nodes."""

    state: str
    reason: str
    nodes: str
    preempted: bool = False  # Slurm began preempting it (``scontrol``'s PreemptTime)

    @property
    def active(self) -> bool:
        """Slurm still holds the job (pending, running, completing, requeued...)."""
        return self.state in ACTIVE


@dataclass
class _Cache:
    at: float = -1.0
    jobs: dict[str, JobInfo] = field(default_factory=dict)
    down: bool = False  # the last squeue failed


class SlurmRuntime(Runtime):
    """Jobs as Slurm batch jobs (see the module docstring)."""

    name = "slurm"
    queues = True
    uses_cgroup = False  # Slurm holds the ranks' processes on its nodes

    def __init__(self, opts: SlurmOptions, instance: str, conf: str | None, bin_dir: str | None):
        self.opts = opts
        self.instance = instance
        self.conf = conf or None  # an empty SLURM_CONF names no file
        self.path = bin_dir or os.environ.get("PATH", "/usr/bin:/bin")
        self._cache = _Cache()
        self._signalled: dict[tuple[str, int], float] = {}
        self._facts: tuple[float, Partition | SlurmError] | None = None  # (until, answer)

    @classmethod
    def from_settings(cls, settings: Settings) -> SlurmRuntime:
        """The runtime with the admin's ``slurm_*`` settings."""
        opts = SlurmOptions(
            slots_per_node=settings.slurm_slots_per_node,
            gpus=settings.slurm_gpus,
            partition=settings.slurm_partition,
            account=settings.slurm_account,
            qos=settings.slurm_qos,
            high_qos=settings.slurm_high_priority_qos,
            low_nice=settings.slurm_low_priority_nice,
            signal_s=settings.slurm_signal_s,
            default_time_min=settings.slurm_default_time_min,
            grace_s=settings.kill_grace_s,
        )
        conf = str(settings.slurm_conf) if settings.slurm_conf else os.environ.get("SLURM_CONF")
        bin_dir = str(settings.slurm_bin_dir) if settings.slurm_bin_dir else None
        return cls(opts, instance_of(settings.data_dir), conf, bin_dir)

    # commands -----------------------------------------------------------------------------

    def tool(self, name: str) -> str:
        """Absolute path of a Slurm command.

        Raises:
            SlurmError: it is not installed where the service looks.
        """
        found = shutil.which(name, path=self.path)
        if found is None:
            raise SlurmError(
                f"{name} not found on the service's PATH ({self.path}): install Slurm's "
                "client commands (Debian: slurm-client) or set HORA_SLURM_BIN_DIR"
            )
        return found

    def _env(self) -> dict[str, str]:
        env = {"PATH": self.path, "LANG": "C.UTF-8"}
        if self.conf:
            env["SLURM_CONF"] = self.conf
        return env

    def run(self, *argv: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (an argument list) with the service's Slurm environment."""
        try:
            return subprocess.run(
                [self.tool(argv[0]), *argv[1:]], env=self._env(), capture_output=True,
                text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"{argv[0]} did not answer within {timeout:g}s: is slurmctld running?"
            ) from None

    # checks and start ---------------------------------------------------------------------

    def partition(self) -> Partition:
        """What the partition offers a job, as Slurm reports it (kept :data:`FACTS_S`).

        Raises:
            SlurmError: Slurm's commands cannot say (missing, no configuration, the
                controller down, no such partition); the message says which.
        """
        now = time.monotonic()
        if self._facts is None or now >= self._facts[0]:
            try:
                self._configured()
                found: Partition | SlurmError = parse_partition(
                    self._ask("scontrol", "show", "partition", "-o"),
                    self._ask("scontrol", "show", "node", "-o"), self.opts.partition,
                )  # fmt: skip
            except (SlurmError, ValueError) as e:
                found = e if isinstance(e, SlurmError) else SlurmError(str(e))
            keep = DOWN_RETRY_S if isinstance(found, SlurmError) else FACTS_S
            self._facts = (now + keep, found)
        if isinstance(self._facts[1], SlurmError):
            raise self._facts[1]
        return self._facts[1]

    def _configured(self) -> None:
        """Refuse at once where no ``slurm.conf`` is named or found (nothing to ask).

        Raises:
            SlurmError: no ``HORA_SLURM_CONF`` / ``SLURM_CONF`` and no default file, or the
                named file does not exist.
        """
        if self.conf is None and not DEFAULT_CONF.exists():
            raise SlurmError(
                f"no slurm.conf: neither HORA_SLURM_CONF nor SLURM_CONF is set and "
                f"{DEFAULT_CONF} does not exist"
            )
        if self.conf is not None and not Path(self.conf).exists():
            raise SlurmError(f"the slurm.conf {self.conf} does not exist")

    def _ask(self, *argv: str) -> str:
        """What a Slurm command printed; its error as a :class:`SlurmError`."""
        proc = self.run(*argv)
        if proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise SlurmError(f"{argv[0]}: {said[-1] if said else f'exit {proc.returncode}'}")
        return proc.stdout

    def slots_per_node(self) -> int:
        """Slots a node gives a job: the admin's ``slurm_slots_per_node``, else Slurm's word.

        Raises:
            SlurmError: see :meth:`partition`.
        """
        if self.opts.slots_per_node is not None:
            return self.opts.slots_per_node
        part = self.partition()
        per = part.slots_per_node(self.opts.gpus)
        if per < 1:
            raise SlurmError(
                f"a node of partition {part.name!r} reports no GPU (Gres): set "
                "HORA_SLURM_GPUS=false for CPU ranks, or HORA_SLURM_SLOTS_PER_NODE"
            )
        return per

    def layout(self, spec: JobSpec) -> Layout:
        """Nodes and ranks per node of ``spec`` on this cluster.

        Raises:
            SlurmError: what a node holds cannot be learnt from Slurm.
            SpecError: the ranks do not fit the nodes (see :func:`layout_for`).
        """
        return layout_for(spec.workers, spec.gpus_per_worker, self.slots_per_node(), None)

    def _check(self, spec: JobSpec) -> None:
        if spec.image is not None:
            raise SpecError(
                "image",
                "the slurm runtime runs the nodes' own Python environment: no container "
                "launcher is enabled on the nodes, so a slurm job cannot name an image",
            )
        try:
            self.tool("sbatch")
            layout, part = self.layout(spec), self.partition()
        except SlurmError as e:
            raise SpecError("runtime", f"no Slurm cluster answers: {e}; {CONFIGURE}") from None
        if layout.nodes > part.nodes:
            unit, g = ("GPU" if self.opts.gpus else "slot"), spec.gpus_per_worker
            raise SpecError(
                "workers",
                f"asks for {count(spec.workers, 'worker')} x {count(g, unit)}: "
                f"{count(layout.nodes, 'node')} of {count(layout.per_node * g, unit)}; "
                f"partition {part.name} gives a job at most {count(part.nodes, 'node')}",
            )

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        layout = self.layout(plan.spec)
        self._write_launch_files(plan, base_env, layout)
        script = plan.paths.batch_script
        name = job_name(self.instance, plan.job_id, plan.attempt)
        sub = render_sbatch(
            plan.spec, name=name, run_dir=plan.run_dir, workdir=plan.workdir, layout=layout,
            opts=self.opts, launcher=[sys.executable, "-I", "-S", str(LAUNCHER)],
            tools={"sbatch": self.tool("sbatch"), "srun": self.tool("srun"),
                   "path": self.path, "conf": self.conf or ""},
            batch_script=script,
        )  # fmt: skip
        private_file(script, os.getegid(), 0o700, sub.script)
        try:
            proc = subprocess.run(
                sub.argv, env=sub.env, capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                check=False, stdin=subprocess.DEVNULL, cwd=plan.run_dir,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"sbatch did not answer within {CMD_TIMEOUT_S:g}s: is slurmctld running?"
            ) from None
        if proc.returncode != 0:
            plan.paths.slurm_jobid.write_text("")  # nothing was submitted
            raise SlurmError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout}")
        job_id = proc.stdout.strip().split(";")[0]
        plan.paths.slurm_jobid.write_text(job_id)
        log.info("job %d attempt %d: Slurm job %s (%s)", plan.job_id, plan.attempt, job_id, name)
        self._cache.at = -1.0
        return [SlurmRank(r, self, plan, job_id) for r in range(plan.spec.workers)]

    def _write_launch_files(self, plan: AttemptPlan, base: dict[str, str], layout: Layout) -> None:
        gid = plan.run_as.gid if plan.run_as is not None else os.getegid()
        for rank in range(plan.spec.workers):
            env = rank_environment(plan, rank, base)
            placed = RankEnv(
                local_rank=rank % layout.per_node, local_world_size=layout.per_node,
                cross_size=layout.nodes, gpus_per_rank=plan.spec.gpus_per_worker,
            )  # fmt: skip
            env.update(placed.to_environ())
            # Slurm holds the ranks' processes on the nodes: no cgroups of the service's;
            # the service cannot reach a node's /tmp, so the shim there gives the rank a
            # TMPDIR of its own and removes it when the rank ended (unless the job sets one)
            launch = dataclasses.replace(LaunchFile.of_plan(plan, env), cgroups=(),
                                         own_tmp=scratch.VAR not in plan.spec.env)
            text = launch.to_json()
            private_file(plan.paths.launch(rank), os.getegid(), 0o600, text)
            private_file(plan.paths.log(rank), gid, 0o640)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        job_id = self.job_id_of(plan)
        return [SlurmRank(r, self, plan, job_id) for r in range(plan.spec.workers)]

    def job_id_of(self, plan: AttemptPlan) -> str | None:
        """The Slurm job of an attempt: from ``slurm.jobid``, else by its unique name."""
        try:
            return plan.paths.slurm_jobid.read_text().strip() or None  # empty: refused
        except OSError:
            pass
        name = job_name(self.instance, plan.job_id, plan.attempt)
        try:
            proc = self.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i")
        except SlurmError as e:
            log.warning("job %d: cannot look for its Slurm job %s: %s", plan.job_id, name, e)
            return None
        found = proc.stdout.split()
        return found[0] if found else None

    def nodes(self, plan: AttemptPlan) -> frozenset[str]:
        """The nodes Slurm gave the attempt's job (none while it is not known)."""
        job_id = self.job_id_of(plan)
        info = self.info(job_id) if job_id else None
        if info is None or not info.nodes:
            return frozenset()
        return frozenset(expand_hosts(info.nodes))

    # state ----------------------------------------------------------------------------------

    def info(self, job_id: str, fresh: bool = False) -> JobInfo | None:
        """Slurm's view of one job (cached for a monitor pass); None once Slurm forgot it.

        ``fresh``: ask now. ``squeue`` names the state a job ends in (``CANCELLED``) while
        ``scontrol`` still says ``COMPLETING``, so it is asked first.
        """
        now = time.monotonic()
        if fresh or now - self._cache.at > CACHE_S:
            self._refresh()
        hit = self._cache.jobs.get(job_id)
        if hit is None and self._cache.down:
            return JobInfo("UNREACHABLE", "slurmctld does not answer", "")
        if hit is None:
            hit = self._show(job_id)
            if hit is not None:
                self._cache.jobs[job_id] = hit
        return hit

    def _refresh(self) -> None:
        try:
            proc = self.run("squeue", "-h", "-t", "all", "-o", "%i|%T|%r|%N")
            out, why = (proc.stdout, "") if proc.returncode == 0 else (None, proc.stderr.strip())
        except SlurmError as e:
            out, why = None, str(e)
        if out is None:
            # the last answer stands (a controller hiccup ends no job), asked again later:
            # each try can take slurm.conf's MessageTimeout, and the monitor waits for it
            log.warning("squeue failed: %s", why)
            self._cache.at = time.monotonic() + DOWN_RETRY_S - CACHE_S
            self._cache.down = True
            return
        jobs = {}
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) == 4:
                jobs[parts[0]] = JobInfo(parts[1], parts[2], parts[3])
        self._cache = _Cache(time.monotonic(), jobs)

    def _show(self, job_id: str) -> JobInfo | None:
        try:
            proc = self.run("scontrol", "show", "job", "-o", job_id)
        except SlurmError:
            return JobInfo("UNREACHABLE", "slurmctld does not answer", "")
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return None
            return JobInfo("UNREACHABLE", proc.stderr.strip(), "")
        fields = dict(p.split("=", 1) for p in proc.stdout.split() if "=" in p)
        return JobInfo(
            fields.get("JobState", "UNKNOWN"),
            fields.get("Reason", ""),
            fields.get("NodeList", ""),
            preempted=fields.get("PreemptTime", "None") not in ("None", "Unknown", ""),
        )

    def cluster_slots(self, hora: Mapping[str, tuple[int, str, str]]) -> list[SlotInfo]:
        """Each GPU of the nodes and its holder (``hora``: Slurm id -> job, user, kind)."""
        try:
            nodes = self.run("scontrol", "show", "node", "-o").stdout.splitlines()
            jobs = self.run("scontrol", "show", "job", "-d", "-o").stdout.splitlines()
        except SlurmError as e:
            log.warning("cannot list the cluster's GPUs: %s", e)
            return []
        return gpu_holders(nodes, jobs, hora)

    def address_towards_nodes(self) -> tuple[str, str]:
        """The first node and the address of this machine that reaches it (no packet is sent).

        Raises:
            NodeRouteError: ``scontrol`` cannot be run or lists no node, or the first node's
                address cannot be resolved or routed to.
        """
        try:
            proc = self.run("scontrol", "show", "node", "-o")
        except (SlurmError, OSError) as e:
            raise NodeRouteError("Slurm's scontrol could not be run", str(e)) from None
        nodes = [fields(line) for line in proc.stdout.splitlines()]
        named = [f for f in nodes if f.get("NodeName")]
        if proc.returncode != 0 or not named:
            said = f"exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            raise NodeRouteError("Slurm's scontrol listed no node", said)
        first = named[0]
        target = first.get("NodeAddr") or first["NodeName"]
        try:
            return first["NodeName"], route_source(target)
        except OSError as e:
            brief = f"this machine has no route to the first Slurm node ({first['NodeName']})"
            raise NodeRouteError(brief, f"{target}: {e}") from None

    def node_addresses(self) -> set[str]:
        """The IPv4 addresses of the cluster's nodes (those that resolve).

        Raises:
            SlurmError: ``scontrol`` cannot list the nodes.
        """
        proc = self.run("scontrol", "show", "node", "-o")
        if proc.returncode != 0:
            raise SlurmError(f"scontrol lists no node: {proc.stderr.strip() or proc.stdout}")
        return node_addresses(proc.stdout)

    def post_wait(self, job_id: int, info: JobInfo | None) -> None:
        """Show Slurm's pending reason on the job while Slurm holds it back; clear it after."""
        if self.waits is None:
            return
        if info is not None and info.state == "PENDING" and info.reason not in ("None", ""):
            self.waits.post(job_id, runtime_reason("slurm", info.reason))
        else:
            self.waits.clear(job_id)

    def signal_job(self, job_id: str, sig: int) -> None:
        """Signal every step and the batch script (SIGKILL: end the job); once a second at most."""
        now = time.monotonic()
        key = (job_id, sig)
        if now - self._signalled.get(key, -SIGNAL_EVERY_S) < SIGNAL_EVERY_S:
            return
        self._signalled[key] = now
        if sig == signal.SIGKILL:
            argv = ["scancel", job_id]
        else:
            # the steps only: srun runs in the batch step, and an srun that gets SIGTERM
            # ends its tasks with SIGKILL ("forcing job termination"), so --full (which also
            # signals the batch script and its children) would leave the ranks no grace
            argv = ["scancel", f"--signal={signal.Signals(sig).name[3:]}", job_id]
        try:
            proc = self.run(*argv)
        except SlurmError as e:
            log.warning("Slurm job %s: %s", job_id, e)
            return
        if proc.returncode != 0 and "already completing" not in proc.stderr:
            log.info("Slurm job %s: %s: %s", job_id, " ".join(argv), proc.stderr.strip())
        self._cache.at = -1.0

    def _clear(self, plan: AttemptPlan) -> bool:
        job_id = self.job_id_of(plan)
        if job_id is None:
            return True
        info = self.info(job_id)
        if info is not None and not info.active:
            # squeue names the end state while the nodes may still be finishing the job's
            # steps; scontrol says COMPLETING until every node has reported them ended
            info = self._show(job_id)
        if info is None or not info.active:
            return True
        self.signal_job(job_id, signal.SIGKILL)
        return False

    def explain(self, plan: AttemptPlan, job_id: str | None, info: JobInfo | None) -> str | None:
        """Why a Slurm job's rank ended the way it did, beyond its own exit code."""
        if job_id is None:
            return "the service stopped before Slurm took the job"
        if info is None:
            return f"Slurm no longer knows job {job_id}"
        what = f"the Slurm job {job_id}"
        shown = self._show(job_id)  # squeue does not say whether Slurm preempted it
        if info.state == "PREEMPTED" or (shown is not None and shown.preempted):
            return f"{what} was preempted by Slurm"
        if info.state == "CANCELLED":
            return f"{what} was cancelled outside hora"
        if info.state == "TIMEOUT":
            return f"{what} reached Slurm's time limit"
        if info.state == "NODE_FAIL":
            return f"{what} lost node(s) {info.nodes}"
        if info.active or info.state == "COMPLETED":
            return None
        said = _hora_lines(plan.paths.slurm_out)
        if said:
            return said
        if read_pid(plan.paths, 0) is None:
            return (
                f"{what} ended {info.state} before any rank started: is {plan.run_dir} on a "
                "filesystem every node shares?"
            )
        return None  # the ranks' own exit codes say it


def _hora_lines(out: Path) -> str | None:
    """What the rank launchers said in the batch output (a node that cannot see RUN_DIR)."""
    try:
        text = out.read_text(errors="replace")
    except OSError:
        return None
    said = sorted({line[6:] for line in text.splitlines() if line.startswith("hora: ")})
    return "; ".join(said) if said else None


class SlurmRank(RankProcess):
    """One rank of a Slurm job: its shim's exit file, else what Slurm says of the job."""

    def __init__(self, rank: int, runtime: SlurmRuntime, plan: AttemptPlan, job_id: str | None):
        self.rank = rank
        self.runtime = runtime
        self.plan = plan
        self.job_id = job_id
        self.container_id = f"slurm:{job_id}" if job_id else None

    @property
    def pending_reason(self) -> str | None:
        """Slurm's reason while the job waits (``Resources``, ``Priority``, ...), else None."""
        info = self.runtime.info(self.job_id) if self.job_id else None
        return info.reason if info is not None and info.state == "PENDING" else None

    def poll(self) -> RankStatus:
        """The recorded exit code, ``running`` while Slurm holds the job, else ``lost``."""
        recorded = read_exit(self.plan.paths, self.rank)
        info = self.runtime.info(self.job_id) if self.job_id else None
        self.runtime.post_wait(self.plan.job_id, info)
        if recorded is None and info is not None and info.active:
            if info.state == "RUNNING" and read_pid(self.plan.paths, self.rank) is None:
                said = _hora_lines(self.plan.paths.slurm_out)
                if said:  # its launcher could not start it (a node without the run directory)
                    self.note = said
                    return Exit.lost
            return Exit.running
        if recorded is None:
            recorded = read_exit(self.plan.paths, self.rank)  # it may have ended meanwhile
        if recorded != 0:
            if self.job_id is not None and info is not None and info.active:
                # the rank ended first; Slurm marks a cancel or preemption before it signals
                info = self.runtime.info(self.job_id, fresh=True)
            if info is not None and info.state == "COMPLETING":
                return Exit.running  # the job is ending: how (cancelled, preempted) comes next
            self.note = self.runtime.explain(self.plan, self.job_id, info)
        return Exit.lost if recorded is None else recorded

    def signal(self, sig: int) -> None:
        """Signal the whole Slurm job (once for all its ranks)."""
        if self.job_id is not None:
            self.runtime.signal_job(self.job_id, sig)
