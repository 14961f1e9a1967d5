"""What a cluster does after a cell failed, so that the engines stay usable (data plane).

After a stall, an interrupt or a collective that failed on some ranks, the process group is
rebuilt in the same engine processes (their variables stay); after a death, only the dead ranks
get new engines; a rank that cannot be reached at all leaves a full restart as the way out.
:class:`Recovery` is a part of :class:`hora.engines.cluster.Cluster`: it is given the engines'
state (an :class:`~hora.engines.group.EngineGroup`, whose engines it replaces and whose
:class:`~hora.engines.launchers.EngineLauncher` starts new ones) and the cluster's restart as a
plain callable, never the cluster; it keeps its own data (the world generation, the
replacement under way, the counts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hora.engines import bootstrap, world
from hora.engines.errors import (
    RECOVER,
    ClusterBrokenError,
    EngineStartError,
    RankDiedError,
    exit_status,
    rank_ranges,
)
from hora.engines.group import Engine, EngineGroup
from hora.engines.state import ClusterState
from hora.net import free_port

log = logging.getLogger("hora.engines")


@dataclass
class Replacing:
    """New engines started for dead ranks, on their way into the process group.

    Attributes:
        dead: the ranks they replace.
        port: the store port of the world they join.
        before: the engine ids the controller knew before they started.
        probe: ``init_engine`` sent to them during a cell (it returns once the survivors met
            them: they re-form the world in ``hvd.elastic.run``).
    """

    dead: list[int]
    port: int
    before: set[int]
    probe: dict[int, Any] = field(default_factory=dict)


class Recovery:
    """Release, rebuild, replace, restart: the cluster's ways back to a usable state.

    It is also the cluster's :class:`hora.engines.rejoin.Replacer` during a cell.

    Args:
        group: the engines it recovers (their state, client and launcher).
        restart: stops and starts every engine again (the cluster's ``restart``).

    Attributes:
        generation: the last world published to the engines (:mod:`engines.world`).
        replacing: the new engines under way, if any.
        rebuilds: process groups rebuilt so far.
        replaced: rounds of engines started for dead ranks so far.
    """

    def __init__(self, group: EngineGroup, restart: Callable[[], object]) -> None:
        self.group = group
        self.restart = restart
        self.generation = 0
        self.replacing: Replacing | None = None
        self.rebuilds = 0
        self.replaced = 0

    def reset(self) -> None:
        """Fresh engines: no world published yet, no replacement under way."""
        self.generation, self.replacing = 0, None

    def recover(self, stuck: Sequence[int], forced: bool) -> str:
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
            e.rank: code for e in self.group.engines if (code := e.proc.poll()) is not None
        }
        if not dead or self.group.state is not ClusterState.READY:
            return ""
        pids = {e.rank: e.pid for e in self.group.engines}
        what = "; ".join(
            f"rank {r} (pid {pids[r]}) died ({exit_status(c)})" for r, c in sorted(dead.items())
        )
        log.warning("%s since the last cell; replacing", what)
        outcome = self.after_death(RankDiedError(dead))
        text = f"{what} since the last cell; {outcome}"
        if self.group.state is ClusterState.BROKEN:
            raise ClusterBrokenError(text)
        return text

    def after_death(self, e: RankDiedError) -> str:
        """Replace the dead engines and rebuild the group; say which variables were lost."""
        procs = [engine.proc for engine in self.group.engines]
        cannot = self.group.launcher.after_death(sorted(e.dead), procs)
        if cannot is not None:  # a session's service ends it instead of replacing the engine
            self.group.set_broken(cannot)
            return f"{cannot}; {RECOVER}"
        reason = "; ".join(f"rank {r} died" for r in sorted(e.dead))
        if e.running:  # a survivor never ended the cell: only a restart reaches it
            self.group.set_broken(reason)
            return RECOVER
        try:
            return self._replace(sorted(e.dead))
        except Exception as exc:  # the death stays the error shown; the way out is a restart
            log.warning("replacing the engines of %s failed: %s", rank_ranges(list(e.dead)), exc)
            self.group.set_broken(reason)
            return f"replacing the dead engines failed ({exc}); {RECOVER}"

    def begin_replace(self, dead: Sequence[int]) -> Replacing:
        """Publish a new world on a fresh port and start new engines for the ``dead`` ranks.

        Survivors inside ``hvd.elastic.run`` join that world at once; others are moved to it
        by :meth:`_replace` after the cell.
        """
        path = self.group.world_file()
        port, before = free_port(), set(self.group.client.ids)
        self.generation += 1
        if path is not None:
            gen = world.Generation(self.generation, port, root_lost=0 in dead)
            world.write_generation(path, gen)
        self.replaced += 1
        self.group.launcher.spawn_engines(dead, port)
        self.replacing = Replacing(list(dead), port, before)
        return self.replacing

    def _replace(self, dead: Sequence[int]) -> str:
        """Start new engines for the ``dead`` ranks; the others keep theirs and their variables.

        The survivors rebuild the process group on a fresh store, and the new engines join it
        as they start (their rank environment names that store). New engines started during
        the cell (:meth:`begin_replace`) are the ones used.
        """
        survivors = [e for e in self.group.engines if e.rank not in dead]
        view = self.group.client[[e.engine_id for e in survivors]]
        names = sorted(set().union(*view.apply_async(bootstrap.user_names).get(timeout=10)))
        deadline = time.perf_counter() + self.group.options.start_timeout_s
        begun = self.replacing
        if begun is None or begun.dead != list(dead):
            begun = self.begin_replace(dead)
        before = begun.before
        start_s = self.group.options.start_timeout_s
        rebuilt = view.apply_async(bootstrap.rebuild_group, begun.port, start_s)
        self.group.wait_until(
            f"waiting for {len(dead)} new engines to register",
            deadline,
            lambda: len(set(self.group.client.ids) - before) >= len(dead),
        )
        fresh = self.group.init_engines(sorted(set(self.group.client.ids) - before), deadline)
        rebuilt.get(timeout=max(1.0, deadline - time.perf_counter()))
        self._adopt(fresh)
        # what a fresh engine defines by itself (hvd, torch) was not lost
        own = set(self.group.client[fresh[0].engine_id].apply_sync(bootstrap.user_names))
        lost = ", ".join(n for n in names if n not in own) or "none"
        kept = rank_ranges([e.rank for e in survivors])
        return (
            f"engine replaced; variables lost on {rank_ranges(dead)}: {lost}; "
            f"{kept} kept theirs; process group rebuilt"
        )

    def _adopt(self, fresh: Sequence[Engine]) -> None:
        """Put the new engines in the dead ones' places."""
        self.group.adopt(fresh)
        self.replacing = None

    # --- during a cell (execute.Replacer) ---------------------------------------------------
    def begin(self, dead: Sequence[int]) -> None:
        """Engines died during a cell: start their replacements now (see begin_replace)."""
        try:
            self.begin_replace(sorted(dead))
        except Exception as exc:  # the death is reported as usual; the way out follows
            log.warning("starting engines for %s failed: %s", rank_ranges(list(dead)), exc)
            self.replacing = None

    def waiting(self) -> list[int]:
        """The ranks waiting in ``hvd.elastic.run`` for a world after the current one."""
        path = self.group.world_file()
        return [] if path is None else world.waiting_ranks(path, self.generation)

    def reform(self) -> None:
        """Publish a new world on a fresh port for the same engines (nobody died)."""
        path = self.group.world_file()
        if path is not None:
            self.generation += 1
            world.write_generation(path, world.Generation(self.generation, free_port()))

    @property
    def rejoin_s(self) -> float:
        """How long survivors may wait for new engines during a cell (the start timeout)."""
        return self.group.options.start_timeout_s

    def joined(self) -> list[Engine]:
        """The new engines, once the survivors met them in the new world ([] until then)."""
        r, g, opts = self.replacing, self.group, self.group.options
        if r is None:
            return []
        ids = sorted(set(g.client.ids) - r.before)
        if len(ids) < len(r.dead):
            return []
        if not r.probe:
            args = (g.backend, opts.timeout_s, opts.threads, opts.start_timeout_s)
            r.probe = {i: g.client[i].apply_async(bootstrap.init_engine, *args) for i in ids}
        if not all(ar.ready() for ar in r.probe.values()):
            return []
        deadline = time.perf_counter() + opts.start_timeout_s
        try:
            fresh = g.init_engines(ids, deadline)  # each answers at once now
        except EngineStartError as exc:  # the cell reports the death; a restart is the way out
            log.warning("new engines for %s failed: %s", rank_ranges(r.dead), exc)
            self.replacing = None
            return []
        self._adopt(fresh)
        return fresh

    def _restart_after(self, reason: str) -> str:
        log.warning("%s; restarting the engines", reason)
        try:
            self.restart()
        except Exception as exc:  # the cell's own error stays the one raised
            self.group.set_broken(f"{reason}; restart failed: {exc}")
            return f"{reason}; restarting the engines failed ({exc}): {RECOVER}"
        return f"{reason}; the engines were restarted (their variables are lost)"

    def _rebuild(self) -> None:
        """Abort the process group on every rank and make a new one on a fresh store."""
        t0 = time.perf_counter()
        port = free_port()
        self.group.view(None).apply_async(bootstrap.rebuild_group, port).get(
            timeout=self.group.options.start_timeout_s
        )
        self.rebuilds += 1
        log.info("process group rebuilt in %.2fs (store port %d)", time.perf_counter() - t0, port)

    def _collective_counts(self) -> dict[int, int]:
        view = self.group.client[[e.engine_id for e in self.group.engines]]
        counts = view.apply_async(bootstrap.collective_count).get(timeout=10)
        return {e.rank: c for e, c in zip(self.group.engines, counts, strict=True)}
