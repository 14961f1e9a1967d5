"""The local runtime: one process per rank on this machine (control plane).

Each rank runs under the rank shim (:mod:`hora_service.runtimes.shim`) in a session of its
own, so signals reach its whole process group and it outlives a crash of the service. The
shim starts with an empty environment and reads the rank's from a launch file; the rank's
command runs in the attempt's cgroup (with its limits, :mod:`hora_service.runtimes.limits`)
as the job's account (``plan.run_as``), and enters its working directory and sets its umask
only once it runs as that account. The argument list (:func:`rank_argv`) and the launch file
(:func:`launch_file`, with the environment of :func:`~hora_service.runtimes.core.rank_environment`)
are built by pure functions; nothing passes through a shell.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import psutil
from hora.procs import signal_group

from hora_service.runtimes import namespaces, scratch
from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, RankStatus, Runtime
from hora_service.runtimes.core import rank_environment, read_exit, read_pid, write_pid
from hora_service.runtimes.elastic_run import hosts_arg
from hora_service.runtimes.launchfile import LaunchFile, private_file
from hora_service.runtimes.limits import apply_cgroup
from hora_service.runtimes.paths import JobPaths
from hora_service.runtimes.runfiles import UntrustedRunFile

logger = logging.getLogger(__name__)

SHIM = Path(__file__).with_name("shim.py")
PID_WAIT_S = 5.0
# A process this young with no arguments yet is in the middle of exec: the kernel releases
# the parent (and Popen returns) before it puts the new program's arguments in place.
EXEC_GRACE_S = 5.0


def rank_argv(plan: AttemptPlan, rank: int, python: str = sys.executable) -> list[str]:
    """The argument list that starts rank ``rank``: the shim, its run directory and rank.

    The user's command is in the launch file (:func:`launch_file`), not here: the shim's
    command line is readable by every account in ``/proc``.

    Example:
        >>> rank_argv(plan, 0)[-1:]  # doctest: +SKIP
        ['0']
    """
    return [python, "-I", "-S", str(SHIM), str(plan.run_dir), str(rank)]


def launch_file(plan: AttemptPlan, rank: int, base: Mapping[str, str]) -> LaunchFile:
    """What the shim reads from ``rank<R>.launch`` (see :mod:`hora_service.runtimes.shim`)."""
    launch = LaunchFile.of_plan(plan, rank_environment(plan, rank, base))
    if plan.driver:  # the slot file, read through the shim's descriptor of the run directory
        launch = dataclasses.replace(launch, run_dir_arg=hosts_arg(plan.driver))
    return launch


class ChildRank(RankProcess):
    """A rank this service started (it is the shim's parent and reaps it)."""

    def __init__(self, rank: int, proc: subprocess.Popen[bytes], paths: JobPaths) -> None:
        self.rank = rank
        self.proc = proc
        self.paths = paths

    def poll(self) -> RankStatus:
        """Exit code once the shim has exited (the recorded one, else the shim's own)."""
        code = self.proc.poll()
        if code is None:
            return Exit.running
        recorded = read_exit(self.paths, self.rank)
        return recorded if recorded is not None else code

    def signal(self, sig: int) -> None:
        """Signal the rank's process group."""
        signal_group(self.proc.pid, sig)


class AdoptedRank(RankProcess):
    """A rank started by an earlier run of the service, found again through its pid file.

    A rank whose pid file is missing may be one the old service had just forked when it
    died: for ``wait_s`` it counts as running (a signal sent meanwhile is delivered once
    the pid is known), then as lost.
    """

    def __init__(self, rank: int, paths: JobPaths, wait_s: float = PID_WAIT_S) -> None:
        self.rank = rank
        self.paths = paths
        self.pid: int | None = None
        self._give_up = time.monotonic() + wait_s
        self._owed: int | None = None

    def _find(self) -> int | None:
        if self.pid is None:
            try:
                self.pid = read_pid(self.paths, self.rank)
            except UntrustedRunFile as e:  # poll() says so; the cgroup still ends the rank
                self.note = str(e)
                return None
            if self.pid is not None and self._owed is not None:
                sig, self._owed = self._owed, None
                self.signal(sig)
        return self.pid

    def _alive(self) -> bool:
        pid = self._find()
        if pid is None:
            return False
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            argv = proc.cmdline()
            if not argv:  # exec under way (or a kernel thread, which is never young for long)
                return time.time() - proc.create_time() < EXEC_GRACE_S
            # the pid may have been reused: the shim's command line names this run dir
            return str(self.paths.run_dir) in argv
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def poll(self) -> RankStatus:
        """The recorded exit code, ``running`` while the shim lives, else ``lost``."""
        recorded = read_exit(self.paths, self.rank)
        if recorded is not None:
            return recorded
        if self._alive() or (self.pid is None and time.monotonic() < self._give_up):
            return Exit.running
        recorded = read_exit(self.paths, self.rank)  # it may have ended between the looks
        return Exit.lost if recorded is None else recorded

    def signal(self, sig: int) -> None:
        """Signal the rank's process group if it is still this rank's (or once it appears)."""
        if self._find() is None:
            self._owed = signal.SIGKILL if signal.SIGKILL in (sig, self._owed) else sig
        elif self._alive():
            assert self.pid is not None
            signal_group(self.pid, sig)


class LocalRuntime(Runtime):
    """One process per rank on this machine (see the module docstring)."""

    name = "local"
    replaces_ranks = True

    @classmethod
    def from_settings(cls, settings: object = None) -> LocalRuntime:
        """The local runtime (it has no settings of its own)."""
        return cls()

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        box = plan.container
        if box is not None and box.kind != "tag" and plan.limits is not None:
            missed = apply_cgroup(box.kind, box.dirs, plan.limits)
            if missed:
                logger.warning("job %d: limits not enforced: %s", plan.job_id, ", ".join(missed))
        holder = namespaces.start(plan) if namespaces.wanted(plan) else None
        # without a private /tmp, a TMPDIR of its own that clear() removes (even after SIGKILL)
        tmp = scratch.make(plan) if holder is None else None
        try:
            return self._start_ranks(plan, base_env, holder, tmp)
        finally:
            if holder is not None:  # each shim holds the namespaces now: nothing else must
                holder.stop()

    def _start_ranks(
        self,
        plan: AttemptPlan,
        base_env: dict[str, str],
        holder: namespaces.Holder | None,
        tmp: Path | None,
    ) -> list[RankProcess]:
        ranks: list[RankProcess] = []
        try:
            for rank in range(plan.ranks):
                ranks.append(self._start_rank(plan, rank, base_env, holder, tmp))
        except OSError:
            for started in ranks:
                started.signal(signal.SIGKILL)
            raise
        return ranks

    def _start_rank(
        self,
        plan: AttemptPlan,
        rank: int,
        base_env: dict[str, str],
        holder: namespaces.Holder | None,
        tmp: Path | None,
        again: bool = False,
    ) -> ChildRank:
        """Start the shim of ``rank``; ``again``: a replacement, whose log goes on the old one.

        The log holds only what the rank printed: the replacement is an event of the job's.
        """
        gid = plan.run_as.gid if plan.run_as is not None else os.getegid()
        launch = launch_file(plan, rank, base_env).with_namespaces(namespaces.fds_of(holder))
        if tmp is not None and scratch.VAR not in plan.spec.env:
            launch = launch.with_env(**{scratch.VAR: str(tmp)})
        private_file(plan.paths.launch(rank), os.getegid(), 0o600, launch.to_json())
        if not again:
            private_file(plan.paths.log(rank), gid, 0o640)
        with plan.paths.log(rank).open("ab") as log:
            proc = subprocess.Popen(
                rank_argv(plan, rank),
                env={},
                cwd=plan.run_dir,  # the shim's; the command enters workdir itself
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # the shim (never its command) holds its slots' leases while the rank runs
                pass_fds=(*(holder.fds if holder is not None else ()), *plan.rank_leases(rank)),
            )
        # the shim writes this too; writing it here means a job recorded as running
        # always has its pid files, whatever instant the service dies at
        write_pid(plan.paths, rank, proc.pid)
        return ChildRank(rank, proc, plan.paths)

    def replace_rank(
        self, plan: AttemptPlan, rank: int, base_env: dict[str, str], master_port: int
    ) -> RankProcess:
        """Start rank ``rank`` again in the attempt's cgroup, meeting its peers at ``master_port``.

        The dead rank's exit file goes (the new shim records its own); its log goes on.

        Raises:
            SpecError: the attempt runs in namespaces of its own (never a session's).
        """
        if namespaces.wanted(plan):
            return super().replace_rank(plan, rank, base_env, master_port)
        plan.paths.exit(rank).unlink(missing_ok=True)
        moved = dataclasses.replace(plan, master_port=master_port)
        return self._start_rank(moved, rank, base_env, None, scratch.existing(plan), again=True)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        return [AdoptedRank(rank, plan.paths) for rank in range(plan.ranks)]

    def _clear(self, plan: AttemptPlan) -> bool:
        empty = super()._clear(plan)
        if empty:  # nothing can write there any more
            scratch.remove(plan)
        return empty
