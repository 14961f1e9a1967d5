"""A local ipyparallel cluster of GPU-bound engines with the process group initialised (data plane).

:class:`Cluster` is the Python API behind the magics: ``start`` has its
:class:`~hora.engines.launchers.EngineLauncher` start a controller and N engines (by default
the kernel's own child processes, each with its own environment from :func:`plan.engine_env`,
so their pids and exit codes are known; a session's launcher asks the hora service), connects
a client, and runs ``hora.torch.init()`` in every engine; ``run`` executes a cell on every
rank; ``push``/``pull`` move variables; ``status`` reports liveness and memory; ``stop`` leaves
no process behind. The engines' state (options, launcher, client, engines, lifecycle state,
cell numbers) is one object the cluster owns, an :class:`~hora.engines.group.EngineGroup`; its
parts are given that group and plain callables, never the cluster: what happens after a failed
cell is its :class:`~hora.engines.recovery.Recovery`'s, ``status`` is
:func:`~hora.engines.health.engine_status`.

States form a small lifecycle: STOPPED -> STARTING -> READY, and READY -> BROKEN after a rank
died (``restart`` is the way out). A stall, an interrupt or a collective that failed on some
ranks does not break the cluster: the blocked ranks are released, the process group is rebuilt
in the same engine processes (a fresh store on a new port), and the variables stay.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict

from hora.engines import bootstrap, plan
from hora.engines.errors import (
    CellFailedError,
    ClusterBrokenError,
    ClusterNotRunningError,
    EngineStartError,
    RankDiedError,
    StallError,
)
from hora.engines.execute import CellResult, EnginesInterrupted, OutputSink, run_cell
from hora.engines.group import Engine, EngineGroup
from hora.engines.health import engine_status
from hora.engines.launchers import EngineLauncher, LocalLauncher
from hora.engines.recovery import Recovery
from hora.engines.report import CellNumbers
from hora.engines.state import ClusterState

log = logging.getLogger("hora.engines")

# started clusters, held strongly so that a dropped Cluster object is still stopped at exit
_LIVE: set[Cluster] = set()
_ATEXIT: list[bool] = []


class EngineRow(TypedDict):
    """One rank of :meth:`Cluster.table` (what ``%dist_start`` shows)."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    gpu: str  # "-" on CPU


def kernel_cuda_initialized() -> bool:
    """Return whether this notebook kernel holds a CUDA context (never imports torch)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


class Cluster:
    """N persistent engines, one rank each, with ``hora.torch`` initialised.

    Args:
        options: how to start (engines, GPUs, backend, timeouts).
        cuda_check: returns whether the kernel already holds a CUDA context (injectable for
            tests: a CUDA context cannot be created on a CPU-only machine).
        launcher: starts and stops the controller and the engines (default: a
            :class:`~hora.engines.launchers.LocalLauncher`, engines as this kernel's children).

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
        launcher: EngineLauncher | None = None,
    ) -> None:
        options = options or plan.ClusterOptions()
        self.cuda_check = cuda_check
        self.launcher: EngineLauncher = launcher or LocalLauncher(options)
        self.group = EngineGroup(options, self.launcher)
        self.recovery = Recovery(self.group, self.restart)
        self.starts = 0
        # held by whatever uses the engines (a cell, a push, a park): a park the service
        # asks for in the background never interrupts one
        self.lock = threading.RLock()

    # --- the engines' state (the group's) ----------------------------------------------------
    @property
    def options(self) -> plan.ClusterOptions:
        """How to start (a resume may ask for another size)."""
        return self.group.options

    @options.setter
    def options(self, options: plan.ClusterOptions) -> None:
        self.group.options = options

    @property
    def state(self) -> ClusterState:
        """The lifecycle state."""
        return self.group.state

    @state.setter
    def state(self, state: ClusterState) -> None:
        self.group.state = state

    @property
    def engines(self) -> list[Engine]:
        """The running engines, by rank."""
        return self.group.engines

    @property
    def client(self) -> Any:
        """The connected ``ipyparallel.Client`` (None when stopped)."""
        return self.group.client

    @property
    def broken_reason(self) -> str:
        """Why the cluster is BROKEN ("" otherwise)."""
        return self.group.broken_reason

    @property
    def numbers(self) -> CellNumbers:
        """What the cells run so far were numbered, per engine."""
        return self.group.numbers

    @property
    def start_s(self) -> float:
        """How long the last start took."""
        return self.group.start_s

    # --- lifecycle ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Return the number of ranks."""
        return len(self.engines)

    @property
    def pids(self) -> list[int]:
        """Return the pids of every process this cluster started (controller and engines)."""
        return self.launcher.pids

    @property
    def backend(self) -> str:
        """The process group's backend ("nccl", "gloo"; "" before the first start)."""
        return self.launcher.backend

    @property
    def workdir(self) -> Path | None:
        """The controller's profile directory (connection files, logs); None when stopped."""
        return self.launcher.workdir

    def world_file(self) -> Path | None:
        """The file that tells the engines where a re-formed world meets (engines.world)."""
        return self.group.world_file()

    def set_broken(self, reason: str) -> None:
        """Mark the cluster BROKEN: ``reason`` is shown until a restart."""
        self.group.set_broken(reason)

    def start(self) -> list[EngineRow]:
        """Start the controller and engines and initialise the process group.

        Returns:
            One row per rank: rank, host, pid, device, engine id.

        Raises:
            CudaInitializedError: CUDA is already initialised in this kernel.
            NotEnoughGpusError: more GPUs asked for than visible and free.
            EngineStartError: an engine exited, did not register, or failed to initialise.
            SessionWithdrawn: a session's start interrupted while queued (the launcher's).
        """
        if self.state is not ClusterState.STOPPED:
            raise EngineStartError(f"the cluster is {self.state.value}; run %dist_stop first")
        plan.check_cuda_free(self.cuda_check)
        self.launcher.prepare()
        t0 = time.perf_counter()
        self.state = ClusterState.STARTING
        _track(self)
        self.recovery.reset()
        try:
            launched = self.launcher.launch(t0 + self.options.start_timeout_s)
            group = self.group
            group.connect(launched.deadline, launched.engines)
            group.engines = group.init_engines(list(group.client.ids), launched.deadline)
            self.launcher.started([e.device for e in group.engines])
        except KeyboardInterrupt:
            withdrawn = self.launcher.withdrawn()
            self.stop()
            if withdrawn is None:
                raise
            raise withdrawn from None
        except BaseException:
            self.stop()
            raise
        self.group.start_s = time.perf_counter() - t0
        self.state = ClusterState.READY
        self.starts += 1
        log.info("%d engines ready in %.2fs", self.size, self.start_s)
        return self.table()

    def wait_until(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()`` while the launcher watches (:meth:`EngineGroup.wait_until`)."""
        self.group.wait_until(what, deadline, ready)

    def init_engines(self, ids: Sequence[int], deadline: float) -> list[Engine]:
        """Initialise hora.torch in new engines (:meth:`EngineGroup.init_engines`)."""
        return self.group.init_engines(ids, deadline)

    def stop(self) -> None:
        """Stop every engine and the controller; wait until they are gone. Harmless if stopped."""
        self.group.disconnect()
        self.launcher.stop()
        self.group.forget_engines(ClusterState.STOPPED)
        self.group.numbers = CellNumbers()
        _LIVE.discard(self)

    def close(self) -> None:
        """What the kernel's exit does: :meth:`stop` (a session cluster may park instead)."""
        self.stop()

    def restart(self) -> list[EngineRow]:
        """Stop and start again with the same options.

        Returns:
            The new engine table (see :meth:`start`).
        """
        self.stop()
        return self.start()

    # --- work ---------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        ended = self.launcher.ended([e.proc for e in self.engines])
        if ended is not None and self.state is not ClusterState.BROKEN:
            self.set_broken(ended)
        if self.state is ClusterState.BROKEN:
            raise ClusterBrokenError(
                f"{self.broken_reason}; run %dist_restart (engine variables are lost)"
            )
        if self.state is ClusterState.PARKED:
            raise ClusterNotRunningError(
                "the session is parked: resume() it (the next %%distributed cell does)"
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
            timeout: stall timeout (default: half the collective timeout,
                ``options.stall_timeout_s``).
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
        with self.lock, self.launcher.cell():
            self._require_ready()
            self.repair()  # engines that died since the last cell (the magic says so first)
            self.recovery.replacing = None
            stall = self.options.stall_timeout_s if timeout is None else timeout
            return self._run(code, sink, shown, stall, cell_number)

    def _run(
        self,
        code: str,
        sink: OutputSink | None,
        shown: Sequence[int],
        stall: float,
        cell_number: int | None,
    ) -> CellResult:
        recovery = self.recovery
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
                replacer=recovery,
            )
        except RankDiedError as e:
            e.outcome = recovery.after_death(e)
            raise
        except StallError as e:
            e.outcome = recovery.recover(e.still_running, forced=True)
            raise
        except CellFailedError as e:
            forced = bool(e.released or e.in_collective)
            e.outcome = recovery.recover(e.still_running, forced=forced)
            raise
        except EnginesInterrupted as e:
            e.outcome = recovery.recover(e.stuck, forced=bool(e.released)) or e.outcome
            raise

    def repair(self) -> str:
        """Replace the engines that died since the last cell, before the next one runs.

        The survivors keep their processes and variables; the process group is rebuilt with
        the new engines, so the next cell runs on every rank.

        Returns:
            What happened, for the notebook ("" when every engine is alive).

        Raises:
            ClusterBrokenError: the dead engines could not be replaced (a session's engines
                are the service's to replace; it ends the session instead).
        """
        return self.recovery.repair()

    def push(self, values: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
        """Copy variables into the engines' namespaces (tensors go to each engine's device).

        Args:
            values: name -> value.
            ranks: which ranks (default all).
        """
        with self.lock:
            self._require_ready()
            view = self.view(ranks)
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

        from hora.engines.errors import RankError

        with self.lock:
            self._require_ready()
            chosen = self.group.ranks(ranks)
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

    def view(self, ranks: Sequence[int] | None) -> Any:
        """An ipyparallel view of the engines of ``ranks`` (all when None), in rank order."""
        return self.group.view(ranks)

    def table(self) -> list[EngineRow]:
        """Return one row per rank: rank, engine id, host, pid, device, GPU."""
        return [
            EngineRow(
                rank=e.rank, engine_id=e.engine_id, host=e.host, pid=e.pid, device=e.device,
                gpu=e.gpu or "-",
            )
            for e in self.engines
        ]  # fmt: skip

    def status(self, timeout: float = 3.0) -> list[dict[str, Any]]:
        """Report each rank's liveness, pid, device and memory in use.

        Args:
            timeout: how long to wait for GPU memory numbers from busy engines.

        Returns:
            One row per rank: rank, pid, alive, exit, device, rss_mb, cuda_mb (GPU engines).
        """
        return engine_status(self.engines, self.client, timeout)


def _track(cluster: Cluster) -> None:
    if not _ATEXIT:
        atexit.register(_stop_all)
        _ATEXIT.append(True)
    _LIVE.add(cluster)


def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()
