"""The elastic driver of ``hora run --min-np A --max-np B``: repair, not restart (data plane).

One loop (:meth:`ElasticDriver.run`) owns the job's lifecycle; waiter threads only report
exits. Workers are processes that run the script; the driver gives each a worker id and a slot
on a host (this machine's slots, or what ``--host-discovery-script`` prints), and publishes
*generations* (:mod:`hora.launch.elastic_rdzv`): the members in rank order and a fresh port.

* A worker that dies (any signal, a non-zero exit) is dropped: the driver publishes the next
  generation at once with the survivors in their old order (the lowest survivor becomes rank
  0 and syncs the others), and starts a replacement when a slot is free and its host is not
  blacklisted. The survivors keep their processes; their failed collective raises
  ``HorovodInternalError`` and ``hvd.elastic.run`` re-forms the world from the last commit.
* A replacement (or a worker on a newly discovered slot) is added once it reaches
  ``hvd.init()``: a newer generation makes ``state.commit()`` raise ``HostsUpdatedInterrupt``
  on every rank at the same commit, so the world grows without losing work.
* Below ``--min-np`` live workers no generation is published: the survivors wait in
  ``hvd.init()`` until capacity returns, or the job fails after ``--elastic-timeout``.
* A worker that exits 0 ends the job: no more replacements; the others finish too.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from hora.contract import preflight_pipe
from hora.env import (
    LAUNCHER_VARS,
    TORCHRUN_DEFAULTS,
    RankEnv,
    layered_env,
    new_rdzv_secret,
    rank_env,
)
from hora.errors import SpecError
from hora.launch import elastic_rdzv as rdzv
from hora.launch import procs
from hora.launch.config import ElasticConfig, LaunchConfig
from hora.launch.hosts import Blacklist, discover, parse_hosts_output
from hora.launch.launcher import FORWARDED, LaunchResult, RankExit
from hora.launch.output import PrefixedSink, prefix, start_pump
from hora.net import free_port
from hora.words import count

log = logging.getLogger("hora.launch")

TICK_S = 0.01
DISCOVERY_EVERY_S = 1.0
_REMOVED_GRACE_S = 30.0
# Names of this machine a discovery script may print (each is a host of its own)
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain",
                         socket.gethostname()})


@dataclass
class Worker:
    """One worker process: its id, slot, process and what the driver knows of it."""

    wid: str
    number: int
    host: str
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread] = field(default_factory=list)
    hello: bool = False
    code: int | None = None
    removed_at: float | None = None

    @property
    def live(self) -> bool:
        """Whether it runs and belongs to the job (not exited, not being removed)."""
        return self.code is None and self.removed_at is None


class ElasticDriver:
    """Run one elastic job to its end; see the module docstring for the rules.

    Args:
        config: the launch description (its ``elastic`` part is set).
        base_env: the environment the workers start from.
        stdout: where workers' stdout lines go (prefixed with the worker number).
        stderr: where workers' stderr lines go.
        cwd: the workers' working directory.

    Example:
        >>> ElasticDriver(parse_args(["-np", "2", "--min-np", "1", "--", "python", "t.py"]),
        ...               os.environ).run().exit_code  # doctest: +SKIP
    """

    def __init__(self, config: LaunchConfig, base_env: Mapping[str, str], *,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 cwd: Path | None = None) -> None:  # fmt: skip
        if config.elastic is None:
            raise ValueError("ElasticDriver needs config.elastic")
        self.config, self.ec = config, config.elastic
        self.base = {k: v for k, v in base_env.items() if k not in LAUNCHER_VARS}
        self._rdzv_secret = new_rdzv_secret()  # every worker of every generation: one secret
        self.cwd = cwd
        self._out = PrefixedSink(stdout or __import__("sys").stdout)
        self._err = PrefixedSink(stderr or __import__("sys").stderr)
        self._events: queue.SimpleQueue[tuple[str, str, int]] = queue.SimpleQueue()
        self.root = Path(tempfile.mkdtemp(prefix="hora-elastic-"))
        self.workers: dict[str, Worker] = {}
        self.hosts: dict[str, int] = {"localhost": self.ec.slots}
        self.blacklist = Blacklist(self.ec.blacklist_threshold, 60.0, *self.ec.cooldown)
        self.gen: rdzv.Generation | None = None
        self.gone = False  # the current generation's go was written
        self.began: rdzv.Generation | None = None  # the last generation that got its go
        self.generations = 0
        self.finishing = False
        self.failure = ""  # why the job failed (the driver stops it)
        self.fail_code = 1
        self.below_since: float | None = None
        self.history: list[tuple[float, int, int, str]] = []  # (time, generation, size, why)
        self._next_discovery = 0.0
        self._warned_remote = False
        self.early_failures = 0  # workers that died before reaching hvd.init()
        self._signal: int | None = None
        self._exits: list[RankExit] = []

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> LaunchResult:
        """Start the workers, drive the generations until every worker ended, clean up."""
        before = procs.child_pids()
        reaper = procs.set_subreaper(True)
        handlers = self._install_handlers()
        try:
            self._discover(time.monotonic(), first=True)
            if self._await_start():  # Horovod's rule: wait for -np slots, start on every one
                self._spawn_up_to(self.ec.max_np, "start")  # offered, up to --max-np
            while not self._done():
                self._step()
        finally:
            self._cleanup(before | {w.proc.pid for w in self.workers.values()}, reaper)
            for signum, old in handlers.items():
                signal.signal(signum, old)
        return self._result()

    def _await_start(self) -> bool:
        """Wait until the hosts offer ``-np`` slots (at most ``--elastic-timeout``), as Horovod.

        Horovod's elastic driver starts once ``-np`` slots are available, on every slot then
        offered up to ``--max-np``: a discovery script printing ``localhost:3`` with ``-np 2``
        and no ``--max-np`` starts 3 workers, in one first world.

        Returns:
            False when the job was stopped (a signal) or failed waiting.
        """
        since = time.monotonic()
        while len(self._free_slots(time.monotonic())) < self.config.np:
            now = time.monotonic()
            if now - since > self.ec.timeout:
                self._fail(f"fewer than -np {self.config.np} slots offered for "
                           f"{self.ec.timeout:g} s (--elastic-timeout)")  # fmt: skip
            self._drain_events()  # a signal ends the wait
            if self.failure or self._signal is not None:
                return False
            self._discover(now)
        return True

    def _done(self) -> bool:
        running = any(w.code is None for w in self.workers.values())
        return not running and (self.finishing or bool(self.failure) or self._signal is not None)

    def _step(self) -> None:
        now = time.monotonic()
        self._drain_events()
        if self.failure or self._signal is not None:
            return
        self._discover(now)
        self._collect_hellos()
        if not self.finishing:
            self._spawn_up_to(self.ec.max_np, "capacity")
        self._maybe_publish(now)
        self._maybe_go()
        self._check_limits(now)
        self._expel_removed(now)

    def _drain_events(self) -> None:
        try:
            kind, wid, value = self._events.get(timeout=TICK_S)
        except queue.Empty:
            return
        while True:
            if kind == "exit":
                self._on_exit(self.workers[wid], procs.exit_code(value))
            elif kind == "signal":
                self._on_signal(value)
            try:
                kind, wid, value = self._events.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------------ workers
    def _free_slots(self, now: float) -> list[str]:
        """One entry per free slot, by host (blacklisted hosts have none)."""
        out = []
        for host, slots in self.hosts.items():
            if self.blacklist.blocked(host, now):
                continue
            used = sum(1 for w in self.workers.values() if w.live and w.host == host)
            out += [host] * max(0, slots - used)
        return out

    def _spawn_up_to(self, target: int, why: str) -> None:
        live = sum(1 for w in self.workers.values() if w.live)
        for host in self._free_slots(time.monotonic())[: max(0, target - live)]:
            self._spawn(host, why)

    def _spawn(self, host: str, why: str) -> None:
        number = len(self.workers)
        wid = f"w{number}"
        env = self.worker_env(wid, host)
        pipe = preflight_pipe(env)  # the service's pipe for rank 0's preflight figures
        proc = subprocess.Popen(list(self.config.command), env=env, cwd=self.cwd,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                pass_fds=() if pipe is None else (pipe,))  # fmt: skip
        w = Worker(wid, number, host, proc)
        w.pumps = [
            start_pump(cast(IO[bytes], proc.stdout), prefix(number, "stdout"), self._out,
                       f"hora-out-{wid}"),
            start_pump(cast(IO[bytes], proc.stderr), prefix(number, "stderr"), self._err,
                       f"hora-err-{wid}"),
        ]  # fmt: skip
        threading.Thread(target=self._wait, args=(wid, proc), name=f"hora-wait-{wid}",
                         daemon=True).start()  # fmt: skip
        self.workers[wid] = w
        log.info("started worker %s (pid %d) on %s: %s", wid, proc.pid, host, why)

    def worker_env(self, wid: str, host: str) -> dict[str, str]:
        """The environment of worker ``wid`` on ``host`` (its rank is the generation's)."""
        hora = {**self._worker_world(wid, host), **TORCHRUN_DEFAULTS}
        return layered_env(self.base, rank=hora, defaults=TORCHRUN_DEFAULTS)

    def _worker_world(self, wid: str, host: str) -> dict[str, str]:
        n = self.config.np
        rank = min(len(self.workers), n - 1)  # replaced at hvd.init() by the generation's
        extra = {"HOROVOD_ELASTIC": "1", "HOROVOD_HOSTNAME": host}
        own = RankEnv(
            elastic_dir=str(self.root),
            elastic_worker=wid,
            elastic_timeout=self.ec.timeout,
            rdzv_secret=self._rdzv_secret,
            backend=self.config.backend or None,
            timeout=self.config.start_timeout,
        )
        return rank_env(rank, n, extra={**extra, **own.to_environ()})

    def _wait(self, wid: str, proc: subprocess.Popen[bytes]) -> None:
        self._events.put(("exit", wid, proc.wait()))

    def _on_exit(self, w: Worker, code: int) -> None:
        was_member = self.gen is not None and self.gen.rank_of(w.wid) is not None
        removed = w.removed_at is not None
        w.code = code
        stopping = bool(self.failure) or self._signal is not None
        self._exits.append(RankExit(w.number, code, stopped=removed or self.finishing or stopping))
        if stopping:
            return
        if removed:
            log.info("worker %s left (removed) with code %d", w.wid, code)
            return
        if code == 0:
            if not self.finishing:
                log.info("worker %s finished; waiting for the others", w.wid)
                self._dismiss_newcomers()
            self.finishing = True
            return
        why = f"worker {w.wid} on {w.host} exited with code {code}"
        if self.finishing:
            log.warning("%s after another finished", why)
            return
        log.warning("%s; %s", why, "re-forming the world" if was_member else "not a member")
        if not w.hello:
            self.early_failures += 1
            if self.gen is None or self.early_failures > 2 * self.ec.max_np + 3:
                self._fail(f"{why} before hvd.init()", code)
                return
        if self.blacklist.failed(w.host, time.monotonic()):
            log.warning("host %s blacklisted (repeated failures)", w.host)
        if was_member or w.hello:
            self._publish(why)

    def _dismiss_newcomers(self) -> None:
        """The job is ending: workers not in the last world that began leave (exit 0)."""
        now = time.monotonic()
        began = self.began
        for other in self.workers.values():
            if other.live and (began is None or began.rank_of(other.wid) is None):
                other.removed_at = now
                rdzv.mark(self.root, f"removed.{other.wid}")

    # ------------------------------------------------------------------ hosts
    def _discover(self, now: float, first: bool = False) -> None:
        if (self.ec.discovery is None and self.ec.host_file is None) or now < self._next_discovery:
            return
        self._next_discovery = now + DISCOVERY_EVERY_S
        try:
            found = self._read_hosts()
        except SpecError as e:
            if first:
                raise
            log.warning("%s (keeping the hosts found before)", e)
            return
        remote = sorted(h for h in found if h not in LOCAL_NAMES)
        if remote and not self._warned_remote:
            log.warning("hosts %s are not this machine: hora run starts workers on this "
                        "machine only for now; their slots are not used", ", ".join(remote))
            self._warned_remote = True
        found = {h: n for h, n in found.items() if h in LOCAL_NAMES}
        if found != self.hosts:
            log.info("hosts: %s", ", ".join(f"{h}:{s}" for h, s in found.items()) or "none")
        self.hosts = found
        self._remove_beyond_slots(now)

    def _read_hosts(self) -> dict[str, int]:
        if self.ec.discovery is not None:
            return discover(self.ec.discovery)
        assert self.ec.host_file is not None
        try:
            return parse_hosts_output(self.ec.host_file.read_text())
        except OSError as e:
            raise SpecError("--host-file", f"cannot read {str(self.ec.host_file)!r}: {e}") from None

    def _remove_beyond_slots(self, now: float) -> None:
        """Take out workers whose host went away or lost slots (the newest first)."""
        for host in {w.host for w in self.workers.values() if w.live}:
            on_host = sorted((w for w in self.workers.values() if w.live and w.host == host),
                             key=lambda w: w.number)  # fmt: skip
            for w in on_host[self.hosts.get(host, 0):]:
                w.removed_at = now
                rdzv.mark(self.root, f"removed.{w.wid}")
                log.info("worker %s removed: host %s has fewer slots now", w.wid, host)
        if any(w.removed_at == now for w in self.workers.values()):
            self._publish("hosts removed")

    def _collect_hellos(self) -> None:
        new = [w for w in self.workers.values()
               if w.live and not w.hello and rdzv.has(self.root, f"hello.{w.wid}")]  # fmt: skip
        for w in new:
            w.hello = True
        if self.gen is None:  # the first world: wait for every worker started
            starting = [w for w in self.workers.values() if w.live and not w.hello]
            if not starting and any(w.live for w in self.workers.values()):
                self._publish("start")
        elif not self.gen.ready:
            pass  # _maybe_publish: once there are --min-np of them
        elif new and self.gone:
            self._publish(f"worker {', '.join(w.wid for w in new)} joined")
        elif new:  # a world is forming: add them once it began
            for w in new:
                w.hello = False

    # ------------------------------------------------------------------ generations
    def _members(self) -> list[Worker]:
        """Live workers that reached hvd.init(), old members first in their old order."""
        ready = [w for w in self.workers.values() if w.live and w.hello]
        old = {m.wid: r for r, m in enumerate(self.gen.members)} if self.gen else {}
        return sorted(ready, key=lambda w: (old.get(w.wid, len(old)), w.number))

    def _publish(self, why: str) -> None:
        members = self._members()
        number = (self.gen.number if self.gen else 0) + 1
        if len(members) < self.ec.min_np or not members:
            gen = rdzv.Generation(number, (), "127.0.0.1", 0, ready=False,
                                  note=f"{why}: waiting for capacity ({len(members)} of "
                                       f"--min-np {self.ec.min_np} workers)")  # fmt: skip
            if self.below_since is None:
                self.below_since = time.monotonic()
                log.warning("%s", gen.note)
        else:
            order = rdzv.members_for([(w.wid, w.host) for w in members])
            gen = rdzv.Generation(number, order, self.config.master_addr,
                                  free_port(self.config.master_addr), note=why)  # fmt: skip
            self.below_since = None
            self.generations += 1
            self.history.append((time.time(), number, len(order), why))
            log.info("generation %d: %s (%s)", number, count(len(order), "worker"), why)
            if self.ec.report:
                pids = {w.wid: w.proc.pid for w in members}
                log.info("%s", rdzv.membership_line(gen, pids, time.time()))
        self.gen, self.gone = gen, False
        rdzv.write_generation(self.root, gen)

    def _maybe_publish(self, now: float) -> None:
        if self.gen is None or self.finishing:
            return
        asked = rdzv.reset_requests(self.root)
        current = {m.wid for m in self.gen.members}
        if self.gen.ready and any(n == self.gen.number and w in current for w, n in asked.items()):
            self._publish("a member's collective failed")
        elif not self.gen.ready and len(self._members()) >= self.ec.min_np:
            self._publish("capacity returned")

    def _maybe_go(self) -> None:
        gen = self.gen
        if gen is None or not gen.ready or self.gone:
            return
        if not rdzv.missing_arrivals(self.root, gen):
            rdzv.mark(self.root, f"go.{gen.number}")
            self.gone, self.began = True, gen

    def _check_limits(self, now: float) -> None:
        limit = self.ec.reset_limit
        if limit is not None and self.generations - 1 > limit:
            worlds = count(self.generations - 1, "re-formed world")
            self._fail(f"reset limit {limit} reached ({worlds})")
        elif self.below_since is not None and now - self.below_since > self.ec.timeout:
            self._fail(f"fewer than --min-np {self.ec.min_np} workers for "
                       f"{self.ec.timeout:g} s (--elastic-timeout)")  # fmt: skip

    def _expel_removed(self, now: float) -> None:
        for w in self.workers.values():
            late = w.removed_at is not None and now - w.removed_at > _REMOVED_GRACE_S
            if w.code is None and late:
                procs.signal_group(w.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ stopping
    def _fail(self, why: str, code: int = 1) -> None:
        log.error("%s; stopping the job", why)
        self.failure, self.fail_code = why, code
        self._stop(signal.SIGTERM)

    def _stop(self, sig: int) -> None:
        running = [w for w in self.workers.values() if w.code is None]
        for w in running:
            procs.signal_group(w.proc.pid, sig)
        threading.Timer(self.config.grace_period, self._kill_all).start()

    def _kill_all(self) -> None:
        for w in list(self.workers.values()):
            if w.code is None:
                procs.signal_group(w.proc.pid, signal.SIGKILL)

    def _on_signal(self, signum: int) -> None:
        if self._signal is not None:
            self._kill_all()
            return
        self._signal = signum
        self._stop(FORWARDED.get(signal.Signals(signum), signal.SIGTERM))

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {int(s): signal.signal(s, lambda n, _f: self._events.put(("signal", "", n)))
                for s in FORWARDED}  # fmt: skip

    def _cleanup(self, exclude: set[int], reaper: bool) -> None:
        for w in self.workers.values():
            if w.code is None:
                procs.signal_group(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
            procs.signal_group(w.proc.pid, signal.SIGKILL)  # what it left in its group
        if reaper:
            procs.reap_adopted(exclude)
            procs.set_subreaper(False)
        for w in self.workers.values():
            for t in w.pumps:
                t.join(timeout=5.0)
        for path in self.root.iterdir():
            path.unlink(missing_ok=True)
        self.root.rmdir()

    def _result(self) -> LaunchResult:
        if self.failure:
            code = self.fail_code or 1
        elif self._signal is not None:
            code = 128 + self._signal
        else:
            finals = [e for e in self._exits if e.stopped and e.code != 0
                      and self.workers[f"w{e.rank}"].removed_at is None]  # fmt: skip
            code = finals[0].code if finals else 0
        return LaunchResult(exit_code=code, exits=tuple(self._exits), signal=self._signal,
                            pids=tuple(w.proc.pid for w in self.workers.values()))  # fmt: skip


def launch_elastic(config: LaunchConfig, base_env: Mapping[str, str] | None = None, *,
                   stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                   cwd: Path | None = None) -> LaunchResult:  # fmt: skip
    """Run an elastic job (``config.elastic`` set) to its end; see :class:`ElasticDriver`.

    Returns:
        The :class:`LaunchResult`: exit code 0 when the workers finished; the reason of a
        failure is logged (reset limit, too few workers for too long, a signal).
    """
    driver = ElasticDriver(config, os.environ if base_env is None else base_env,
                           stdout=stdout, stderr=stderr, cwd=cwd)  # fmt: skip
    return driver.run()


__all__ = ["ElasticConfig", "ElasticDriver", "Worker", "launch_elastic"]
