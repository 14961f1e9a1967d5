"""How a cluster's engines come to be: the launcher protocol, the kernel-local one (data plane).

A :class:`hora.engines.cluster.Cluster` holds one :class:`EngineLauncher` (in its
:class:`~hora.engines.group.EngineGroup`). The cluster connects the client, initialises
``hora.torch``, runs cells and recovers; the launcher starts the controller and the engines,
starts an engine again for a dead rank, says which rank an engine that answered is, watches
them while the cluster waits, and stops them. Two launchers exist:

* :class:`LocalLauncher` starts the controller and every engine here, as the kernel's child
  processes (``subprocess.Popen``, each with the environment :func:`plan.engine_env` builds);
* :class:`hora.engines.session_launcher.SessionLauncher` starts only the controller here and
  asks the hora service for the engines (a session).

Whatever a launcher starts is an :class:`EngineProcess` (a pid and ``poll()``): a ``Popen``,
a :class:`RemoteProcess` (an engine the service started, watched by its pid) or an
:class:`AskedEngine` (a new engine asked of the service, not registered yet).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, NamedTuple, Protocol

from hora.engines import plan, world
from hora.engines.bootstrap import InitAnswer
from hora.engines.errors import UNSEEN_EXIT, EngineError, EngineStartError, NotEnoughGpusError
from hora.engines.report import log_tail
from hora.env import new_rdzv_secret
from hora.kinds import HolderKind
from hora.leases import Lease, LeaseDir
from hora.net import PortHold, free_port, hold_ports
from hora.procs import signal_group

MAX_CPU_SLOTS = 4096  # CPU slot names a kernel looks through beyond the engines it wants


class EngineProcess(Protocol):
    """An engine's process as the kernel watches it: a ``Popen``, or one the service started."""

    @property
    def pid(self) -> int:
        """The process id."""

    def poll(self) -> int | None:
        """None while it runs, else its exit code."""


class Launched(NamedTuple):
    """What :meth:`EngineLauncher.launch` started: how many engines to wait for, and until when."""

    engines: int
    deadline: float


class EngineLauncher(Protocol):
    """Starts, replaces, watches and stops a cluster's controller and engines.

    Attributes:
        backend: the process group's backend ("nccl", "gloo"; "" before the first launch).
    """

    backend: str

    @property
    def workdir(self) -> Path | None:
        """The controller's profile directory (connection files, logs); None when stopped."""

    @property
    def pids(self) -> list[int]:
        """The pids of the processes started on this machine (controller, local engines)."""

    def prepare(self) -> None:
        """Check what can be checked before anything starts (enough free GPUs)."""

    def launch(self, deadline: float) -> Launched:
        """Start the controller and ask for the engines; return how many will register."""

    def spawn_engines(self, ranks: Sequence[int], port: int) -> list[EngineProcess]:
        """Start engines for ``ranks`` that meet at the store on ``port``; they are awaited now."""

    def placed(self, info: InitAnswer) -> tuple[int, EngineProcess]:
        """The rank and process of an engine that answered ``bootstrap.init_engine``."""

    def log_file(self, rank: int) -> Path:
        """The log of the engine of ``rank`` (its output outside cells)."""

    def check_alive(self, what: str) -> None:
        """Raise :class:`EngineStartError` if what is awaited can no longer come."""

    def started(self, devices: Sequence[str]) -> None:
        """The engines are ready, bound to ``devices`` (by rank)."""

    def ended(self, procs: Sequence[EngineProcess]) -> str | None:
        """Why the engines are gone for good (None while they can be used or replaced)."""

    def after_death(self, dead: Sequence[int], procs: Sequence[EngineProcess]) -> str | None:
        """Why the ``dead`` ranks cannot be replaced (None: the cluster replaces them)."""

    def withdrawn(self) -> EngineError | None:
        """The error a start interrupted by Ctrl-C raises (None: the interrupt itself)."""

    def cell(self) -> AbstractContextManager[None]:
        """Held while a cell runs (a session counts it as activity)."""

    def stop(self) -> None:
        """Stop everything started; wait until it is gone. Harmless when stopped."""


def world_file(workdir: Path) -> Path:
    """The file that tells the engines where a re-formed world meets (:mod:`engines.world`)."""
    return workdir / "world.json"


def visible_gpus(environ: dict[str, str] | None = None) -> list[plan.GpuInfo]:
    """List the GPUs the kernel may hand to engines (see :func:`hora.inventory.visible_gpus`).

    Args:
        environ: the kernel's environment (default ``os.environ``), for ``CUDA_VISIBLE_DEVICES``.

    Returns:
        The visible GPUs with the pids using them; empty on a machine without GPUs.
    """
    from hora.inventory import visible_gpus as found

    return found(environ)


class KernelProcesses:
    """What every launcher starts here: the controller, in a private directory with the logs.

    A subclass adds the engines; :meth:`stop` kills whatever :meth:`_spawn` started.

    Args:
        options: how the cluster starts (timeouts, threads, backend).
    """

    def __init__(self, options: plan.ClusterOptions) -> None:
        self.options = options
        self.backend = ""
        self._dir: Path | None = None
        self._controller: subprocess.Popen[bytes] | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._pending: list[tuple[int, EngineProcess]] = []
        self._holds: list[PortHold] = []

    @property
    def workdir(self) -> Path | None:
        """The controller's profile directory (connection files, logs); None when stopped."""
        return self._dir

    @property
    def pids(self) -> list[int]:
        """The pids of the processes started here (controller, local engines)."""
        return [p.pid for p in self._procs]

    def _hold(self, n: int, host: str = "127.0.0.1") -> list[int]:
        """``n`` ports for the controller, held (:class:`hora.net.PortHold`) until started."""
        hold = hold_ports(n, host)
        self._holds.append(hold)
        return hold.ports

    def _release_ports(self) -> None:
        for hold in self._holds:
            hold.release()
        self._holds = []

    def _open(self) -> Path:
        self._dir = Path(tempfile.mkdtemp(prefix="hora-engines-"))
        return self._dir

    def _spawn(
        self, argv: list[str], env: dict[str, str], name: str, fds: Sequence[int] = ()
    ) -> subprocess.Popen[bytes]:
        if self._dir is None:
            raise EngineStartError(f"cannot start the {name}: the cluster is stopped")
        out = open(self._dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(out)
        # own session: the notebook's interrupt (SIGINT to the kernel's process group) must not
        # reach the controller; hora forwards it to the engines itself
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=fds,
        )
        self._procs.append(proc)
        return proc

    def log_file(self, rank: int) -> Path:
        """The log of the engine of ``rank`` (its output outside cells)."""
        return Path(self._dir or ".") / f"engine{rank}.log"

    def check_alive(self, what: str) -> None:
        """Raise :class:`EngineStartError` if the controller or an awaited engine exited."""
        directory = Path(self._dir or ".")
        if self._controller is not None and self._controller.poll() is not None:
            raise EngineStartError(
                f"the controller exited ({self._controller.returncode}) while {what}:\n"
                + log_tail(directory / "controller.log")
            )
        for rank, proc in self._pending:
            if (code := proc.poll()) is not None:
                raise EngineStartError(
                    f"engine of rank {rank} exited ({code}) while {what}:\n"
                    + log_tail(self.log_file(rank))
                )

    def started(self, devices: Sequence[str]) -> None:
        """The controller has bound its ports: let the placeholders go."""
        self._release_ports()

    def ended(self, procs: Sequence[EngineProcess]) -> str | None:
        """None: engines started here can always be replaced."""
        return None

    def after_death(self, dead: Sequence[int], procs: Sequence[EngineProcess]) -> str | None:
        """None: the cluster starts new engines for the dead ranks."""
        return None

    def withdrawn(self) -> EngineError | None:
        """None: an interrupted start raises the interrupt."""
        return None

    def cell(self) -> AbstractContextManager[None]:
        """Nothing to hold while a cell runs."""
        return nullcontext()

    def stop(self) -> None:
        """Kill what was started here, close its logs, remove the directory."""
        # engines are killed outright: their state is discarded anyway, and SIGTERM makes a
        # torch engine spend a second in teardown (and sometimes abort) for nothing
        kill(self._procs)
        self._release_ports()
        for f in self._logs:
            f.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._logs, self._dir = [], [], None
        self._pending, self._controller = [], None


class LocalLauncher(KernelProcesses):
    """Starts the controller and N engines as this kernel's child processes.

    Args:
        options: how many engines, which GPUs, backend, timeouts.
        gpus: lists the GPUs the kernel may hand out (injectable for tests).
    """

    def __init__(
        self,
        options: plan.ClusterOptions,
        gpus: Callable[[], list[plan.GpuInfo]] = visible_gpus,
    ) -> None:
        super().__init__(options)
        self.gpus = gpus
        self._devices: list[str | None] = []
        self._leases: list[Lease] = []  # each rank's slot, held here and by its engine
        self._logs_of: dict[int, Path] = {}
        self._rounds = 0
        self._rdzv_secret = ""

    def prepare(self) -> None:
        """Choose each rank's GPU and lease its slot, before anything starts.

        A GPU whose machine-wide lease another holds (a hora service, another notebook's
        engines) is not free; CPU engines lease the lowest free CPU slots (:mod:`hora.leases`).

        Raises:
            NotEnoughGpusError: more GPUs asked for than visible and free.
            LeaseDirError: the lease directory cannot be used (naming the setting).
        """
        self._let_go()
        leases = LeaseDir.from_environ()
        leases.ready()
        visible = self.gpus()
        held = leases.held(g.lease for g in visible)
        visible = [
            dataclasses.replace(g, holder=held[g.lease].words()) if g.lease in held else g
            for g in visible
        ]
        self._devices = plan.plan_devices(self.options.n, self.options.gpus, visible)
        names = {g.id: g.lease for g in visible}
        try:
            if self._devices and self._devices[0] is not None:
                self._leases = [_take(leases, names[d], visible) for d in self._devices if d]
            else:
                self._leases = _take_cpus(leases, len(self._devices))
        except BaseException:
            self._let_go()
            raise

    def _let_go(self) -> None:
        for lease in self._leases:
            lease.close()
        self._leases = []

    def stop(self) -> None:
        """Kill what was started here, then let its slots' leases go."""
        super().stop()
        self._let_go()

    def launch(self, deadline: float) -> Launched:
        """Start the controller and one engine per planned device."""
        directory = self._open()
        devices = self._devices
        self.backend = self.options.backend or ("nccl" if devices[0] is not None else "gloo")
        self._logs_of, self._rounds = {}, 0
        self._rdzv_secret = new_rdzv_secret()  # a replacement engine gets the same one
        # CurveZMQ: the controller writes its public key only into its private connection files
        ports = self._hold(plan.CONNECTION_PORTS + plan.INTERNAL_PORTS)
        argv = plan.controller_argv(directory, ports=ports)
        self._controller = self._spawn(argv, plan.controller_env(dict(os.environ)), "controller")
        self.spawn_engines(range(len(devices)), free_port())
        return Launched(len(devices), deadline)

    def spawn_engines(self, ranks: Sequence[int], port: int) -> list[EngineProcess]:
        """Start the engines of ``ranks``; they meet the others at the store on ``port``."""
        self._rounds += 1
        procs: list[EngineProcess] = [self._spawn_engine(rank, port) for rank in ranks]
        self._pending = list(zip(ranks, procs, strict=True))
        return procs

    def _spawn_engine(self, rank: int, port: int) -> subprocess.Popen[bytes]:
        directory = Path(self._dir or ".")
        env = plan.engine_env(
            dict(os.environ),
            rank=rank,
            size=len(self._devices),
            device=self._devices[rank],
            master_port=port,
            backend=self.backend,
            timeout_s=self.options.timeout_s,
            threads=self.options.threads,
            gpus=[d for d in self._devices if d is not None],
            rdzv_secret=self._rdzv_secret,
        )
        env[world.VAR] = str(world_file(directory))  # where re-formed worlds meet
        stack = directory / f"stack{rank}.txt"
        stack.touch()
        # a replacement engine gets its own log: the dead one's explains the death
        name = f"engine{rank}" + (f"-{self._rounds - 1}" if rank in self._logs_of else "")
        self._logs_of[rank] = directory / f"{name}.log"
        fds = [self._leases[rank].fileno()] if rank < len(self._leases) else []
        return self._spawn(plan.engine_argv(directory, stack), env, name, fds)  # holds it too

    def placed(self, info: InitAnswer) -> tuple[int, EngineProcess]:
        """The rank and process of an engine that answered, found by its pid."""
        by_pid = {proc.pid: (rank, proc) for rank, proc in self._pending}
        return by_pid[info["pid"]]

    def log_file(self, rank: int) -> Path:
        """The log of the engine of ``rank``; a replacement's is its own."""
        return self._logs_of.get(rank) or super().log_file(rank)


def _claims() -> dict[str, object]:
    """What a kernel's lease says about it: a notebook kernel, and its notebook's name."""
    notebook = os.environ.get("JPY_SESSION_NAME", "")  # set by Jupyter for a notebook's kernel
    return {"kind": HolderKind.kernel.value, **({"what": Path(notebook).name} if notebook else {})}


def _take(leases: LeaseDir, name: str, visible: Sequence[plan.GpuInfo]) -> Lease:
    """The lease of one planned GPU (someone may have taken it since it was seen free)."""
    got = leases.take(name, _claims())
    if isinstance(got, Lease):
        return got
    ids = [g.id for g in visible]
    gpu = next((g.id for g in visible if g.lease == name), name)
    raise NotEnoughGpusError(len(ids), ids, [], f"GPU {gpu} held by {got.words()}")


def _take_cpus(leases: LeaseDir, n: int) -> list[Lease]:
    """Leases of the ``n`` lowest free CPU slots (``cpu<i>``): a CPU slot is a name, not a core."""
    taken: list[Lease] = []
    for i in range(n + MAX_CPU_SLOTS):
        if len(taken) == n:
            return taken
        got = leases.take(f"cpu{i}", _claims())
        if isinstance(got, Lease):
            taken.append(got)
    for lease in taken:
        lease.close()
    raise EngineStartError(f"no {n} free CPU slots among {n + MAX_CPU_SLOTS} in {leases.path}")


class RemoteProcess:
    """An engine process the service started, watched by its pid (the kernel is not its parent).

    Its exit code is the service's to know (the session's events, ``hora logs``); here a gone
    process reads as :data:`~hora.engines.errors.UNSEEN_EXIT`.
    An engine on another machine (a Slurm node) or in a container (a pid namespace of its own)
    cannot be watched by its pid: it reads as gone once the service ended the session (``ended``),
    which it does when any engine ends; it is never signalled (``signallable``).
    """

    def __init__(self, pid: int, ended: Callable[[], bool] | None = None) -> None:
        self._pid = pid
        self._ended = ended
        self.returncode: int | None = None
        # its pid is one of this machine's (not a Slurm node's nor a container's namespace's):
        # it may be signalled and its stack file read here
        self.signallable = ended is None

    @property
    def pid(self) -> int:
        """The engine's process id (on its own machine)."""
        return self._pid

    def poll(self) -> int | None:
        """None while the process lives (a zombie counts as gone), else 1."""
        if self.returncode is None:
            gone = self._ended() if self._ended is not None else not _alive(self._pid)
            if gone:
                self.returncode = UNSEEN_EXIT
        return self.returncode


class AskedEngine:
    """A new engine the service was asked for: known by its pid once it registers.

    Until then it counts as alive; a session that ends meanwhile is what says otherwise.
    """

    pid = -1
    returncode: int | None = None

    def poll(self) -> int | None:
        """None: whether it starts is the service's to say (the session's state)."""
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL processes with their process groups and reap them."""
    for p in procs:
        if p.poll() is None:
            # each process leads its own session, so its group holds anything user code forked
            signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=10)
