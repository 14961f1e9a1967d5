"""The ``hora run`` process supervisor: start N ranks, stream their output, stop them together.

Data plane. :func:`launch` takes a validated :class:`~hora.launch.config.LaunchConfig`, picks a
free rendezvous port, builds every rank's environment with
:func:`~hora.launch.config.build_rank_envs` and hands them to :class:`Supervisor`, which

* starts each rank in its own session (its process group id is its pid), stdin closed and
  stdout/stderr piped through line prefixers (:mod:`hora.launch.output`);
* waits on every rank from a waiter thread, so exits are seen in the order they happen;
* when a rank exits non-zero, sends SIGTERM to every other rank's group, then SIGKILL after
  the grace period, and returns that first non-zero exit code (death by signal N: 128 + N);
* forwards SIGINT / SIGTERM (and SIGHUP, as SIGTERM) to every rank's group; a second signal
  kills at once;
* after the ranks exit, stops whatever they left running in their groups and, as a Linux
  child subreaper, any orphan that escaped its group; then merges the timeline parts.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, cast

from hora.launch import procs
from hora.launch.config import LaunchConfig, build_rank_envs
from hora.launch.output import PrefixedSink, prefix, start_pump
from hora.net import free_port
from hora.words import named

log = logging.getLogger("hora.launch")

FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
             signal.SIGHUP: signal.SIGTERM}
_PUMP_JOIN_S = 5.0


@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        rank: the global rank.
        code: shell-style exit code (128 + N for death by signal N; 127 when it never started).
        stopped: True when it ended after the launcher asked the ranks to stop.
    """

    rank: int
    code: int
    stopped: bool


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of one ``hora run``.

    Attributes:
        exit_code: what ``hora run`` exits with: the first non-zero rank exit code (in time),
            or, after a forwarded signal, the ranks' first non-zero code else 128 + signal.
        exits: every rank's exit, in the order they happened.
        first_failure: the rank whose failure stopped the job, or None.
        also_failed: other ranks that failed on their own (not from the launcher's stop).
        signal: the signal the launcher received and forwarded, or None.
        timeline: the merged timeline file, when one was requested and written.
        pids: the ranks' pids (also their process group ids), by rank.
    """

    exit_code: int
    exits: tuple[RankExit, ...]
    first_failure: RankExit | None = None
    also_failed: tuple[int, ...] = ()
    signal: int | None = None
    timeline: Path | None = None
    pids: tuple[int, ...] = ()


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread] = field(default_factory=list)
    exit: RankExit | None = None


class Supervisor:
    """Run one set of ranks to completion; see the module docstring for the rules.

    Args:
        config: the launch description (np, command, grace period, timeline).
        envs: one full environment per rank (from :func:`build_rank_envs`).
        stdout: where ranks' stdout lines go (default ``sys.stdout``).
        stderr: where ranks' stderr lines go (default ``sys.stderr``).
        cwd: the ranks' working directory (default: the current one).
        adopt_orphans: become a Linux child subreaper for the run, so descendants that left
            their rank's process group are still found and stopped. Meant for the ``hora run``
            process itself; leave False when embedding the supervisor in a long-lived process.

    Example:
        >>> cfg = LaunchConfig(np=2, command=("true",))
        >>> Supervisor(cfg, build_rank_envs(cfg, os.environ, free_port())).run().exit_code
        0
    """

    def __init__(
        self,
        config: LaunchConfig,
        envs: list[dict[str, str]],
        *,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        cwd: Path | None = None,
        adopt_orphans: bool = False,
    ) -> None:
        if len(envs) != config.np:
            raise ValueError(f"got {len(envs)} rank environments for np={config.np}")
        self.config = config
        self.envs = envs
        self.cwd = cwd
        self.adopt_orphans = adopt_orphans
        self._out = PrefixedSink(stdout or sys.stdout)
        self._err = PrefixedSink(stderr or sys.stderr)
        self._events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._ranks: list[_Rank] = []
        self._exits: list[RankExit] = []
        self._first: RankExit | None = None
        self._signal: int | None = None
        self._stopping = False
        self._sent: set[int] = set()
        self._kill_at: float | None = None

    # ----------------------------------------------------------------- public
    def run(self) -> LaunchResult:
        """Start the ranks, supervise them until all exited, clean up, merge the timeline.

        Returns:
            The :class:`LaunchResult`.
        """
        self._prepare_timeline()
        before = procs.child_pids() if self.adopt_orphans else set()
        reaper = procs.set_subreaper(True) if self.adopt_orphans else False
        handlers = self._install_handlers()
        try:
            self._spawn_all()
            self._monitor()
        finally:
            self._cleanup(before | self._pids(), reaper)
            self._restore_handlers(handlers)
            if reaper:
                procs.set_subreaper(False)
        return self._result(self._merge_timeline())

    # ------------------------------------------------------------- starting
    def _spawn_all(self) -> None:
        for rank, env in enumerate(self.envs):
            started = self._spawn(rank, env)
            if started is None:  # could not exec: start no more ranks; the others are stopped
                return
            self._ranks.append(started)

    def _spawn(self, rank: int, env: Mapping[str, str]) -> _Rank | None:
        try:
            proc = subprocess.Popen(
                list(self.config.command), env=dict(env), cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )
        except OSError as e:
            log.error("rank %d could not start %r: %s", rank, self.config.command[0], e)
            self._record(rank, 126 if isinstance(e, PermissionError) else 127)
            return None
        pumps = [
            start_pump(cast(IO[bytes], proc.stdout), prefix(rank, "stdout"), self._out,
                       f"hora-out-{rank}"),
            start_pump(cast(IO[bytes], proc.stderr), prefix(rank, "stderr"), self._err,
                       f"hora-err-{rank}"),
        ]
        threading.Thread(target=self._wait, args=(rank, proc), name=f"hora-wait-{rank}",
                         daemon=True).start()
        return _Rank(rank, proc, pumps)

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._events.put(("exit", rank, proc.wait()))

    # ----------------------------------------------------------- monitoring
    def _running(self) -> list[_Rank]:
        return [r for r in self._ranks if r.exit is None]

    def _monitor(self) -> None:
        while self._running():
            timeout = None if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
            try:
                kind, a, b = self._events.get(timeout=timeout)
            except queue.Empty:
                kind, a, b = "deadline", 0, 0
            if kind == "exit":
                self._ranks[a].exit = self._record(a, procs.exit_code(b))
            elif kind == "signal":
                self._on_signal(a)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._stop(signal.SIGKILL)

    def _record(self, rank: int, code: int) -> RankExit:
        ex = RankExit(rank, code, stopped=self._stopping)
        self._exits.append(ex)
        if code != 0 and not self._stopping:
            self._first = ex
            # ranks that ended meanwhile (their exit not handled yet) are not being stopped
            others = [r.rank for r in self._running() if r.rank != rank and procs.running(r.proc)]
            stopping = f"; stopping {named('rank', others)}" if others else ""
            log.error("rank %d exited with code %d%s", rank, code, stopping)
            self._stop(signal.SIGTERM)
        return ex

    def _stop(self, sig: int) -> None:
        """Signal every running rank's group; schedule SIGKILL after the grace period."""
        self._stopping = True
        self._sent.add(sig)
        for r in self._running():
            procs.signal_group(r.proc.pid, sig)
        if sig == signal.SIGKILL:
            self._kill_at = None
        elif self._kill_at is None:
            self._kill_at = time.monotonic() + self.config.grace_period

    def _on_signal(self, signum: int) -> None:
        if self._signal is not None:  # a second signal: no more grace
            log.warning("received %s again; killing all ranks", signal.Signals(signum).name)
            self._stop(signal.SIGKILL)
            return
        self._signal = signum
        fwd = FORWARDED.get(signal.Signals(signum), signal.SIGTERM)
        log.warning("received %s; forwarding %s to all ranks", signal.Signals(signum).name,
                    signal.Signals(fwd).name)
        self._stop(fwd)

    # --------------------------------------------------------------- signals
    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(("signal", signum, 0))  # SimpleQueue.put is reentrant: handler-safe

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # embedded in a worker thread: the host process owns signal handling
        return {int(s): signal.signal(s, self._handler) for s in FORWARDED}

    @staticmethod
    def _restore_handlers(handlers: dict[int, Any]) -> None:
        for signum, old in handlers.items():
            signal.signal(signum, old)

    # --------------------------------------------------------------- cleanup
    def _pids(self) -> set[int]:
        return {r.proc.pid for r in self._ranks}

    def _cleanup(self, exclude: set[int], reaper: bool) -> None:
        """Kill what is left: unfinished ranks, members of their groups, adopted orphans."""
        for r in self._running():  # only when run() is leaving on an exception
            procs.signal_group(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        left = [r for r in self._ranks if procs.group_has_live_members(r.proc.pid)]
        if left:
            log.warning("ranks %s left processes running in their group; stopping them",
                        ", ".join(str(r.rank) for r in left))
            self._drain_groups([r.proc.pid for r in left])
        if reaper:
            procs.reap_adopted(exclude)
        deadline = time.monotonic() + _PUMP_JOIN_S
        for r in self._ranks:
            for t in r.pumps:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _drain_groups(self, pgids: list[int]) -> None:
        for pg in pgids:
            procs.signal_group(pg, signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_period
        while time.monotonic() < deadline and any(map(procs.group_has_live_members, pgids)):
            time.sleep(0.05)
        for pg in pgids:
            procs.signal_group(pg, signal.SIGKILL)

    # -------------------------------------------------------------- timeline
    def _prepare_timeline(self) -> None:
        path = self.config.timeline_filename
        if path is None:
            return
        from hora.timeline_merge import part_path

        path.unlink(missing_ok=True)  # a previous run's events must not mix into this one
        for r in range(self.config.np):
            part_path(path, r).unlink(missing_ok=True)

    def _merge_timeline(self) -> Path | None:
        path = self.config.timeline_filename
        if path is None:
            return None
        from hora.timeline_merge import merge_parts

        merge_parts(path)
        if not path.exists():
            log.warning("no timeline was written to %s: did the script call hvd.init()?", path)
            return None
        return path

    # ---------------------------------------------------------------- result
    def _result(self, timeline: Path | None) -> LaunchResult:
        ours = {128 + s for s in self._sent}
        also = tuple(e.rank for e in self._exits
                     if e.code != 0 and e is not self._first and e.code not in ours)
        if self._first is not None:
            code = self._first.code
        elif self._signal is not None:
            code = next((e.code for e in self._exits if e.code != 0), 128 + self._signal)
        else:
            code = 0
        return LaunchResult(
            exit_code=code, exits=tuple(self._exits), first_failure=self._first,
            also_failed=also, signal=self._signal, timeline=timeline,
            pids=tuple(r.proc.pid for r in self._ranks),
        )


def launch(
    config: LaunchConfig,
    base_env: Mapping[str, str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    cwd: Path | None = None,
    adopt_orphans: bool = False,
) -> LaunchResult:
    """Run ``config.command`` on ``config.np`` local ranks and supervise them to the end.

    Args:
        config: the validated launch description (see :func:`hora.launch.config.parse_args`).
        base_env: the environment the ranks start from (default: this process's).
        stdout: where ranks' prefixed stdout lines go (default ``sys.stdout``).
        stderr: where ranks' prefixed stderr lines go (default ``sys.stderr``).
        cwd: the ranks' working directory.
        adopt_orphans: see :class:`Supervisor` (True only in the ``hora run`` process).

    Returns:
        The :class:`LaunchResult`; ``exit_code`` is what ``hora run`` exits with.

    Example:
        >>> launch(LaunchConfig(np=2, command=("true",))).exit_code
        0
    """
    port = config.master_port or free_port(config.master_addr)
    envs = build_rank_envs(config, os.environ if base_env is None else base_env, port)
    sup = Supervisor(config, envs, stdout=stdout, stderr=stderr, cwd=cwd,
                     adopt_orphans=adopt_orphans)
    return sup.run()
