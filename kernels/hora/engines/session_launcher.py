"""The engines of a notebook asked of the hora service: :class:`SessionLauncher` (data plane).

When a service is configured, a notebook's cluster (:class:`hora.engines.session.ServiceCluster`)
starts only the ipyparallel controller here and asks the service for the engines as a session
(``POST /v1/sessions`` with the controller's connection info); it waits in the service's queue
(Ctrl-C withdraws the request), heartbeats the session while it runs, asks for new engines for
dead ranks (``.../replace``) and says why when the service ended the session. It is an
:class:`~hora.engines.launchers.EngineLauncher`, like the kernel-local one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from hora.client import Client, ServiceError
from hora.engines import bootstrap, plan
from hora.engines.errors import EngineError, EngineStartError, rank_ranges
from hora.engines.heartbeat import SessionHeartbeat
from hora.engines.launchers import (
    AskedEngine,
    EngineProcess,
    KernelProcesses,
    Launched,
    RemoteProcess,
    world_file,
)
from hora.errors import EngineRunning, HoraError, SpecError
from hora.net import is_local_address, route_source
from hora.session_wire import (
    EngineConnection,
    EngineReplacement,
    ResumeRequest,
    SessionAddress,
    SessionRequest,
    body,
    wire,
)
from hora.spec import RuntimeName, SessionInfo

log = logging.getLogger("hora.engines")

POLL_S = 0.25
ASK_S = 10.0  # how long a new engine is asked for while the service sees the old one run


class SessionWithdrawn(EngineError):
    """``%dist_start`` was interrupted while queued; the request left the queue."""


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
        image: with the ``docker`` runtime, the engines' image (it must have hora).

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
        image: str | None = None,
    ) -> None:
        super().__init__(options)
        if options.gpus is not None:
            raise SpecError("gpus", "the service chooses a session's GPUs; leave out --gpus")
        if ip is not None and runtime != RuntimeName.slurm:
            raise SpecError("ip", "only engines on Slurm nodes need another address than 127.0.0.1")
        self.runtime, self.ip, self.image = runtime, ip, image
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
        self.resuming: int | None = None  # the parked session the next launch resumes
        self.on_park: Callable[[str], None] | None = None  # the service asks for a park

    @property
    def where(self) -> str:
        """Where the engines come from, for the magics' output."""
        sid = f"session {self.session.id}" if self.session else "a session"
        if self.runtime == RuntimeName.slurm:
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
        ports = self._hold(plan.CONNECTION_PORTS, self.address)
        internal = self._hold(plan.INTERNAL_PORTS)  # on the loopback; never one of ``ports``
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
        argv = plan.controller_argv(directory, reuse=True, ip=self.address, ports=internal)
        self._controller = self._spawn(argv, plan.controller_env(os.environ, keys), "controller")
        return engine

    def _address(self) -> str:
        """Where the controller listens: the loopback, or an address the Slurm nodes reach.

        On Slurm: the address the service names for its own machine, or, for a kernel on
        another machine (a user's server that runs as a Slurm job on a node), this
        machine's address towards the service's.
        """
        if self.runtime != RuntimeName.slurm:
            return "127.0.0.1"
        if self.ip is not None:
            return self.ip
        resp = self.service.request("GET", "/v1/session-address", params={"runtime": "slurm"})
        named = SessionAddress.model_validate(resp.json()).address
        if is_local_address(named):
            return named
        host = urlsplit(self.service.url).hostname or named
        try:
            return route_source(host)
        except OSError as e:
            raise SpecError(
                "ip",
                f"cannot tell this machine's address towards the service ({host}: {e}); "
                "give one the Slurm nodes reach with --ip",
            ) from None

    def _ask(self, n: int, connection: dict[str, Any]) -> None:
        """Ask for a new session, or to resume the parked one (:attr:`resuming`).

        Raises:
            SpecError: the request is not one the service takes (naming the field).
        """
        conn = body(EngineConnection, **connection)
        where: dict[str, Any] = {}
        if self.runtime == RuntimeName.local and self._dir:  # where re-formed worlds meet
            where["world_file"] = str(world_file(self._dir))
        req: BaseModel
        if self.resuming is not None:
            req = body(ResumeRequest, connection=conn, workers=self.options.n, **where)
            path = f"/v1/sessions/{self.resuming}/resume"
        else:
            req = body(
                SessionRequest, connection=conn, workers=n, backend=self.options.backend,
                timeout_s=self.options.timeout_s, start_timeout_s=self.options.start_timeout_s,
                threads=self.options.threads, idle_timeout_s=self.idle_timeout_s,
                runtime=self.runtime, image=self.image, **where,
            )  # fmt: skip
            path = "/v1/sessions"
        with interrupt_after():  # the answer names the session that stop() withdraws
            self.session = SessionInfo.model_validate(
                self.service.request("POST", path, json=wire(req)).json()
            )
        self.asked = self.session.id
        beat = Client(self.service.url, self.service.token)
        period = max(0.2, self.session.lease_s / 3)
        self.heartbeat = SessionHeartbeat(
            beat, self.session.id, period, self._idle, self.notify, self.on_park
        )
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

        A Slurm session is ``queued`` until Slurm runs its job (``queue`` then carries
        Slurm's pending reason, shown); the engines' start timeout counts from then.
        """
        t0 = time.perf_counter()
        while True:
            info = self._get()
            slurm = self.runtime == RuntimeName.slurm
            if info.state == "running" or (info.state == "starting" and not slurm):
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

    def placed(self, info: bootstrap.InitAnswer) -> tuple[int, EngineProcess]:
        """The rank the engine reports, and its process watched by its pid."""
        here = "error" not in info and info["host"] == socket.gethostname()
        if here and self.runtime == RuntimeName.local:
            return int(info.get("rank", -1)), RemoteProcess(int(info["pid"]))
        # on a Slurm node or in a container (its own pid namespace, the host's name): its pid
        # means nothing here, and is never signalled; the service says when it is gone
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
        try:
            ask = wire(body(EngineReplacement, rank=rank, master_port=port))
        except SpecError as e:
            raise EngineStartError(f"the service did not start a new engine: {e}") from None
        until = time.monotonic() + ASK_S
        while True:
            try:
                self.service.request("POST", f"/v1/sessions/{self.session.id}/replace", json=ask)
                return AskedEngine()
            except ServiceError as e:
                if e.code != EngineRunning.code or time.monotonic() > until:
                    raise EngineStartError(f"the service did not start a new engine: {e}") from e
            time.sleep(POLL_S)

    def started(self, devices: Sequence[str]) -> None:
        """The engines chose their backend by their devices; they are idle from now."""
        super().started(devices)
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
        if over is None and self.runtime == RuntimeName.local:
            return None
        if over is not None:
            return _ended_reason(over)
        return f"{rank_ranges(sorted(dead))} died; the hora service ends the session"

    def withdrawn(self) -> EngineError | None:
        """The start was interrupted while queued: the session is withdrawn by :meth:`stop`.

        A parked session asked to resume goes back to being parked, its snapshot kept.
        """
        sid = self.session.id if self.session else "?"
        if self.resuming is not None:
            return SessionWithdrawn(
                f"interrupted: session {sid} left the queue and stays parked; the next "
                "%%distributed cell (or %dist_resume) asks for its engines again"
            )
        return SessionWithdrawn(
            f"interrupted: session {sid} withdrawn from the queue; run %dist_start again "
            "to ask for engines"
        )

    @contextmanager
    def cell(self) -> Iterator[None]:
        """A running cell is activity: the engines are not idle meanwhile."""
        self.busy = True
        if self.heartbeat is not None:
            self.heartbeat.nudge()  # the service hears of the cell now, not a period later
        try:
            yield
        finally:
            self.busy = False
            self.last_active = time.monotonic()

    def stop(self) -> None:
        """Stop the heartbeat, end the session (its engines), stop the controller.

        A resumed session still queued goes back to being parked instead (its snapshot is
        kept); a parked one (:attr:`resuming`, no engines) is ended, its snapshot deleted.
        """
        self._end_heartbeat()
        sid = self.session.id if self.session is not None else self.resuming
        if sid is not None and (self.session is None or not self.session.ended):
            back = self.resuming is not None and self.session is not None
            method, path = ("POST", f"/v1/sessions/{sid}/withdraw") if back else (
                "DELETE", f"/v1/sessions/{sid}")  # fmt: skip
            try:
                self.service.request(method, path)
            except HoraError as e:  # the lease frees the slots if the service cannot hear us
                log.warning("could not end session %s: %s", sid, e)
        self.session = None
        self.resuming = None
        super().stop()

    def release(self) -> None:
        """The service parked the session: stop heartbeating and the controller, end nothing.

        The next :meth:`launch` resumes the session (:attr:`resuming`).
        """
        self._end_heartbeat()
        if self.session is not None:
            self.resuming = self.session.id
        self.session = None
        super().stop()

    def forget(self) -> None:
        """Let go of a parked session without ending it (the kernel exits): it stays parked."""
        self._end_heartbeat()
        self.session = None
        self.resuming = None
        super().stop()

    def _end_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None


def _ended_reason(ended: SessionInfo) -> str:
    return f"the hora service ended session {ended.id}: {ended.reason or ended.state}"


@contextmanager
def interrupt_after() -> Iterator[None]:
    """Hold the notebook's interrupt (SIGINT) until the block ends, then deliver it again.

    Around a request whose answer must be kept: the session a POST creates (or resumes) is
    what an interrupted start withdraws. Interrupted while the answer was on its way, the
    kernel would not know the session, which would stay queued on the service until its
    lease ran out (or, for a resume, be ended instead of put back). The request has its own
    timeout. A held interrupt goes, after the block, to the handler that was there before
    (a kernel's raises KeyboardInterrupt). Only in the main thread, where Python runs signal
    handlers, and not where SIGINT is ignored; an error from the block goes out instead.
    """
    before = signal.getsignal(signal.SIGINT)
    if (threading.current_thread() is not threading.main_thread()
            or before in (None, signal.SIG_IGN)):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held:
        signal.raise_signal(signal.SIGINT)
