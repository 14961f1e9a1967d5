"""A local ipyparallel cluster of GPU-bound engines with the process group initialised (data plane).

:class:`Cluster` is the Python API behind the magics: ``start`` launches a controller and N
engine processes at once (each engine with its own environment from :func:`plan.engine_env`,
started by hora so their pids and exit codes are known), connects a client, and runs
``hora.torch.init()`` in every engine; ``run`` executes a cell on every rank; ``push``/``pull``
move variables; ``status`` reports liveness and memory; ``stop`` leaves no process behind.

States form a small lifecycle: STOPPED -> STARTING -> READY, and READY -> BROKEN after a rank
died (``restart`` is the way out). A stall, an interrupt or a collective that failed on some
ranks does not break the cluster: the blocked ranks are released, the process group is rebuilt
in the same engine processes (a fresh store on a new port), and the variables stay.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from hora.engines import _ipp, bootstrap, plan, world
from hora.engines.errors import (
    CellFailedError,
    ClusterBrokenError,
    ClusterNotRunningError,
    EngineStartError,
    RankDiedError,
    StallError,
)
from hora.engines.execute import (
    CellResult,
    Engine,
    EngineProcess,
    EnginesInterrupted,
    OutputSink,
    run_cell,
)
from hora.engines.recovery import Recovery
from hora.engines.report import CellNumbers, log_tail
from hora.engines.state import ClusterState
from hora.env import new_rdzv_secret
from hora.net import free_port
from hora.procs import signal_group

log = logging.getLogger("hora.engines")

# started clusters, held strongly so that a dropped Cluster object is still stopped at exit
_LIVE: set[Cluster] = set()
_ATEXIT: list[bool] = []


def kernel_cuda_initialized() -> bool:
    """Return whether this notebook kernel holds a CUDA context (never imports torch)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def visible_gpus(environ: dict[str, str] | None = None) -> list[plan.GpuInfo]:
    """List the GPUs the kernel may hand to engines (see :func:`hora.inventory.visible_gpus`).

    Args:
        environ: the kernel's environment (default ``os.environ``), for ``CUDA_VISIBLE_DEVICES``.

    Returns:
        The visible GPUs with the pids using them; empty on a machine without GPUs.
    """
    from hora.inventory import visible_gpus as found

    return found(environ)


class Cluster(Recovery):
    """N persistent engines, one rank each, with ``hora.torch`` initialised.

    Args:
        options: how to start (engines, GPUs, backend, timeouts).
        cuda_check: returns whether the kernel already holds a CUDA context (injectable for
            tests: a CUDA context cannot be created on a CPU-only machine).

    Example (starts engines, so not run as a test):
        >>> c = Cluster(plan.ClusterOptions(n=2))
        >>> table = c.start()  # doctest: +SKIP
        >>> c.run("x = hvd.rank()").elapsed_s > 0  # doctest: +SKIP
        True
        >>> c.stop()  # doctest: +SKIP
    """

    def __init__(
        self,
        options: plan.ClusterOptions | None = None,
        cuda_check: Callable[[], bool] = kernel_cuda_initialized,
    ) -> None:
        self.options = options or plan.ClusterOptions()
        self.cuda_check = cuda_check
        self.state = ClusterState.STOPPED
        self.engines: list[Engine] = []
        self.client: Any = None
        self.broken_reason = ""
        self.start_s = 0.0
        self.backend = ""
        self.rebuilds = 0
        self.replaced = 0
        self.starts = 0
        self.numbers = CellNumbers()
        self._devices: list[str | None] = []
        self._logs_of: dict[int, Path] = {}
        self._rdzv_secret = ""
        self._pending: list[tuple[int, subprocess.Popen[bytes]]] = []
        self._controller: subprocess.Popen[bytes] | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._dir: Path | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Return the number of ranks."""
        return len(self.engines)

    @property
    def pids(self) -> list[int]:
        """Return the pids of every process this cluster started (controller and engines)."""
        return [p.pid for p in self._procs]

    def start(self) -> list[dict[str, Any]]:
        """Start the controller and engines and initialise the process group.

        Returns:
            One row per rank: rank, host, pid, device, engine id.

        Raises:
            CudaInitializedError: CUDA is already initialised in this kernel.
            NotEnoughGpusError: more GPUs asked for than visible and free.
            EngineStartError: an engine exited, did not register, or failed to initialise.
        """
        if self.state is not ClusterState.STOPPED:
            raise EngineStartError(f"the cluster is {self.state.value}; run %dist_stop first")
        plan.check_cuda_free(self.cuda_check)
        devices = plan.plan_devices(self.options.n, self.options.gpus, visible_gpus())
        t0 = time.perf_counter()
        self.state = ClusterState.STARTING
        _track(self)
        try:
            self._launch(devices)
            self._connect(t0 + self.options.start_timeout_s)
            self._init(t0 + self.options.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        self.state = ClusterState.READY
        self.starts += 1
        log.info("%d engines ready in %.2fs", self.size, self.start_s)
        return self.table()

    def _spawn(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        assert self._dir is not None
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
        )
        self._procs.append(proc)
        return proc

    def _launch(self, devices: list[str | None]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="hora-engines-"))
        self.backend = self.options.backend or ("nccl" if devices[0] is not None else "gloo")
        self._devices = list(devices)
        self._logs_of = {}
        self.generation, self.replacing = 0, None  # fresh engines: no world published yet
        self._rdzv_secret = new_rdzv_secret()  # a replacement engine gets the same one
        base = {k: v for k, v in os.environ.items()}
        # CurveZMQ: the controller writes its public key only into its private connection files
        argv = plan.controller_argv(self._dir)
        self._controller = self._spawn(argv, plan.controller_env(base), "controller")
        port = free_port()
        self._pending = [(rank, self._spawn_engine(rank, port)) for rank in range(len(devices))]

    def _spawn_engine(self, rank: int, port: int) -> subprocess.Popen[bytes]:
        """Start the engine of ``rank``; it meets the others at the store on ``port``."""
        assert self._dir is not None
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
        env[world.VAR] = str(self.world_file())  # where re-formed worlds meet
        stack = self._dir / f"stack{rank}.txt"
        stack.touch()
        # a replacement engine gets its own log: the dead one's explains the death
        name = f"engine{rank}" + (f"-{self.replaced}" if rank in self._logs_of else "")
        self._logs_of[rank] = self._dir / f"{name}.log"
        return self._spawn(plan.engine_argv(self._dir, stack), env, name)

    def _check_alive(self, what: str) -> None:
        assert self._dir is not None
        if self._controller is not None and self._controller.poll() is not None:
            raise EngineStartError(
                f"the controller exited ({self._controller.returncode}) while {what}:\n"
                + log_tail(self._dir / "controller.log")
            )
        for rank, proc in self._pending:
            if proc.poll() is not None:
                raise EngineStartError(
                    f"engine of rank {rank} exited ({proc.returncode}) while {what}:\n"
                    + log_tail(self._logs_of[rank])
                )

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        while not ready():
            self._check_alive(what)
            if time.perf_counter() > deadline:
                raise EngineStartError(
                    f"timed out after {self.options.start_timeout_s:g}s {what}; "
                    "raise --timeout of %dist_start or check the engine logs"
                )
            time.sleep(0.02)

    def _connect(self, deadline: float, n: int | None = None) -> None:
        import ipyparallel as ipp

        assert self._dir is not None
        path = plan.client_file(self._dir)
        info: dict[str, Any] = {}

        def have_file() -> bool:
            try:
                info.update(json.loads(path.read_text()))
            except (OSError, ValueError):
                return False
            return True

        self._wait("waiting for the controller", deadline, have_file)
        self.client = ipp.Client(info, timeout=max(1.0, deadline - time.perf_counter()))
        n = len(self._pending) if n is None else n
        self._wait(
            f"waiting for {n} engines to register", deadline, lambda: len(self.client.ids) >= n
        )

    def _init(self, deadline: float) -> None:
        self.engines = self._init_engines(list(self.client.ids), deadline)

    def _init_engines(self, ids: Sequence[int], deadline: float) -> list[Engine]:
        """Initialise hora.torch in the pending engines (``ids``); return them by rank."""
        start_s = max(1.0, deadline - time.perf_counter())  # late engines: see init_engine
        args = (self.backend, self.options.timeout_s, self.options.threads, start_s)
        ars = {eid: self.client[eid].apply_async(bootstrap.init_engine, *args) for eid in ids}

        def failed(ar: Any) -> bool:
            return bool(ar.ready() and (not ar.successful() or "error" in ar.get(0)))

        self._wait(
            "initialising hora.torch in the engines",
            deadline,
            lambda: all(ar.ready() for ar in ars.values()) or any(map(failed, ars.values())),
        )
        infos = {eid: ar.get(0) for eid, ar in ars.items() if ar.ready() and ar.successful()}
        errors = {self._placed(i)[0]: i["error"] for i in infos.values() if "error" in i}
        if errors or len(infos) < len(ars):
            raise _init_error(errors)
        engines = [self._engine(eid, info, self._placed(info)) for eid, info in infos.items()]
        return sorted(engines, key=lambda e: e.rank)

    def _placed(self, info: dict[str, Any]) -> tuple[int, EngineProcess]:
        """The rank and process of an engine that answered ``init_engine`` (by its pid)."""
        by_pid = {proc.pid: (rank, proc) for rank, proc in self._pending}
        return by_pid[info["pid"]]

    def _engine(self, eid: int, info: dict[str, Any], placed: tuple[int, Any]) -> Engine:
        assert self._dir is not None
        rank, proc = placed
        if rank != info["rank"]:
            raise EngineStartError(
                f"engine pid {info['pid']} was started as rank {rank} "
                f"but reports rank {info['rank']}"
            )
        return Engine(
            rank=rank,
            engine_id=eid,
            ident=_ipp.engine_ident(self.client, eid),
            proc=proc,
            host=info["host"],
            device=info["device"],
            gpu=info["gpu"],
            stack_file=Path(info.get("stack_file") or self._dir / f"stack{rank}.txt"),
            log_file=self._logs_of.get(rank, self._dir / f"engine{rank}.log"),
            main_thread=info["main_thread"],
            local=info["host"] == socket.gethostname(),
        )

    def stop(self) -> None:
        """Stop every engine and the controller; wait until they are gone. Harmless if stopped."""
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception as e:  # closing a client whose controller died can fail; go on
                log.debug("closing the client: %s", e)
            self.client = None
        # engines are killed outright: their state is discarded anyway, and SIGTERM makes a
        # torch engine spend a second in teardown (and sometimes abort) for nothing
        kill(self._procs)
        for f in self._logs:
            f.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._logs, self.engines, self._dir = [], [], [], None
        self._pending = []
        self._controller = None
        self.state, self.broken_reason = ClusterState.STOPPED, ""
        self.numbers = CellNumbers()
        _LIVE.discard(self)

    def restart(self) -> list[dict[str, Any]]:
        """Stop and start again with the same options.

        Returns:
            The new engine table (see :meth:`start`).
        """
        self.stop()
        return self.start()

    # --- work ---------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if self.state is ClusterState.BROKEN:
            raise ClusterBrokenError(
                f"{self.broken_reason}; run %dist_restart (engine variables are lost)"
            )
        if self.state is not ClusterState.READY:
            raise ClusterNotRunningError("no engines are running; run %dist_start first")

    def rank_of(self, engine_id: int) -> int:
        """Return the rank of an ipyparallel engine id (ids are assigned by the controller)."""
        for e in self.engines:
            if e.engine_id == engine_id:
                return e.rank
        raise KeyError(f"no engine with id {engine_id}")

    def run(
        self,
        code: str,
        *,
        sink: OutputSink | None = None,
        shown: Sequence[int] = (0,),
        timeout: float | None = None,
        cell_number: int | None = None,
    ) -> CellResult:
        """Run ``code`` on every rank; see :func:`hora.engines.execute.run_cell`.

        Args:
            code: cell source.
            sink: receives live output of ``shown`` ranks.
            shown: ranks whose output is shown.
            timeout: stall timeout (default: the cluster's ``timeout_s``).
            cell_number: the notebook's cell number, for the engines' tracebacks.

        Returns:
            Every rank's output.

        Raises:
            ClusterNotRunningError: no engines.
            ClusterBrokenError: an earlier death or stall broke the process group, or an
                engine that died since the last cell could not be replaced.
            CellFailedError: the cell raised.
            RankDiedError: an engine died (the cluster becomes BROKEN).
            StallError: ranks stalled; they were released and the process group rebuilt
                (``outcome`` says so; engines that did not stop are restarted).
            KeyboardInterrupt: interrupted; as for a stall, the group is rebuilt when needed.
        """
        self._require_ready()
        self.repair()  # engines that died since the last cell (the magic says so first)
        self.replacing = None
        stall = self.options.timeout_s if timeout is None else timeout
        try:
            return run_cell(
                self.client,
                self.engines,
                code,
                sink=sink,
                shown=shown,
                stall_timeout_s=stall,
                cell_number=cell_number,
                numbers=self.numbers,
                replacer=self,
            )
        except RankDiedError as e:
            e.outcome = self._after_death(e)
            raise
        except StallError as e:
            e.outcome = self._recover(e.still_running, forced=True)
            raise
        except CellFailedError as e:
            e.outcome = self._recover(e.still_running, forced=bool(e.released or e.in_collective))
            raise
        except EnginesInterrupted as e:
            e.outcome = self._recover(e.stuck, forced=bool(e.released)) or e.outcome
            raise

    def push(self, values: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
        """Copy variables into the engines' namespaces (tensors go to each engine's device).

        Args:
            values: name -> value.
            ranks: which ranks (default all).
        """
        self._require_ready()
        view = self._view(ranks)
        view.apply_async(bootstrap.push_values, values).get(timeout=self.options.timeout_s)

    def pull(self, name: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Fetch a variable from the engines (tensors come back on CPU), ordered by rank.

        Args:
            name: the variable's name in the engines.
            ranks: which ranks (default all).

        Returns:
            One value per rank.

        Raises:
            CellFailedError: the variable is missing on some rank.
        """
        from ipyparallel.error import CompositeError, RemoteError

        from hora.engines.errors import CellFailedError, RankError

        self._require_ready()
        chosen = self._ranks(ranks)
        ars = [
            self.client[self.engines[r].engine_id].apply_async(bootstrap.pull_value, name)
            for r in chosen
        ]
        out, errors = [], []
        for r, ar in zip(chosen, ars, strict=True):
            try:
                out.append(ar.get(timeout=self.options.timeout_s))
            except (RemoteError, CompositeError) as e:
                errors.append(
                    RankError(
                        r, getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e))
                    )
                )
        if errors:
            raise CellFailedError(errors)
        return out

    def _ranks(self, ranks: Sequence[int] | None) -> list[int]:
        chosen = list(range(self.size)) if ranks is None else list(ranks)
        bad = [r for r in chosen if not 0 <= r < self.size]
        if bad:
            from hora.errors import SpecError

            raise SpecError("rank", f"rank {bad[0]} is outside 0..{self.size - 1}")
        return chosen

    def _view(self, ranks: Sequence[int] | None) -> Any:
        return self.client[[self.engines[r].engine_id for r in self._ranks(ranks)]]

    def table(self) -> list[dict[str, Any]]:
        """Return one row per rank: rank, engine id, host, pid, device, GPU."""
        return [
            {
                "rank": e.rank,
                "engine_id": e.engine_id,
                "host": e.host,
                "pid": e.pid,
                "device": e.device,
                "gpu": e.gpu or "-",
            }
            for e in self.engines
        ]

    def status(self, timeout: float = 3.0) -> list[dict[str, Any]]:
        """Report each rank's liveness, pid, device and memory in use.

        Args:
            timeout: how long to wait for GPU memory numbers from busy engines.

        Returns:
            One row per rank: rank, pid, alive, exit, device, rss_mb, cuda_mb (GPU engines).
        """
        from hora.engines.health import engine_status

        return engine_status(self, timeout)


def _init_error(errors: dict[int, str]) -> EngineStartError:
    if not errors:
        return EngineStartError("an engine failed while initialising hora.torch")
    ranks = sorted(errors)
    first = errors[ranks[0]]
    others = ranks[1:]
    also = f"\n(also failed on ranks {', '.join(map(str, others))})" if others else ""
    last = first.splitlines()[-1] if first else ""
    return EngineStartError(f"hora.torch.init() failed on rank {ranks[0]}: {last}\n{first}{also}")


def kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL processes with their process groups and reap them."""
    for p in procs:
        if p.poll() is None:
            # each process leads its own session, so its group holds anything user code forked
            signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=10)


def _track(cluster: Cluster) -> None:
    if not _ATEXIT:
        atexit.register(_stop_all)
        _ATEXIT.append(True)
    _LIVE.add(cluster)


def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.stop()
