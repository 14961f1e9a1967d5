"""During a cell, new engines for dead ranks join the survivors in ``hvd.elastic.run`` (data plane).

A cell that trains with ``hvd.elastic.run`` does not end when an engine dies: the survivors'
collective fails, they go back to the last commit and wait for a new world
(:mod:`hora.engines.world`). :class:`Rejoin` drives what the kernel does meanwhile, from the
cell's wait loop (it is given the cell as a :class:`RunningCell`): once every rank still in
the cell waits, the cluster's recovery (a :class:`Replacer`) publishes a new world and starts
new engines for the dead ranks; once the survivors have met them, each new engine is put in
its dead rank's place and runs the cell from its start (its ``hvd.elastic.run`` begins with
the sync that gives it rank 0's committed state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from hora.engines.errors import exit_status, rank_ranges
from hora.engines.group import Engine

log = logging.getLogger("hora.engines")


class Noted(Protocol):
    """A cell's result, as far as a rejoin writes to it."""

    notes: list[str]


class RunningCell(Protocol):
    """The cell a :class:`Rejoin` works on (an :class:`hora.engines.execute.CellRun`)."""

    engines: list[Engine]
    dead: dict[int, int | None]
    by_id: dict[int, int]

    @property
    def result(self) -> Noted:
        """What the cell produced so far (a note says which rank was replaced)."""

    def pending(self) -> list[int]:
        """Ranks that have not finished the cell (nor died)."""

    def forget(self, rank: int) -> None:
        """Forget what ``rank`` answered (a new engine runs the cell again in its place)."""

    def send_to(self, e: Engine) -> None:
        """Send the cell to one engine."""


class Replacer(Protocol):
    """Starts new engines for ranks that died during a cell (the cluster's ``Recovery``)."""

    @property
    def rejoin_s(self) -> float:
        """How long survivors may wait for the new engines."""

    def waiting(self) -> list[int]:
        """Ranks waiting in ``hvd.elastic.run`` for a new world."""

    def begin(self, dead: Sequence[int]) -> None:
        """Publish a new world and start new engines for ``dead``."""

    def joined(self) -> list[Engine]:
        """The new engines, once the survivors met them in the new world ([] until then)."""

    def reform(self) -> None:
        """Publish a new world for the same engines (a collective failed; nobody died)."""


class Rejoin:
    """The replacement of a cell's dead ranks while the survivors wait for them.

    Args:
        run: the cell (its engines, dead ranks and result are updated here).
        replacer: starts the new engines (the cluster's recovery).
        grace_s: how long survivors that began to re-form the world may take to get there.
    """

    def __init__(self, run: RunningCell, replacer: Replacer, grace_s: float) -> None:
        self.run, self.replacer, self.grace_s = run, replacer, grace_s
        self.begun = False

    def step(self, now: float, deadline: float) -> float | None:
        """Move the replacement on; return the new deadline for the dead ranks (None: done)."""
        run = self.run
        if not self.begun:
            waiting = set(self.replacer.waiting())
            if not waiting:
                return deadline
            deadline = max(deadline, now + self.grace_s)  # they are re-forming the world
            if not set(run.pending()) <= waiting:
                return deadline
            self.replacer.begin(sorted(run.dead))
            self.begun = True
            return now + self.replacer.rejoin_s
        for e in self.replacer.joined():
            self._swap(e)
        return deadline if run.dead else None

    def reform_if_waiting(self) -> None:
        """Every rank in the cell waits for a new world though none died: publish one.

        A collective that failed without a death (one rank raised ``HorovodInternalError``,
        a timeout) sends every rank back to its last commit; they meet again on a fresh port.
        """
        pending = set(self.run.pending())
        if pending and pending <= set(self.replacer.waiting()):
            log.warning("%s wait for a new world: re-forming it", rank_ranges(sorted(pending)))
            self.replacer.reform()

    def _swap(self, e: Engine) -> None:
        """Put a new engine in a dead rank's place and send it the cell."""
        run = self.run
        old = next(o for o in run.engines if o.rank == e.rank)
        code = run.dead.pop(e.rank)
        run.engines = [e if o is old else o for o in run.engines]
        del run.by_id[old.engine_id]
        run.by_id[e.engine_id] = e.rank
        run.forget(e.rank)
        kept = rank_ranges([o.rank for o in run.engines if o.rank != e.rank])
        run.result.notes.append(
            f"rank {e.rank} (pid {old.pid}) died during the cell ({exit_status(code)}); a new "
            f"engine (pid {e.pid}) took its place and ran the cell from its start, joining "
            f"hvd.elastic.run; {kept} kept their processes and variables"
        )
        log.warning("%s", run.result.notes[-1])
        run.send_to(e)
