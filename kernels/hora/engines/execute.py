"""Run one cell on every rank: live output, errors, deaths, stalls, interrupts (data plane).

One execute request per engine, sent with ipyparallel's ``message_future_hook`` so that the
output callbacks are attached *before* the request leaves (no lost or duplicated output). The
callbacks run on ipyparallel's IO thread and only enqueue; the kernel's main thread drains the
queue and hands the output to a :class:`OutputSink` as it arrives, so prints, plots and tables
appear in the notebook while the cell runs, in order, under the cell that produced them.

While waiting, the main thread also watches the engine processes it started (a rank that exits
is reported by rank and exit status at once, not after ipyparallel's heartbeat gives up),
applies the stall timeout (counted from the moment the first rank finished; a rank that is
then found waiting inside a collective is reported with its stack) and turns the
notebook's interrupt into SIGINT for every engine still running the cell.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from hora.engines import _ipp, outputs
from hora.engines.bootstrap import abort_group
from hora.engines.errors import (
    CellFailedError,
    RankDiedError,
    RankError,
    StallError,
    rank_ranges,
)
from hora.engines.group import Engine
from hora.engines.rejoin import Rejoin, Replacer
from hora.engines.report import CellNumbers, hide_hora_frames, in_collective, log_tail, pick_thread

log = logging.getLogger("hora.engines")

POLL_S = 0.2
DEATH_GRACE_S = 5.0
INTERRUPT_GRACE_S = 5.0  # a loaded 2-core machine took over 3 s to answer a KeyboardInterrupt
# how soon ranks still running are checked for a collective once another rank failed
ERROR_STALL_S = 2.0
# how long ranks released from a collective may take to end their cell
RELEASE_GRACE_S = 10.0


class OutputSink(Protocol):
    """Where a cell's output goes as it arrives (the magics display it; the API may collect it)."""

    def stream(self, rank: int, name: str, text: str) -> None:
        """Show text the rank wrote to ``name`` ("stdout" or "stderr")."""

    def display(self, rank: int, content: dict[str, Any]) -> None:
        """Show a rich output.

        ``content`` is a display_data / execute_result content (``data``, ``metadata``,
        ``transient``), with ``update=True`` for an update of an earlier display id, or
        ``{"clear": True, "wait": bool}`` for ``clear_output``.
        """


class NullSink:
    """An :class:`OutputSink` that shows nothing (the result still holds every output)."""

    def stream(self, rank: int, name: str, text: str) -> None:
        """Discard streamed text."""

    def display(self, rank: int, content: dict[str, Any]) -> None:
        """Discard rich output."""


@dataclass
class CellResult:
    """What a cell produced on every rank.

    Attributes:
        stdout: text printed, by rank.
        stderr: text written to stderr, by rank.
        outputs: rich outputs (display_data and execute_result contents), by rank.
        elapsed_s: wall time from send to the last rank's end.
        notes: what happened to the engines during the cell (a rank died and was replaced).
    """

    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    outputs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class EnginesInterrupted(KeyboardInterrupt):
    """The cell was interrupted.

    Attributes:
        interrupted: ranks that were running the cell when the interrupt came.
        stuck: ranks that did not stop within the grace period.
        released: ranks that were blocked in a collective and were freed by aborting the
            process group (it is rebuilt before the next cell).
        outcome: what became of the engines, set by the cluster ("engines usable, variables
            kept", or why they were restarted).
    """

    def __init__(
        self, interrupted: Sequence[int], stuck: Sequence[int], released: Sequence[int] = ()
    ) -> None:
        super().__init__(f"interrupted ranks {list(interrupted)}; still running: {list(stuck)}")
        self.interrupted = list(interrupted)
        self.stuck = list(stuck)
        self.released = list(released)
        self.outcome = "engines usable, variables kept"

    def __str__(self) -> str:
        return "; ".join(self.lines())

    def lines(self) -> list[str]:
        """Return one line per state the ranks ended in, then what became of the engines."""
        out = []
        stopped = [r for r in self.interrupted if r not in self.stuck]
        if stopped:
            out.append(f"interrupted on {rank_ranges(stopped)}")
        if self.released:
            out.append(f"{rank_ranges(self.released)} blocked in a collective: released")
        if self.stuck:
            out.append(f"{rank_ranges(self.stuck)} did not stop")
        if not self.interrupted:
            out.append("interrupted (no rank was running)")
        return out + [self.outcome]

    def _render_traceback_(self) -> list[str]:
        lines = self.lines()
        if len(lines) == 2:
            return [f"{lines[0]}; {lines[1]}"]
        return lines


def _to_rank_error(rank: int, reply: Any) -> RankError | None:
    """Turn an engine's reply into a RankError, or None when the cell succeeded there."""
    ename = getattr(reply, "ename", None)
    if ename is None:
        if not isinstance(reply, BaseException):
            return None
        # ipyparallel's own failures (engine unregistered, task aborted) carry no remote traceback
        return RankError(rank, type(reply).__name__, str(reply))
    tb = getattr(reply, "traceback", "") or ""
    lines = tb.splitlines() if isinstance(tb, str) else list(tb)
    return RankError(rank, str(ename), str(getattr(reply, "evalue", "")), lines)


def read_stack(engine: Engine, wait_s: float = 1.0, client: Any = None) -> str:
    """Ask an engine for its main thread's current Python stack (SIGUSR1 -> faulthandler).

    Args:
        engine: the engine to ask.
        wait_s: how long to wait for the dump.
        client: the ipyparallel client, to ask an engine on another machine through its
            control channel (see :func:`hora.engines.bootstrap.serve_stacks`).

    Returns:
        The stack, most recent call first, or a note saying why there is none.
    """
    if not engine.local:
        return _remote_stack(client, engine, wait_s)
    try:
        start = engine.stack_file.stat().st_size
        os.kill(engine.pid, signal.SIGUSR1)
    except OSError as e:
        return f"(no stack: {e})"
    deadline, last = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        size = engine.stack_file.stat().st_size
        if size > start and size == last:
            break
        last = size
    with open(engine.stack_file, errors="replace") as f:
        f.seek(start)
        return pick_thread(f.read(), engine.main_thread)


def _remote_stack(client: Any, engine: Engine, wait_s: float) -> str:
    """The stack of an engine on another machine, asked on its control channel."""
    from hora.engines.bootstrap import STACK_REQUEST

    try:
        ask = _ipp.control_request(client, engine.engine_id, STACK_REQUEST)
        (reply,) = ask.result(timeout=max(wait_s, 2.0))
        return pick_thread(str(reply["content"]["stack"]), engine.main_thread)
    except Exception as e:  # no answer (an engine without the handler, or gone)
        return f"(no stack from rank {engine.rank} on {engine.host}: {type(e).__name__} {e})"


def interrupt_remote(client: Any, engine_id: int) -> None:
    """SIGINT an engine on another machine through its control channel (not waited for).

    ipykernel's ``interrupt_request`` (which the engine answers on its control thread, also
    while it runs a cell) makes the engine send SIGINT to itself; ipyparallel's public
    ``send_signal`` needs a nanny, which hora's engines run without. The control request is
    private to ipyparallel's client (see :mod:`hora.engines._ipp`).
    """
    try:
        _ipp.control_request(client, engine_id, "interrupt_request")
    except Exception as e:  # the controller or the engine is gone: the cell says so anyway
        log.info("engine %d: interrupt not sent: %s", engine_id, e)


class CellRun:
    """One cell on a set of engines; :meth:`wait` drives it to the end.

    Args:
        client: the connected ``ipyparallel.Client``.
        engines: the engines to run on (all ranks).
        code: the cell's source.
        sink: receives the output of the ranks in ``shown``.
        shown: ranks whose output is displayed live.
        stall_timeout_s: how long ranks may still run after the first one finished.
        cell_number: the notebook's number of the cell, put in the engines' tracebacks.
        numbers: what earlier cells were numbered (updated with this one).
        replacer: starts new engines for ranks that die while the others wait for them in
            ``hvd.elastic.run``; the new engines run the cell from its start.
    """

    def __init__(
        self,
        client: Any,
        engines: Sequence[Engine],
        code: str,
        sink: OutputSink,
        shown: Sequence[int],
        stall_timeout_s: float,
        cell_number: int | None = None,
        numbers: CellNumbers | None = None,
        replacer: Replacer | None = None,
    ) -> None:
        self.client, self.engines, self.code, self.sink = client, list(engines), code, sink
        self.rejoin = None if replacer is None else Rejoin(self, replacer, DEATH_GRACE_S)
        self.by_id = {e.engine_id: e.rank for e in self.engines}
        self.cell_number = cell_number
        self.numbers = numbers if numbers is not None else CellNumbers()
        self.failed_in_collective: list[int] = []
        if cell_number is not None:
            self.numbers.note_code(code, cell_number)
        self.shown = set(shown)
        self.stall_timeout_s = stall_timeout_s
        self.q: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self.replied: dict[int, Any] = {}
        self.idle: set[int] = set()
        self.tally = outputs.Tally()  # outputs each rank's reply says it published, and seen
        self.result = CellResult()
        self.first_done: float | None = None
        self.dead: dict[int, int | None] = {}
        self.stall: StallError | None = None
        self.released: list[int] = []

    # --- IO thread side: enqueue only -------------------------------------------------------
    def _hook(self, engine_id: int, fut: Any) -> None:
        fut.iopub_callbacks.append(partial(self._put, "iopub", engine_id))
        fut.add_done_callback(partial(self._put, "reply", engine_id))
        fut.output.add_done_callback(partial(self._put, "idle", engine_id))

    def _put(self, kind: str, engine_id: int, payload: Any) -> None:
        self.q.put((kind, engine_id, payload))

    # --- main thread side --------------------------------------------------------------------
    def send(self) -> None:
        """Send the cell to every engine (one execute request each)."""
        self.t0 = time.perf_counter()
        for e in self.engines:
            self.result.stdout[e.rank], self.result.stderr[e.rank] = "", ""
            self.result.outputs[e.rank] = []
            self.send_to(e)

    def send_to(self, e: Engine) -> None:
        """Send the cell to one engine (a new one replacing a dead rank, too)."""
        _ipp.send_cell(self.client, self.code, e.ident, partial(self._hook, e.engine_id))

    def done(self, rank: int) -> bool:
        """Whether ``rank`` finished the cell: its reply came, and every output it published.

        An engine tells in its reply how many outputs it published (:mod:`hora.engines.outputs`):
        once they all came the rank is done, without waiting for the ``idle`` that ends the
        request on IOPub (which comes later); an engine that does not tell is waited for.
        """
        return rank in self.replied and (rank in self.idle or self.tally.complete(rank))

    def forget(self, rank: int) -> None:
        """Forget what ``rank`` answered (a new engine runs the cell again in its place)."""
        self.replied.pop(rank, None)
        self.idle.discard(rank)
        self.tally.forget(rank)

    def pending(self) -> list[int]:
        """Return the ranks that have not finished the cell (nor died)."""
        return [e.rank for e in self.engines if not self.done(e.rank) and e.rank not in self.dead]

    def _handle(self, kind: str, engine_id: int, payload: Any) -> None:
        rank = self.by_id.get(engine_id)
        if rank is None:  # a dead engine's request, failed by ipyparallel: its rank is re-run
            return
        if kind == "iopub":
            self._on_iopub(rank, payload)
        elif kind == "reply":
            self._on_reply(rank, payload)
        else:
            self.idle.add(rank)
        if self.first_done is None and self.done(rank):
            self.first_done = time.monotonic()

    def _on_reply(self, rank: int, fut: Any) -> None:
        reply = fut.result() if fut.exception() is None else fut.exception()
        self.replied[rank] = reply
        content = _ipp.reply_content(reply)
        self.tally.replied(rank, content)
        count = _ipp.reply_count(reply)
        if count is not None and self.cell_number is not None:
            self.numbers.by_count.setdefault(rank, {})[count] = self.cell_number

    def _on_iopub(self, rank: int, msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        self.tally.seen(rank, kind)
        if kind == "stream":
            name = content.get("name", "stdout")
            text = content.get("text", "")
            store = self.result.stdout if name == "stdout" else self.result.stderr
            store[rank] += text
            if rank in self.shown:
                self.sink.stream(rank, name, text)
        elif kind in ("display_data", "execute_result", "update_display_data"):
            if kind != "update_display_data":
                self.result.outputs[rank].append(content)
            if rank in self.shown:
                self.sink.display(rank, dict(content, update=kind == "update_display_data"))
        elif kind == "clear_output" and rank in self.shown:
            self.sink.display(rank, {"clear": True, "wait": bool(content.get("wait"))})

    def _drain(self, until: float | None) -> None:
        """Process queued events until every rank is done, ``until`` passes, or a poll tick."""
        timeout = POLL_S if until is None else max(0.0, min(POLL_S, until - time.monotonic()))
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(*item)
        while True:  # take whatever else is already there without sleeping
            try:
                self._handle(*self.q.get_nowait())
            except queue.Empty:
                return

    def _check_deaths(self) -> None:
        for e in self.engines:
            code = e.proc.poll()
            if code is not None and e.rank not in self.dead:
                self.dead[e.rank] = code
                log.info("rank %d (pid %d) exited: %s", e.rank, e.pid, code)

    def wait(self) -> CellResult:
        """Wait for every rank, showing output as it comes.

        Returns:
            The cell's output on every rank.

        Raises:
            CellFailedError: the cell raised on one or more ranks.
            RankDiedError: an engine process exited during the cell.
            StallError: ranks still ran ``stall_timeout_s`` after the first one finished.
            EnginesInterrupted: KeyboardInterrupt in the kernel; engines were sent SIGINT.
        """
        try:
            self._loop()
        except KeyboardInterrupt:
            self._interrupt()
        self.result.elapsed_s = time.perf_counter() - self.t0
        self._raise_errors()
        return self.result

    def _loop(self) -> None:
        death_deadline: float | None = None
        last_check = time.monotonic()
        while self.pending() and self.stall is None:
            self._drain(death_deadline)
            now = time.monotonic()
            if now - last_check >= POLL_S:
                last_check = now
                self._check_deaths()
                if self.dead and death_deadline is None:
                    death_deadline = now + DEATH_GRACE_S
                if self.dead and self.rejoin is not None and death_deadline is not None:
                    death_deadline = self.rejoin.step(now, death_deadline)
                elif self.rejoin is not None:
                    self.rejoin.reform_if_waiting()
            if death_deadline is not None and now >= death_deadline:
                break
            # a rank that failed will never join its peers' collective: look sooner
            limit = min(self.stall_timeout_s, ERROR_STALL_S) if self._errors() else None
            if (
                death_deadline is None
                and self.first_done is not None
                and now - self.first_done > (limit or self.stall_timeout_s)
            ):
                self._stall()

    def _stall(self) -> None:
        """Release ranks that wait in a collective the others left; else keep waiting.

        A rank that computes alone (``if hvd.rank() == 0: evaluate()``) is not stalled: it is
        sampled again one timeout later.
        """
        missing = self.pending()
        by_rank = {e.rank: e for e in self.engines}
        stacks = {
            r: self.numbers.stack(read_stack(by_rank[r], client=self.client)) for r in missing
        }
        if not any(in_collective(st) for st in stacks.values()):
            self.first_done = time.monotonic()
            return
        finished = [e.rank for e in self.engines if e.rank not in missing]
        self.stall = StallError(missing, finished, self.stall_timeout_s, stacks)
        self.released = missing
        self._release(missing)

    def _release(self, blocked: Sequence[int]) -> None:
        """Free ranks blocked in a collective: interrupt them, abort the free ranks' groups.

        A rank waiting inside a collective does not see SIGINT until the collective returns;
        aborting the process group in the ranks that are done closes their connections, so the
        blocked ranks' collective fails at once and their cell ends (with the interrupt).
        Ranks freed that way are aborted in turn (a ring waits on its neighbour). The caller
        then builds a new process group in the same engines.
        """
        self._sigint(blocked)
        aborted: set[int] = set()
        deadline = time.monotonic() + RELEASE_GRACE_S
        try:
            while self.pending() and time.monotonic() < deadline:
                running = set(self.pending()) | set(self.dead) | aborted
                for e in self.engines:
                    if e.rank not in running:
                        self.client[e.engine_id].apply_async(abort_group)
                        aborted.add(e.rank)
                self._drain(deadline)
        except KeyboardInterrupt:  # a second interrupt: stop waiting
            pass

    def _sigint(self, ranks: Sequence[int]) -> None:
        for e in self.engines:
            if e.rank in ranks and not e.local:  # its pid is another machine's
                interrupt_remote(self.client, e.engine_id)
            elif e.rank in ranks:
                try:
                    os.kill(e.pid, signal.SIGINT)
                except OSError:
                    pass

    def _interrupt(self) -> None:
        running = self.pending()
        self._sigint(running)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        try:
            while self.pending() and time.monotonic() < deadline:
                self._drain(deadline)
            by_rank = {e.rank: e for e in self.engines}
            blocked = [
                r
                for r in self.pending()
                if in_collective(read_stack(by_rank[r], client=self.client))
            ]
            if blocked:
                self.released = blocked
                self._release(blocked)
        except KeyboardInterrupt:  # a second interrupt: stop waiting
            pass
        raise EnginesInterrupted(running, self.pending(), self.released)

    def _errors(self) -> list[RankError]:
        errs = [_to_rank_error(r, reply) for r, reply in sorted(self.replied.items())]
        # a collective that failed may leave its group unusable (a shape mismatch is caught
        # before any data moves, so it does not)
        self.failed_in_collective = [
            e.rank
            for e in errs
            if e is not None
            and e.ename != "TensorMismatchError"
            and in_collective("\n".join(e.traceback))
        ]
        return [
            replace(e, traceback=hide_hora_frames(self.numbers.traceback(e.rank, e.traceback)))
            for e in errs
            if e is not None
        ]

    def _raise_errors(self) -> None:
        if self.dead:
            by_rank = {e.rank: e for e in self.engines}
            logs = {r: log_tail(by_rank[r].log_file, by_rank[r].main_thread) for r in self.dead}
            errors = [e for e in self._errors() if e.rank not in self.dead]
            raise RankDiedError(self.dead, logs, errors, self.pending())
        errors = self._errors()
        if self.stall is not None:
            # ranks that failed before the others stalled: their error is the cause
            if all(e.rank in self.stall.missing_ranks for e in errors):
                self.stall.still_running = self.pending()
                raise self.stall
        if errors:
            err = CellFailedError(errors, self.released)
            err.still_running = self.pending()
            err.in_collective = self.failed_in_collective
            raise err


def run_cell(
    client: Any,
    engines: Sequence[Engine],
    code: str,
    *,
    sink: OutputSink | None = None,
    shown: Sequence[int] = (0,),
    stall_timeout_s: float = 60.0,
    cell_number: int | None = None,
    numbers: CellNumbers | None = None,
    replacer: Replacer | None = None,
) -> CellResult:
    """Run ``code`` on every engine and wait, streaming the shown ranks' output to ``sink``.

    Args:
        client: a connected ``ipyparallel.Client``.
        engines: every rank's :class:`Engine`.
        code: Python source of the cell.
        sink: where live output goes (default: nowhere; it is in the result anyway).
        shown: ranks whose output goes to the sink.
        stall_timeout_s: seconds ranks may keep running after the first rank finished.
        cell_number: the notebook's cell number, shown in tracebacks instead of the engine's.
        numbers: the numbers of the cells run before (updated with this one).
        replacer: replaces ranks that die while the others wait in ``hvd.elastic.run``.

    Returns:
        Every rank's output.

    Raises:
        CellFailedError: the cell raised on one or more ranks.
        RankDiedError: an engine exited during the cell.
        StallError: some ranks never finished.
        EnginesInterrupted: the kernel was interrupted while waiting.

    Example:
        >>> run_cell(client, engines, "print(hvd.rank())").stdout[1]  # doctest: +SKIP
        '1' + chr(10)
    """
    run = CellRun(
        client, engines, code, sink or NullSink(), shown, stall_timeout_s, cell_number, numbers,
        replacer,
    )
    run.send()
    return run.wait()
