"""The engines' state, owned by one object: :class:`EngineGroup` (data plane).

A notebook :class:`~hora.engines.cluster.Cluster` owns one group: its options, its
:class:`~hora.engines.launchers.EngineLauncher`, the ipyparallel client, the engines by rank
(each an :class:`Engine`), the lifecycle state (:class:`~hora.engines.state.ClusterState`) and
why it broke, and the cells' numbers. The group also does what every part of the cluster needs
done to the engines: connect the client, initialise ``hora.torch`` in new engines, wait while
the launcher watches, name the re-formed world's file, give a view of some ranks, mark the
cluster broken. The cluster's parts (:class:`~hora.engines.recovery.Recovery`,
:func:`~hora.engines.health.engine_status`) are given the group, never the cluster.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.engines import _ipp, bootstrap, plan
from hora.engines.bootstrap import EngineInfo, InitAnswer
from hora.engines.errors import EngineStartError
from hora.engines.launchers import EngineLauncher, EngineProcess, world_file
from hora.engines.report import CellNumbers
from hora.engines.state import ClusterState
from hora.errors import SpecError

log = logging.getLogger("hora.engines")


@dataclass
class Engine:
    """One running engine, as the kernel knows it (the engine-id -> rank map lives here).

    Attributes:
        rank: its rank in the process group.
        engine_id: ipyparallel's engine id (assigned by the controller; not the rank).
        ident: ipyparallel's routing identity of the engine.
        proc: the engine process (started by hora, so its pid and exit status are known).
        host: host name.
        device: torch device of the engine ("cuda:0", "cpu").
        gpu: the GPU id bound through CUDA_VISIBLE_DEVICES ("" on CPU).
        stack_file: where the engine writes its stack on SIGUSR1.
        log_file: the engine's stdout/stderr outside cells (startup, crashes).
        main_thread: ident of the engine's main thread (to pick its stack from a dump).
        local: it runs on the kernel's machine, so its pid can be signalled and its stack
            file read from here (an engine on a Slurm node cannot be).
    """

    rank: int
    engine_id: int
    ident: bytes
    proc: EngineProcess
    host: str
    device: str
    gpu: str
    stack_file: Path
    log_file: Path
    main_thread: int = 0
    local: bool = True

    @property
    def pid(self) -> int:
        """Return the engine's process id."""
        return self.proc.pid


class EngineGroup:
    """The engines of a cluster and what is done to them (module docstring).

    Args:
        options: how to start (engines, GPUs, backend, timeouts).
        launcher: starts and stops the controller and the engines.

    Attributes:
        options: as given (a resume may ask for another size).
        launcher: as given.
        client: the connected ``ipyparallel.Client`` (None when stopped).
        engines: the running engines, by rank.
        state: the lifecycle state.
        broken_reason: why the cluster is BROKEN (shown until a restart).
        numbers: what the cells run so far were numbered, per engine.
        start_s: how long the last start took.
    """

    def __init__(self, options: plan.ClusterOptions, launcher: EngineLauncher) -> None:
        self.options = options
        self.launcher = launcher
        self.client: Any = None
        self.engines: list[Engine] = []
        self.state = ClusterState.STOPPED
        self.broken_reason = ""
        self.numbers = CellNumbers()
        self.start_s = 0.0

    @property
    def backend(self) -> str:
        """The process group's backend ("nccl", "gloo"; "" before the first start)."""
        return self.launcher.backend

    def world_file(self) -> Path | None:
        """The file that tells the engines where a re-formed world meets (engines.world)."""
        workdir = self.launcher.workdir
        return None if workdir is None else world_file(workdir)

    def set_broken(self, reason: str) -> None:
        """Mark the cluster BROKEN: ``reason`` is shown until a restart."""
        self.state, self.broken_reason = ClusterState.BROKEN, reason

    def forget_engines(self, state: ClusterState) -> None:
        """The engines are gone (stopped or parked): no engines, no reason, ``state``."""
        self.engines = []
        self.state, self.broken_reason = state, ""

    def wait_until(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``, while the launcher checks that what is awaited can come.

        Raises:
            EngineStartError: the controller or an awaited engine exited, or ``deadline`` passed.
        """
        while not ready():
            self.launcher.check_alive(what)
            if time.perf_counter() > deadline:
                raise EngineStartError(
                    f"timed out after {self.options.start_timeout_s:g}s {what}; "
                    "raise --start-timeout of %dist_start or check the engine logs"
                )
            time.sleep(0.02)

    def connect(self, deadline: float, n: int) -> None:
        """Connect the client to the controller and wait for ``n`` engines to register.

        Raises:
            EngineStartError: no controller, or ``deadline`` passed.
        """
        import ipyparallel as ipp

        workdir = self.launcher.workdir
        if workdir is None:
            raise EngineStartError("no controller to connect to")
        path = plan.client_file(workdir)
        info: dict[str, Any] = {}

        def have_file() -> bool:
            try:
                info.update(json.loads(path.read_text()))
            except (OSError, ValueError):
                return False
            return True

        self.wait_until("waiting for the controller", deadline, have_file)
        waits = [0.5]

        def answered() -> bool:
            # asked again, each time for twice as long, while the controller lives: one that
            # died after writing its file (its heart monitor failed) is reported at once
            waits.append(min(2 * waits[-1], max(0.1, deadline - time.perf_counter())))
            try:
                self.client = ipp.Client(info, timeout=waits[-1])
            except TimeoutError:
                return False
            return True

        self.wait_until("waiting for the controller to answer", deadline, answered)
        self.wait_until(
            f"waiting for {n} engines to register", deadline, lambda: len(self.client.ids) >= n
        )

    def disconnect(self) -> None:
        """Close the client (harmless when there is none)."""
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception as e:  # closing a client whose controller died can fail; go on
                log.debug("closing the client: %s", e)
            self.client = None

    def init_engines(self, ids: Sequence[int], deadline: float) -> list[Engine]:
        """Initialise hora.torch in the engines awaited (``ids``); return them by rank.

        Raises:
            EngineStartError: an engine failed to initialise, or ``deadline`` passed.
        """
        start_s = max(1.0, deadline - time.perf_counter())  # late engines: see init_engine
        args = (self.backend, self.options.timeout_s, self.options.threads, start_s)
        ars = {eid: self.client[eid].apply_async(bootstrap.init_engine, *args) for eid in ids}

        def failed(ar: Any) -> bool:
            return bool(ar.ready() and (not ar.successful() or "error" in ar.get(0)))

        self.wait_until(
            "initialising hora.torch in the engines",
            deadline,
            lambda: all(ar.ready() for ar in ars.values()) or any(map(failed, ars.values())),
        )
        infos: dict[int, InitAnswer] = {
            eid: ar.get(0) for eid, ar in ars.items() if ar.ready() and ar.successful()
        }
        placed = self.launcher.placed
        errors = {placed(i)[0]: i["error"] for i in infos.values() if "error" in i}
        ready = {eid: i for eid, i in infos.items() if "error" not in i}
        if errors or len(ready) < len(ars):
            raise _init_error(errors)
        engines = [self._engine(eid, info, placed(info)) for eid, info in ready.items()]
        return sorted(engines, key=lambda e: e.rank)

    def _engine(self, eid: int, info: EngineInfo, placed: tuple[int, EngineProcess]) -> Engine:
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
            stack_file=Path(
                info.get("stack_file") or Path(self.launcher.workdir or ".") / f"stack{rank}.txt"
            ),
            log_file=self.launcher.log_file(rank),
            main_thread=info["main_thread"],
            # a container's engine has the host's name but a pid of its own namespace
            local=info["host"] == socket.gethostname() and getattr(proc, "signallable", True),
        )

    def adopt(self, fresh: Sequence[Engine]) -> None:
        """Put new engines in their ranks' places (a new engine counts its cells from 1)."""
        ranks = {e.rank for e in fresh}
        kept = [e for e in self.engines if e.rank not in ranks]
        self.engines = sorted(kept + list(fresh), key=lambda e: e.rank)
        for rank in ranks:
            self.numbers.by_count.pop(rank, None)

    def ranks(self, ranks: Sequence[int] | None) -> list[int]:
        """The ranks asked for (all when None).

        Raises:
            SpecError: a rank is outside the cluster.
        """
        size = len(self.engines)
        chosen = list(range(size)) if ranks is None else list(ranks)
        bad = [r for r in chosen if not 0 <= r < size]
        if bad:
            raise SpecError("rank", f"rank {bad[0]} is outside 0..{size - 1}")
        return chosen

    def view(self, ranks: Sequence[int] | None) -> Any:
        """An ipyparallel view of the engines of ``ranks`` (all when None), in rank order."""
        return self.client[[self.engines[r].engine_id for r in self.ranks(ranks)]]


def _init_error(errors: dict[int, str]) -> EngineStartError:
    if not errors:
        return EngineStartError("an engine failed while initialising hora.torch")
    ranks = sorted(errors)
    first = errors[ranks[0]]
    others = ranks[1:]
    also = f"\n(also failed on ranks {', '.join(map(str, others))})" if others else ""
    last = first.splitlines()[-1] if first else ""
    return EngineStartError(f"hora.torch.init() failed on rank {ranks[0]}: {last}\n{first}{also}")
