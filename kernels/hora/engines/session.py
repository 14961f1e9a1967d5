"""Engines from the hora service: a cluster whose engines are a scheduled session (data plane).

When a service is configured (``HORA_URL`` / ``HORA_TOKEN`` or ``~/.hora/config``, as ``hora
up`` writes), ``%dist_start`` asks it for engines instead of starting them itself: the kernel
starts only the ipyparallel controller, sends its engine connection info to ``POST
/v1/sessions``, and waits in the service's queue (the position, what holds the slots and an
estimate are shown live; Ctrl-C withdraws the request). The service starts the engines like a
job's ranks (the owner's account, containment, rank environment, GPU binding); they register
with the controller and the cluster works as a kernel-local one.

A background thread heartbeats the session: the service frees the slots of a kernel that stops
(kill -9) once the lease runs out, and with each heartbeat learns how long the engines have
been idle; its warning before the idle timeout is shown in the notebook, and once the service
ended the session the next ``%%distributed`` cell says why and how to get engines back.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from hora.client import Client, ServiceError
from hora.client_config import config_path
from hora.engines import plan
from hora.engines.cluster import Cluster, kernel_cuda_initialized
from hora.engines.errors import EngineError, EngineStartError, rank_ranges
from hora.engines.launchers import (
    AskedEngine,
    EngineProcess,
    KernelProcesses,
    Launched,
    RemoteProcess,
    world_file,
)
from hora.engines.state import ClusterState
from hora.errors import HoraError, SpecError
from hora.net import free_port, is_local_address, route_source
from hora.spec import SessionInfo

log = logging.getLogger("hora.engines")

POLL_S = 0.25
ASK_S = 10.0  # how long a new engine is asked for while the service sees the old one run


class SessionWithdrawn(EngineError):
    """``%dist_start`` was interrupted while queued; the request left the queue."""


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_queue(info: SessionInfo, now: datetime, waited_s: float = 0.0) -> str:
    """What a queued ``%dist_start`` shows: place, who holds the slots, an estimate.

    Example:
        >>> print(render_queue(info, now))  # doctest: +SKIP
        session 7 queued: position 1; waiting for 2 slot(s); 0 free (waited 3s; Ctrl-C withdraws)
          job 5 (bob) holds slots 0,1 since 12:00:01 (5 min)
          no estimate: what holds the slots has no time limit
    """
    q = info.queue
    if q is None:
        return f"session {info.id} {info.state}"
    if q.position == 0:  # handed to a runtime whose own queue holds it (Slurm)
        return (
            f"session {info.id} waits in the runtime's queue: {q.reason} "
            f"(waited {_ago(waited_s)}; Ctrl-C withdraws)"
        )
    lines = [
        f"session {info.id} queued: position {q.position}; {q.reason} "
        f"(waited {_ago(waited_s)}; Ctrl-C withdraws)"
    ]
    for h in q.holders:
        since = h.since.astimezone().strftime("%H:%M:%S")
        held = _ago(max(0.0, (now - h.since).total_seconds()))
        idle = f", idle {_ago(h.idle_s)}" if h.idle_s is not None else ""
        ends = f", ends by {h.ends_at.astimezone():%H:%M:%S}" if h.ends_at else ""
        slots = ",".join(map(str, h.slots))
        who = h.what or f"{h.kind} {h.id} ({h.user})"  # what: a holder outside the service
        lines.append(f"  {who} holds slots {slots} since {since} ({held}{idle}{ends})")
    if q.estimate_at is not None:
        left = max(0.0, (q.estimate_at - now).total_seconds())
        lines.append(
            f"  estimate: slots free by {q.estimate_at.astimezone():%H:%M:%S} (~{_ago(left)})"
        )
    elif q.holders:
        lines.append("  no estimate: what holds the slots has no time limit")
    return "\n".join(lines)


def service_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a hora service is configured for this kernel (env or ``~/.hora/config``).

    Example:
        >>> service_configured({"HORA_URL": "http://127.0.0.1:8000"})
        True
    """
    env = os.environ if environ is None else environ
    return bool(env.get("HORA_URL") or env.get("HORA_TOKEN")) or config_path(env).is_file()


class SessionHeartbeat:
    """Renews the session's lease from a background thread; keeps the warnings and the end.

    Args:
        service: a client of its own (the kernel's thread uses another).
        session_id: the session.
        period: seconds between heartbeats.
        idle: returns how long the engines have been idle, in seconds.
        notify: shows a notice in the notebook (a warning, or why the session ended).
    """

    def __init__(
        self,
        service: Client,
        session_id: int,
        period: float,
        idle: Callable[[], float],
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.service, self.session_id, self.period = service, session_id, period
        self.idle, self.notify = idle, notify
        self.ended: SessionInfo | None = None
        self.notices: list[str] = []
        self._warned: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the lease then runs out unless the session is deleted)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.service.close()

    def beat(self) -> SessionInfo:
        """Send one heartbeat; note a new warning or the session's end."""
        path = f"/v1/sessions/{self.session_id}/heartbeat"
        info = SessionInfo.model_validate(
            self.service.request("POST", path, json={"idle_s": self.idle()}).json()
        )
        if info.ended:
            self.ended = info
            self._notice(f"hora: session {info.id} ended: {info.reason or info.state}")
        elif info.warning and self._warned is None:
            self._warned = info.warning
            self._notice(f"hora: {info.warning}")
        elif not info.warning:
            self._warned = None
        return info

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        if self.notify is not None:
            self.notify(text)

    def take_notices(self) -> list[str]:
        """The notices not shown yet (for the next cell's output)."""
        out, self.notices = self.notices, []
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                if self.beat().ended:
                    return
            except Exception as e:  # the service may be restarting: the lease covers a gap
                log.debug("heartbeat of session %d failed: %s", self.session_id, e)


class SessionLauncher(KernelProcesses):
    """Starts the controller here and asks the hora service for the engines (a session).

    Args:
        options: how many engines, backend, timeouts (``gpus`` is the service's choice).
        service: the service client (default: :class:`hora.Client` from the configuration).
        progress: called with the session while it is queued (the magic shows it live).
        notify: shows heartbeat notices (idle warning, the session's end) in the notebook.
        idle_timeout_s: the idle timeout to ask for (default: the service's).
        runtime: where the service starts the engines: ``local`` (its machine) or ``slurm``
            (one Slurm job; the controller then listens on an address the nodes reach).
        ip: that address (default: the one the service names, ``GET /v1/session-address``).
        ready: whether the cluster is ready (a cluster that is not counts as never idle).

    Raises:
        SpecError: ``gpus`` given, or ``ip`` without the ``slurm`` runtime.
    """

    def __init__(
        self,
        options: plan.ClusterOptions,
        service: Client | None = None,
        progress: Callable[[SessionInfo], None] | None = None,
        notify: Callable[[str], None] | None = None,
        idle_timeout_s: float | None = None,
        runtime: str = "local",
        ip: str | None = None,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__(options)
        if options.gpus is not None:
            raise SpecError("gpus", "the service chooses a session's GPUs; leave out --gpus")
        if ip is not None and runtime != "slurm":
            raise SpecError("ip", "only engines on Slurm nodes need another address than 127.0.0.1")
        self.runtime, self.ip = runtime, ip
        self.address = "127.0.0.1"  # where the controller listens (set at start)
        self.service = service or Client()
        self.progress, self.notify = progress, notify
        self.idle_timeout_s = idle_timeout_s
        self.ready = ready
        self.session: SessionInfo | None = None
        self.asked: int | None = None  # the id of the last session asked for (kept after stop)
        self.heartbeat: SessionHeartbeat | None = None
        self.queued_s = 0.0
        self.busy = False
        self.last_active = time.monotonic()
        self._last_check = 0.0

    @property
    def where(self) -> str:
        """Where the engines come from, for the magics' output."""
        sid = f"session {self.session.id}" if self.session else "a session"
        if self.runtime == "slurm":
            sid += f", on Slurm nodes; the controller listens on {self.address} for them"
        return f"the hora service at {self.service.url} ({sid})"

    def prepare(self) -> None:
        """Nothing to check here: the service chooses the GPUs."""

    def launch(self, deadline: float) -> Launched:
        """Start the controller, ask for a session, wait for its slots.

        Returns:
            The session's engines, awaited for ``start_timeout_s`` from when it got slots.

        Raises:
            EngineStartError: the session ended before it got slots.
        """
        connection = self._start_controller()
        self._ask(self.options.n or plan.DEFAULT_CPU_ENGINES, connection)
        self._wait_for_slots()
        assert self.session is not None
        return Launched(self.session.workers, time.perf_counter() + self.options.start_timeout_s)

    def _start_controller(self) -> dict[str, Any]:
        """Start the controller on connection files chosen here; return the engines' file.

        The engines need not wait for the controller: the service starts them while it
        comes up (``--reuse`` makes it bind the ports the files name). Its sockets speak
        CurveZMQ: only a peer given its public key (the service's engines) gets through,
        though another user's engines share the host's loopback (or the nodes' network).
        """
        directory = self._open()
        self.backend = self.options.backend or "gloo"  # the engines' own init already chose
        self.address = self._address()
        ports: set[int] = set()
        while len(ports) < plan.CONNECTION_PORTS:
            ports.add(free_port(self.address))
        keys = plan.curve_keys()  # the public key goes only to the service, in the request
        engine, client = plan.connection_files(
            sorted(ports), str(uuid.uuid4()), socket.gethostname(), self.address, keys[0]
        )
        security = directory / "security"
        security.mkdir(mode=0o700)
        for name, info in (("engine", engine), ("client", client)):
            path = security / f"ipcontroller-{plan.CLUSTER_ID}-{name}.json"
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                json.dump(info, f)
        argv = plan.controller_argv(directory, reuse=True, ip=self.address)
        self._controller = self._spawn(argv, plan.controller_env(os.environ, keys), "controller")
        return engine

    def _address(self) -> str:
        """Where the controller listens: the loopback, or an address the Slurm nodes reach.

        On Slurm: the address the service names for its own machine, or, for a kernel on
        another machine (a user's server that runs as a Slurm job on a node), this
        machine's address towards the service's.
        """
        if self.runtime != "slurm":
            return "127.0.0.1"
        if self.ip is not None:
            return self.ip
        resp = self.service.request("GET", "/v1/session-address", params={"runtime": "slurm"})
        named = str(resp.json()["address"])
        if is_local_address(named):
            return named
        host = urlsplit(self.service.url).hostname or named
        try:
            return route_source(host)
        except OSError as e:
            raise SpecError(
                "ip", f"cannot tell this machine's address towards the service ({host}: {e}); "
                "give one the Slurm nodes reach with --ip",
            ) from None

    def _ask(self, n: int, connection: dict[str, Any]) -> None:
        body = {
            "workers": n,
            "connection": connection,
            "backend": self.options.backend,
            "timeout_s": self.options.timeout_s,
            "start_timeout_s": self.options.start_timeout_s,
            "threads": self.options.threads,
            "idle_timeout_s": self.idle_timeout_s,
            "runtime": self.runtime,
        }
        if self.runtime == "local" and self._dir is not None:  # where re-formed worlds meet
            body["world_file"] = str(world_file(self._dir))
        self.session = SessionInfo.model_validate(
            self.service.request("POST", "/v1/sessions", json=body).json()
        )
        self.asked = self.session.id
        beat = Client(self.service.url, self.service.token)
        period = max(0.2, self.session.lease_s / 3)
        self.heartbeat = SessionHeartbeat(beat, self.session.id, period, self._idle, self.notify)
        self.heartbeat.start()

    def _idle(self) -> float:
        if self.busy or not self.ready():
            return 0.0
        return time.monotonic() - self.last_active

    def _get(self) -> SessionInfo:
        assert self.session is not None
        resp = self.service.request("GET", f"/v1/sessions/{self.session.id}")
        self.session = SessionInfo.model_validate(resp.json())
        return self.session

    def _wait_for_slots(self) -> None:
        """Wait while the session is queued, here or in Slurm's queue.

        A Slurm session is ``starting`` until Slurm runs its job (``queue`` then carries
        Slurm's pending reason, shown); the engines' start timeout counts from then.
        """
        t0 = time.perf_counter()
        while True:
            info = self._get()
            if info.state == "running" or (info.state == "starting" and self.runtime != "slurm"):
                break
            if info.ended:
                raise EngineStartError(f"session {info.id} {info.state}: {info.reason}")
            if self.progress is not None:
                self.progress(info)
            time.sleep(POLL_S)
        self.queued_s = time.perf_counter() - t0

    def check_alive(self, what: str) -> None:
        """As for kernel-local engines, and the session must not have ended meanwhile."""
        super().check_alive(what)
        now = time.monotonic()
        if self.session is None or now - self._last_check < POLL_S:
            return
        self._last_check = now
        info = self._get()
        if info.ended:
            raise EngineStartError(f"session {info.id} {info.state} while {what}: {info.reason}")

    def placed(self, info: Mapping[str, Any]) -> tuple[int, EngineProcess]:
        """The rank the engine reports, and its process watched by its pid."""
        if info.get("host") == socket.gethostname():
            return int(info.get("rank", -1)), RemoteProcess(int(info["pid"]))
        # on a Slurm node: its pid means nothing here; the service says when it is gone
        return int(info.get("rank", -1)), RemoteProcess(int(info["pid"]), self._ended)

    def _ended(self) -> bool:
        beat = self.heartbeat
        return beat is not None and beat.ended is not None

    def spawn_engines(self, ranks: Sequence[int], port: int) -> list[EngineProcess]:
        """Ask the service for new engines of ``ranks``; they meet the survivors at ``port``."""
        procs = [self._spawn_engine(rank, port) for rank in ranks]
        self._pending = list(zip(ranks, procs, strict=True))
        return procs

    def _spawn_engine(self, rank: int, port: int) -> EngineProcess:
        """Ask the service for a new engine of ``rank``; it meets the survivors at ``port``.

        The service keeps a dead engine's slot for it (local sessions; on docker and Slurm a
        dead engine ends the session). It may not have seen the death yet: asked again
        for up to :data:`ASK_S` while it says the engine runs.
        """
        if self.session is None:
            raise EngineStartError("no session to start an engine in")
        body = {"rank": rank, "master_port": port}
        until = time.monotonic() + ASK_S
        while True:
            try:
                self.service.request("POST", f"/v1/sessions/{self.session.id}/replace", json=body)
                return AskedEngine()
            except ServiceError as e:
                if e.status != 409 or "is running" not in str(e) or time.monotonic() > until:
                    raise EngineStartError(f"the service did not start a new engine: {e}") from e
            time.sleep(POLL_S)

    def started(self, devices: Sequence[str]) -> None:
        """The engines chose their backend by their devices; they are idle from now."""
        self.backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        self.last_active = time.monotonic()

    def _session_over(self, procs: Sequence[EngineProcess]) -> SessionInfo | None:
        """The session as it ended, if the service ended it (asked now if an engine is gone)."""
        beat = self.heartbeat
        if beat is None:
            return None
        if beat.ended is None and any(p.poll() is not None for p in procs):
            try:
                beat.beat()  # why are the engines gone? (the thread may not have asked yet)
            except HoraError as e:
                log.debug("asking about session %d: %s", beat.session_id, e)
        return beat.ended

    def ended(self, procs: Sequence[EngineProcess]) -> str | None:
        """Why the session's engines are gone, once the service ended the session."""
        over = self._session_over(procs)
        return None if over is None else _ended_reason(over)

    def after_death(self, dead: Sequence[int], procs: Sequence[EngineProcess]) -> str | None:
        """A session's engine died: the service starts a new one (local), or ends the session.

        On the local runtime the service keeps the dead engine's slot and starts a new
        engine when asked (:meth:`spawn_engines`): None, the cluster replaces it and the
        survivors keep their variables, as with kernel-local engines. On docker and Slurm
        it ends the session: say why.
        """
        over = self._session_over(procs)
        if over is None and self.runtime == "local":
            return None
        if over is not None:
            return _ended_reason(over)
        return f"{rank_ranges(sorted(dead))} died; the hora service ends the session"

    def withdrawn(self) -> EngineError | None:
        """The start was interrupted while queued: the session is withdrawn by :meth:`stop`."""
        sid = self.session.id if self.session else "?"
        return SessionWithdrawn(
            f"interrupted: session {sid} withdrawn from the queue; run %dist_start again "
            "to ask for engines"
        )

    @contextmanager
    def cell(self) -> Iterator[None]:
        """A running cell is activity: the engines are not idle meanwhile."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False
            self.last_active = time.monotonic()

    def stop(self) -> None:
        """Stop the heartbeat, end the session (its engines), stop the controller."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.session is not None and not self.session.ended:
            try:
                self.service.request("DELETE", f"/v1/sessions/{self.session.id}")
            except HoraError as e:  # the lease frees the slots if the service cannot hear us
                log.warning("could not end session %d: %s", self.session.id, e)
        self.session = None
        super().stop()


def _ended_reason(ended: SessionInfo) -> str:
    return f"the hora service ended session {ended.id}: {ended.reason or ended.state}"


class ServiceCluster(Cluster):
    """A :class:`Cluster` whose engines are a session of the hora service (module docstring).

    It only wires a :class:`SessionLauncher` and shows its session.

    Args:
        options: how many engines, backend, timeouts (``gpus`` is the service's choice).
        service: the service client (default: :class:`hora.Client` from the configuration).
        progress: called with the session while it is queued (the magic shows it live).
        notify: shows heartbeat notices (idle warning, the session's end) in the notebook.
        idle_timeout_s: the idle timeout to ask for (default: the service's).
        cuda_check: as for :class:`Cluster`.
        runtime: where the service starts the engines: ``local`` (its machine) or ``slurm``
            (one Slurm job; the controller then listens on an address the nodes reach).
        ip: that address (default: the one the service names, ``GET /v1/session-address``).

    Example:
        >>> c = ServiceCluster(plan.ClusterOptions(n=2))  # doctest: +SKIP
        >>> c.start(); c.session.id  # doctest: +SKIP
        12
    """

    launcher: SessionLauncher

    def __init__(
        self,
        options: plan.ClusterOptions | None = None,
        service: Client | None = None,
        progress: Callable[[SessionInfo], None] | None = None,
        notify: Callable[[str], None] | None = None,
        idle_timeout_s: float | None = None,
        cuda_check: Callable[[], bool] = kernel_cuda_initialized,
        runtime: str = "local",
        ip: str | None = None,
    ) -> None:
        options = options or plan.ClusterOptions()
        launcher = SessionLauncher(
            options, service, progress, notify, idle_timeout_s, runtime, ip,
            ready=lambda: self.state is ClusterState.READY,
        )  # fmt: skip
        super().__init__(options, cuda_check, launcher)

    @property
    def session(self) -> SessionInfo | None:
        """The session, as the service last answered it (None when stopped)."""
        return self.launcher.session

    @property
    def asked(self) -> int | None:
        """The id of the last session asked for (kept after stop)."""
        return self.launcher.asked

    @property
    def heartbeat(self) -> SessionHeartbeat | None:
        """The session's heartbeat thread (None when stopped)."""
        return self.launcher.heartbeat

    @property
    def queued_s(self) -> float:
        """How long the last start waited in the queue."""
        return self.launcher.queued_s

    @property
    def where(self) -> str:
        """Where the engines come from, for the magics' output."""
        return self.launcher.where
