"""Errors of the notebook engines and how a failed cell is rendered (data plane).

A cell that fails on several ranks is shown as a user can act on it: the first failing rank's
traceback whole, then one line counting the others ("also failed on ranks 2, 3 (same error)").
Every exception here carries its data (ranks, exit codes, stacks) and renders itself through
IPython's ``_render_traceback_`` hook, so a failed ``%%distributed`` cell shows that short report
instead of a wall of N tracebacks, and still counts as an error for nbclient and ``run_cell``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hora.errors import CollectiveTimeout, HoraError, RankFailedError
from hora.procs import exit_words

RECOVER = "run %dist_restart to start fresh engines (their variables are lost)"


class EngineError(HoraError):
    """Base of the engine-cluster errors; renders as its message only (no kernel-side stack)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class EngineStartError(EngineError):
    """The cluster did not start: an engine exited, did not register, or init failed."""


class CudaInitializedError(EngineError):
    """CUDA is already initialised in the notebook kernel, so engines cannot own the GPUs."""


class NotEnoughGpusError(EngineError):
    """More GPUs were asked for than are visible and free."""

    def __init__(
        self, asked: int, visible: Sequence[str], free: Sequence[str], hint: str = ""
    ) -> None:
        vis = ", ".join(visible) or "none"
        fr = ", ".join(free) or "none"
        msg = f"asked for {asked} GPUs, {len(visible)} visible ({vis}), {len(free)} free ({fr})"
        super().__init__(msg + (f": {hint}" if hint else ""))
        self.asked = asked
        self.visible = list(visible)
        self.free = list(free)


class ClusterNotRunningError(EngineError):
    """An operation needs engines but none are running (or they were stopped)."""


class ClusterBrokenError(EngineError):
    """A previous failure (a dead or stuck rank) left the process group unusable."""


@dataclass(frozen=True)
class RankError:
    """One rank's Python exception, as the engine reported it.

    Attributes:
        rank: the rank that raised.
        ename: exception class name.
        evalue: exception message.
        traceback: the formatted traceback lines (may contain ANSI colours).
    """

    rank: int
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """Return ``"ename: evalue"`` on one line (long messages cut at 160 characters)."""
        first = self.evalue.splitlines()[0] if self.evalue else ""
        first = first if len(first) <= 160 else first[:157] + "..."
        return f"{self.ename}: {first}" if first else self.ename


def rank_ranges(ranks: Sequence[int]) -> str:
    """Name ranks compactly.

    Example:
        >>> rank_ranges([0, 1, 2, 5])
        'ranks 0-2, 5'
        >>> rank_ranges([3])
        'rank 3'
    """
    ordered = sorted(set(ranks))
    spans: list[list[int]] = []
    for r in ordered:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ordered) == 1 else "ranks ") + text


UNSEEN_EXIT = 1 << 16  # a process the service started (an engine) is gone; how is unknown here


def exit_status(code: int | None) -> str:
    """Describe a process exit code the way a user reads it.

    Args:
        code: ``Popen.returncode`` (negative: killed by that signal), or None if still running.

    Returns:
        e.g. ``"exit code 3"``, ``"killed by SIGKILL (out of memory?)"`` (the words of
        ``hora.procs.exit_words``), ``"still running"``.

    Example:
        >>> exit_status(-11)
        'killed by SIGSEGV (segmentation fault)'
    """
    if code is None:
        return "still running"
    if code == UNSEEN_EXIT:
        return "gone; its exit status is in the session's events"
    return exit_words(code)


def _others_line(first: RankError, others: Sequence[RankError]) -> str:
    if not others:
        return ""
    ranks = ", ".join(str(e.rank) for e in others)
    word = "rank" if len(others) == 1 else "ranks"
    if all(e.summary == first.summary for e in others):
        return f"also failed on {word} {ranks} (same error)"
    parts = ", ".join(f"{e.rank} ({e.summary})" for e in others)
    return f"also failed on {word} {ranks} (different errors: {parts})"


class CellFailedError(RankFailedError, EngineError):
    """The cell raised on one or more ranks; the first failure is shown whole, the rest counted."""

    def __init__(self, errors: Sequence[RankError], released: Sequence[int] = ()) -> None:
        # ranks released from a collective failed because of the others: they come last
        ordered = sorted(errors, key=lambda e: (e.rank in released, e.rank))
        first, rest = ordered[0], ordered[1:]
        super().__init__(first.rank, detail=first.summary, others=[e.rank for e in rest])
        self.errors = ordered
        self.others_line = _others_line(first, [e for e in rest if e.rank not in released])
        if released:
            what = f"{rank_ranges(released)} blocked in a collective: released"
            self.others_line = "\n".join(filter(None, [self.others_line, what]))
        self.released = list(released)
        self.still_running: list[int] = []
        # ranks whose error came out of a collective (set by the cell run)
        self.in_collective: list[int] = []
        self.outcome = ""

    def _render_traceback_(self) -> list[str]:
        first = self.errors[0]
        lines = [f"[rank {first.rank}] {first.summary}"]
        lines += list(first.traceback) or [first.summary]
        if self.others_line:
            lines.append(self.others_line)
        if self.outcome:
            lines.append(self.outcome)
        return lines


class RankDiedError(RankFailedError, EngineError):
    """One or more engine processes exited while a cell ran.

    Attributes:
        dead: exit code by dead rank (negative: killed by that signal).
        logs: what explains each death (a crash dump, else the end of the engine's log).
        errors: exceptions the surviving ranks raised afterwards (a lost peer, usually).
        running: ranks still inside the cell when hora stopped waiting for them.
    """

    def __init__(
        self,
        dead: dict[int, int | None],
        logs: dict[int, str] | None = None,
        errors: Sequence[RankError] = (),
        running: Sequence[int] = (),
    ) -> None:
        ranks = sorted(dead)
        first = ranks[0]
        super().__init__(
            first, exit_code=dead[first], detail=exit_status(dead[first]), others=ranks[1:]
        )
        self.dead = dict(dead)
        self.logs = dict(logs or {})
        self.errors = list(errors)
        self.running = sorted(running)
        self.outcome = RECOVER

    def __str__(self) -> str:
        parts = [f"rank {r} died ({exit_status(c)})" for r, c in sorted(self.dead.items())]
        return "; ".join(parts) + f"; {self.outcome}"

    def _render_traceback_(self) -> list[str]:
        lines = [f"RankDiedError: {self}"]
        for rank in sorted(self.logs):
            tail = self.logs[rank].strip()
            if tail:
                lines.append(f"--- last output of rank {rank} ---")
                lines.extend(tail.splitlines())
        if self.errors:
            ranks = ", ".join(str(e.rank) for e in self.errors)
            lines.append(f"other ranks then failed: {ranks} (first: {self.errors[0].summary})")
        if self.running:
            ranks = ", ".join(map(str, self.running))
            word = "rank" if len(self.running) == 1 else "ranks"
            lines.append(
                f"{word} {ranks} still running the cell (probably waiting for the dead rank in a "
                "collective); %dist_restart stops them"
            )
        return lines


class StallError(CollectiveTimeout, EngineError):
    """Some ranks finished the cell, others were still inside it after the timeout."""

    def __init__(
        self,
        missing: Sequence[int],
        finished: Sequence[int],
        timeout_s: float,
        stacks: dict[int, str],
    ) -> None:
        super().__init__("cell", missing, timeout_s)
        self.finished = list(finished)
        self.stacks = dict(stacks)
        self.still_running: list[int] = []
        self.outcome = RECOVER

    def __str__(self) -> str:
        missing = ", ".join(map(str, self.missing_ranks))
        done = ", ".join(map(str, self.finished)) or "none"
        return (
            f"stall: ranks {missing} still running {self.timeout_s:g}s after ranks {done} finished "
            f"the cell (a collective the others never entered?); {self.outcome}"
        )

    def _render_traceback_(self) -> list[str]:
        lines = [f"StallError: {self}"]
        for rank in self.missing_ranks:
            lines.append(f"--- rank {rank} is here (most recent call first) ---")
            lines.extend((self.stacks.get(rank) or "(no stack available)").rstrip().splitlines())
        return lines
