"""What a cluster does after a cell failed, so that the engines stay usable (data plane).

After a stall, an interrupt or a collective that failed on some ranks, the process group is
rebuilt in the same engine processes (their variables stay); after a death, only the dead ranks
get new engines; a rank that cannot be reached at all leaves a full restart as the way out. The
:class:`Recovery` methods are part of :class:`hora.engines.cluster.Cluster`, which provides the
engines, the client and the launch steps they use.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hora.engines import bootstrap
from hora.engines.errors import (
    RECOVER,
    ClusterBrokenError,
    RankDiedError,
    exit_status,
    rank_ranges,
)
from hora.engines.state import State
from hora.net import free_port

if TYPE_CHECKING:  # pragma: no cover
    from hora.engines.execute import Engine
    from hora.engines.plan import ClusterOptions
    from hora.engines.report import CellNumbers

log = logging.getLogger("hora.engines")


class Recovery:
    """Release, rebuild, replace, restart: the cluster's ways back to a usable state."""

    if TYPE_CHECKING:  # provided by Cluster
        options: ClusterOptions
        client: Any
        engines: list[Engine]
        state: State
        broken_reason: str
        rebuilds: int
        replaced: int
        numbers: CellNumbers
        _pending: list[tuple[int, subprocess.Popen[bytes]]]

        def restart(self) -> list[dict[str, Any]]:
            """Stop and start the engines again (see ``Cluster.restart``)."""
            ...

        def _view(self, ranks: Sequence[int] | None) -> Any: ...
        def _spawn_engine(self, rank: int, port: int) -> subprocess.Popen[bytes]: ...
        def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None: ...
        def _init_engines(self, ids: Sequence[int], deadline: float) -> list[Engine]: ...

    def _recover(self, stuck: Sequence[int], forced: bool) -> str:
        """Make the engines usable after a failed cell; say what was done ("" if nothing).

        Ranks that never ended the cell cannot be reached: the engines are restarted (their
        variables are lost). Otherwise the process group is rebuilt in the same engines when
        the cell broke it (a collective failed, ranks were released from one, or ranks left
        the cell at different collectives); the variables stay.
        """
        if stuck:
            return self._restart_after(f"{rank_ranges(stuck)} did not stop")
        if not forced:
            try:
                counts = self._collective_counts()
            except Exception as exc:  # an engine that cannot answer cannot be trusted
                return self._restart_after(f"the engines did not answer ({exc})")
            if len(set(counts.values())) <= 1:
                return ""
        try:
            self._rebuild()
        except Exception as exc:  # any failure here leaves a full restart as the way out
            return self._restart_after(f"rebuilding the process group failed ({exc})")
        return "process group rebuilt; engines usable, variables kept"

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
        dead: dict[int, int | None] = {
            e.rank: code for e in self.engines if (code := e.proc.poll()) is not None
        }
        if not dead or self.state is not State.READY:
            return ""
        pids = {e.rank: e.pid for e in self.engines}
        what = "; ".join(
            f"rank {r} (pid {pids[r]}) died ({exit_status(c)})" for r, c in sorted(dead.items())
        )
        log.warning("%s since the last cell; replacing", what)
        outcome = self._after_death(RankDiedError(dead))
        text = f"{what} since the last cell; {outcome}"
        if self.state is State.BROKEN:
            raise ClusterBrokenError(text)
        return text

    def _after_death(self, e: RankDiedError) -> str:
        """Replace the dead engines and rebuild the group; say which variables were lost."""
        reason = "; ".join(f"rank {r} died" for r in sorted(e.dead))
        if e.running:  # a survivor never ended the cell: only a restart reaches it
            self.state, self.broken_reason = State.BROKEN, reason
            return RECOVER
        try:
            return self._replace(sorted(e.dead))
        except Exception as exc:  # the death stays the error shown; the way out is a restart
            log.warning("replacing the engines of %s failed: %s", rank_ranges(list(e.dead)), exc)
            self.state, self.broken_reason = State.BROKEN, reason
            return f"replacing the dead engines failed ({exc}); {RECOVER}"

    def _replace(self, dead: Sequence[int]) -> str:
        """Start new engines for the ``dead`` ranks; the others keep theirs and their variables.

        The survivors rebuild the process group on a fresh store, and the new engines join it
        as they start (their rank environment names that store).
        """
        survivors = [e for e in self.engines if e.rank not in dead]
        view = self.client[[e.engine_id for e in survivors]]
        names = sorted(set().union(*view.apply_async(bootstrap.user_names).get(timeout=10)))
        deadline = time.perf_counter() + self.options.start_timeout_s
        port, before = free_port(), set(self.client.ids)
        self.replaced += 1
        self._pending = [(r, self._spawn_engine(r, port)) for r in dead]
        rebuilt = view.apply_async(bootstrap.rebuild_group, port, self.options.start_timeout_s)
        self._wait(
            f"waiting for {len(dead)} new engines to register",
            deadline,
            lambda: len(set(self.client.ids) - before) >= len(dead),
        )
        fresh = self._init_engines(sorted(set(self.client.ids) - before), deadline)
        rebuilt.get(timeout=max(1.0, deadline - time.perf_counter()))
        self.engines = sorted(survivors + fresh, key=lambda e: e.rank)
        self._pending = []
        for rank in dead:  # a new engine counts its cells from 1 again
            self.numbers.by_count.pop(rank, None)
        # what a fresh engine defines by itself (hvd, torch) was not lost
        own = set(self.client[fresh[0].engine_id].apply_sync(bootstrap.user_names))
        lost = ", ".join(n for n in names if n not in own) or "none"
        kept = rank_ranges([e.rank for e in survivors])
        return (
            f"engine replaced; variables lost on {rank_ranges(dead)}: {lost}; "
            f"{kept} kept theirs; process group rebuilt"
        )

    def _restart_after(self, reason: str) -> str:
        log.warning("%s; restarting the engines", reason)
        try:
            self.restart()
        except Exception as exc:  # the cell's own error stays the one raised
            self.state, self.broken_reason = State.BROKEN, f"{reason}; restart failed: {exc}"
            return f"{reason}; restarting the engines failed ({exc}): {RECOVER}"
        return f"{reason}; the engines were restarted (their variables are lost)"

    def _rebuild(self) -> None:
        """Abort the process group on every rank and make a new one on a fresh store."""
        t0 = time.perf_counter()
        port = free_port()
        self._view(None).apply_async(bootstrap.rebuild_group, port).get(
            timeout=self.options.start_timeout_s
        )
        self.rebuilds += 1
        log.info("process group rebuilt in %.2fs (store port %d)", time.perf_counter() - t0, port)

    def _collective_counts(self) -> dict[int, int]:
        view = self.client[[e.engine_id for e in self.engines]]
        counts = view.apply_async(bootstrap.collective_count).get(timeout=10)
        return {e.rank: c for e, c in zip(self.engines, counts, strict=True)}
