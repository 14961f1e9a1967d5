"""Parking a notebook's session and resuming it: the kernel's side (data plane).

A :class:`Parker` is given a session cluster's engines (its
:class:`~hora.engines.group.EngineGroup`), its
:class:`~hora.engines.session_launcher.SessionLauncher` and lock, and its ``start`` and
``release`` as callables (never the cluster, :class:`hora.engines.session.ServiceCluster`,
which owns the parker). To park, it asks
every engine what cannot be saved (:func:`hora.engines.park.scan`), refuses with that list
before anything stops (unless told to drop those names), asks the service where to write
(``POST /v1/sessions/{id}/park``: a directory in the owner's own, the quota left), has
every rank write its own part at once (:func:`hora.engines.park.write`; nothing goes
through rank 0 or the kernel), and commits (``.../park/commit``): the service checks the
parts, counts them against the quota, records them and stops the engines; their slots go
back to the pool. A park that fails anywhere before the commit leaves the engines running
with their variables (the service forgets the parts).

To resume, the cluster starts again in resume mode (``.../resume``: queued like any request,
Ctrl-C withdraws and the session stays parked); the engines start reading their parts as
they start; once they are up every rank checks its part against the checksum the service
recorded and loads it, and only when all have loaded does each put it in its namespace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hora.client import ServiceError
from hora.engines import park
from hora.engines.errors import EngineError
from hora.engines.state import ClusterState
from hora.errors import HoraError
from hora.scaling import fmt_bytes
from hora.session_wire import ABORT_WHY_MAX, ParkAbort, ParkBegin, body, wire
from hora.spec import JobState, ParkCommit, ParkedRank, ParkInfo, ParkTicket, SessionInfo

if TYPE_CHECKING:  # pragma: no cover
    from hora.engines.group import EngineGroup
    from hora.engines.session_launcher import SessionLauncher

log = logging.getLogger("hora.engines")

PARKED_WAIT_S = 60.0  # how long a park waits for the service to have stopped the engines
WRITE_RATE = 20 << 20  # the slowest disk a park's timeout allows for, bytes per second


class ParkRefusedError(EngineError):
    """Variables that cannot be saved: nothing was parked, nothing stopped.

    Attributes:
        unsaveable: by rank, what cannot be saved (name, type, why).
    """

    def __init__(self, unsaveable: Mapping[int, Sequence[park.Unsaveable]]) -> None:
        self.unsaveable = {r: list(v) for r, v in unsaveable.items() if v}
        names = sorted({u.name for v in self.unsaveable.values() for u in v})
        lines = ["these variables cannot be saved; nothing was parked, the engines run on:"]
        for rank, found in sorted(self.unsaveable.items()):
            lines += [f"  rank {rank}: {u.line()}" for u in found]
        lines.append(
            f"drop them with %dist_park --drop {' '.join(names)}, or park without whatever "
            "cannot be saved with --force"
        )
        super().__init__("\n".join(lines))


class ParkError(EngineError):
    """The session could not be parked; its engines run on with their variables."""


class ResumeError(EngineError):
    """A parked session could not be resumed, or its snapshot not restored."""


def _names_a_rank(ranks: Sequence[ParkedRank] | Sequence[Mapping[str, Any]]) -> str:
    counts = sorted({len(r.names if isinstance(r, ParkedRank) else r["names"]) for r in ranks})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


@dataclass(frozen=True)
class ParkReport:
    """What a park did: the session, its snapshot's size, how long, what was left out."""

    session: int
    seconds: float
    bytes: int
    names: str
    dropped: list[str]
    write_s: float = 0.0  # from the ticket to the last rank's part on disk

    def line(self) -> str:
        """The notebook's line, e.g. ``parked session 12 in 2.3 s: 412 MB (3 names a rank)``."""
        text = (
            f"parked session {self.session} in {self.seconds:.1f} s: {fmt_bytes(self.bytes)} "
            f"({self.names} names a rank); slots freed; the next %%distributed cell resumes it"
        )
        if self.dropped:
            text += f"\nleft out (not saved): {', '.join(self.dropped)}"
        return text


@dataclass(frozen=True)
class ResumeReport:
    """What a resume did, with the times of its steps."""

    session: int
    seconds: float
    queued_s: float
    engines_s: float
    restore_s: float
    names: str
    bytes: int
    parked: ParkInfo
    lost: list[str]

    def line(self) -> str:
        """``resumed session 12 in 6.1 s (queued 0.4 s, engines 3.9 s, restore 1.8 s: ...)``."""
        text = (
            f"resumed session {self.session} in {self.seconds:.1f} s (queued "
            f"{self.queued_s:.1f} s, engines {self.engines_s:.1f} s, restore "
            f"{self.restore_s:.1f} s: {self.names} names a rank, {fmt_bytes(self.bytes)})"
        )
        dropped = sorted({d for r in self.parked.ranks for d in r.dropped})
        if dropped:
            text += f"\nnot restored (left out at the park): {', '.join(dropped)}"
        if self.lost:
            text += f"\nmodules that did not import again: {', '.join(self.lost)}"
        return text

    def why(self) -> str:
        """When and why the session was parked, e.g. ``session 12 was parked at 10:02:11: ...``."""
        at = self.parked.parked_at.astimezone().strftime("%H:%M:%S")
        return f"session {self.session} was parked at {at}: {self.parked.reason}"


class Parker:
    """Parks a session cluster's engines and resumes them (module docstring).

    Args:
        group: the session cluster's engines (their state, client and options).
        launcher: the session's launcher (the service, the session, the one to resume).
        lock: the cluster's lock, held by whatever uses the engines (a cell, a push).
        start: starts the engines (the cluster's ``start``; in resume mode after a park).
        release: lets go of the parked engines and the controller (the cluster's).
        notify: shows a notice in the notebook (a park the service asked for).
    """

    def __init__(
        self,
        group: EngineGroup,
        launcher: SessionLauncher,
        lock: threading.RLock,
        start: Callable[[], object],
        release: Callable[[], None],
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.group, self.launcher, self.lock = group, launcher, lock
        self.start, self.release = start, release
        self.notify = notify
        self._background: threading.Thread | None = None

    # --- park ---------------------------------------------------------------------------------
    def scan(self, drop: Sequence[str] = ()) -> tuple[dict[int, list[park.Unsaveable]], int]:
        """What each rank cannot save, and the estimated size of the snapshot."""
        found = self._on_all(park.scan, [drop], self.group.options.timeout_s * 5)
        bad = {f["rank"]: [park.Unsaveable(*u) for u in f["unsaveable"]] for f in found}
        return bad, sum(int(f["bytes"]) for f in found)

    def park(
        self, drop: Sequence[str] = (), force: bool = False, cause: str = "user"
    ) -> ParkReport:
        """Save every engine's namespace, then let the service stop them and free the slots.

        Args:
            drop: names left out.
            force: also leave out whatever cannot be saved (named in the report).
            cause: ``user`` (``%dist_park``) or ``exit`` (the kernel exits); a park the
                service asked for carries the service's own reason.

        Raises:
            ParkRefusedError: something cannot be saved and neither ``drop`` nor ``force``
                leaves it out (nothing stopped).
            ParkError: the service refused (over quota: the figures are in the message) or a
                rank could not write its part; the engines run on.
        """
        g, launcher = self.group, self.launcher
        with self.lock, launcher.cell():
            session = launcher.session
            if g.state is not ClusterState.READY or session is None:
                raise ParkError("no running session to park")
            t0 = time.perf_counter()
            bad, estimate = self.scan(drop)
            if bad and any(bad.values()) and not force:
                raise ParkRefusedError(bad)
            left_out = sorted({*drop, *(u.name for v in bad.values() for u in v)})
            ticket = self._ticket(session.id, estimate, cause)
            t1 = time.perf_counter()
            written = self._write(session.id, ticket, left_out, estimate)
            write_s = time.perf_counter() - t1
            self._commit(session.id, ticket, written)
            self.release()
            try:
                self._wait_parked(launcher.resuming or 0)
            except HoraError as e:  # parked all the same: the service stops the engines
                log.warning("could not see the engines of the parked session stop: %s", e)
            return ParkReport(
                session=launcher.resuming or 0,
                seconds=time.perf_counter() - t0,
                bytes=sum(int(w["bytes"]) for w in written),
                names=_names_a_rank(written),
                dropped=sorted({d for w in written for d in w["dropped"]}),
                write_s=write_s,
            )

    def _ticket(self, sid: int, estimate: int, cause: str) -> ParkTicket:
        try:
            ask = wire(body(ParkBegin, bytes=estimate, cause=cause))
            resp = self._service("POST", f"/v1/sessions/{sid}/park", ask)
        except HoraError as e:  # refused (over quota), or the service does not answer
            raise ParkError(f"the hora service did not park session {sid}: {e}") from None
        return ParkTicket.model_validate(resp)

    def _write(
        self, sid: int, ticket: ParkTicket, drop: Sequence[str], estimate: int
    ) -> list[dict[str, Any]]:
        timeout = 300.0 + estimate / WRITE_RATE
        try:
            return self._on_all(park.write, [ticket.directory, list(drop)], timeout)
        except ParkError as e:
            self._abort(sid, ticket.ticket, str(e))
            raise

    def _commit(self, sid: int, ticket: ParkTicket, written: list[dict[str, Any]]) -> None:
        commit = ParkCommit(
            ticket=ticket.ticket,
            ranks=[ParkedRank.model_validate(w) for w in written],
            elastic=any(w["elastic"] for w in written),
        )
        try:
            self._service("POST", f"/v1/sessions/{sid}/park/commit", wire(commit))
        except ServiceError as e:
            if e.status < 500:  # refused (over quota): nothing parked, it says why
                raise ParkError(f"the hora service did not park session {sid}: {e}") from None
            raise ParkError(
                f"parking session {sid} was not confirmed ({e}); if the service parked it, "
                "the next %%distributed cell resumes it"
            ) from None
        except HoraError as e:  # the service did not answer: it may have parked it or not
            raise ParkError(
                f"parking session {sid} was not confirmed ({e}); the engines run on unless "
                "the service parked it (the next %%distributed cell then resumes it)"
            ) from None

    def _abort(self, sid: int, ticket: str | None, why: str) -> None:
        try:
            # a longer reason than the service keeps would make it refuse the abort
            give_up = body(ParkAbort, ticket=ticket, why=why[:ABORT_WHY_MAX])
            self._service("POST", f"/v1/sessions/{sid}/park/abort", wire(give_up))
        except HoraError:
            pass  # the service forgets an unfinished park's parts by itself

    def _wait_parked(self, sid: int) -> SessionInfo:
        """Wait until the service stopped the engines (their slots are then free).

        Raises:
            HoraError: the service does not answer.
        """
        deadline = time.monotonic() + PARKED_WAIT_S
        while True:
            info = SessionInfo.model_validate(self._service("GET", f"/v1/sessions/{sid}"))
            if info.state != JobState.running or time.monotonic() > deadline:
                return info
            time.sleep(0.1)

    # --- a park the service asks for -----------------------------------------------------------
    def requested(self, reason: str) -> None:
        """The service asks for a park (from the heartbeat thread): park in the background.

        A running cell is never interrupted: while one runs (the cluster's lock is held)
        nothing happens, and the service sees the engines busy.
        """
        if self._background is not None and self._background.is_alive():
            return
        self._background = threading.Thread(
            target=self._park_requested, args=(reason,), name="hora-park", daemon=True
        )
        self._background.start()

    def _park_requested(self, reason: str) -> None:
        if not self.lock.acquire(blocking=False):
            return
        session = self.launcher.session
        sid = session.id if session is not None else 0
        try:
            if self.group.state is not ClusterState.READY:
                return
            report = self.park(force=True)
            self._say(f"hora: session {sid} parked ({reason}): {report.line()}")
        except Exception as e:  # on a thread of its own: say it, and let the service know
            log.warning("session %s: the park asked for failed", sid, exc_info=True)
            self._abort(sid, None, f"{type(e).__name__}: {e}")
            self._say(f"hora: session {sid} could not be parked ({reason}): {e}")
        finally:
            self.lock.release()

    def _say(self, text: str) -> None:
        if self.notify is not None:
            self.notify(text)

    # --- resume -------------------------------------------------------------------------------
    def parked_info(self, sid: int) -> ParkInfo:
        """The snapshot of parked session ``sid``, as the service recorded it.

        Raises:
            ResumeError: it is not parked (ended, or resumed elsewhere).
        """
        info = SessionInfo.model_validate(self._service("GET", f"/v1/sessions/{sid}"))
        if info.state == JobState.running and info.park is not None:
            info = self._wait_parked(sid)  # a park that is still stopping the engines
        if info.state != JobState.parked or info.park is None:
            why = f": {info.reason}" if info.reason else ""
            raise ResumeError(f"session {sid} is {info.state.value}{why}; it cannot be resumed")
        return info.park

    def resume(self, n: int | None = None) -> ResumeReport:
        """Ask for the parked session's engines again and restore every rank's namespace.

        Args:
            n: engines to resume with (default: as many as it was parked with; another
                number needs elastic state, ``hvd.elastic.TorchState`` in the namespace).

        Raises:
            ResumeError: it is not parked, another size without elastic state, or a part of
                the snapshot is missing or damaged (then nothing is restored on any rank).
            SessionWithdrawn: interrupted while queued (it stays parked).
        """
        g, launcher = self.group, self.launcher
        sid = launcher.resuming
        if g.state is not ClusterState.PARKED or sid is None:
            raise ResumeError("no parked session to resume")
        t0 = time.perf_counter()
        try:
            parked = self.parked_info(sid)
        except ServiceError as e:
            raise ResumeError(f"session {sid} cannot be resumed: {e}") from None
        except HoraError as e:  # not an EngineError: the service does not answer
            if isinstance(e, EngineError):
                raise
            raise ResumeError(f"session {sid} stays parked: {e}") from None
        size = n or parked.world
        if size != parked.world and not parked.elastic:
            raise ResumeError(
                f"session {sid} was parked with {parked.world} engines; resuming with {size} "
                "needs elastic state (hvd.elastic.TorchState in the namespace): resume with "
                f"-n {parked.world}"
            )
        # held throughout: a park the service asks for meanwhile waits (the engines are busy)
        with self.lock:
            g.options = launcher.options = replace(g.options, n=size)  # both ask for it
            g.state = ClusterState.STOPPED
            try:
                self.start()
            except BaseException as e:
                launcher.resuming, g.state = sid, ClusterState.PARKED
                if isinstance(e, HoraError) and not isinstance(e, EngineError):
                    raise ResumeError(f"session {sid} stays parked: {e}") from None
                raise
            engines_s = max(0.0, g.start_s - launcher.queued_s)
            t1 = time.perf_counter()
            with launcher.cell():
                installed = self._restore(parked, size)
            self._service("DELETE", f"/v1/sessions/{sid}/snapshot")
            launcher.resuming = None
        return ResumeReport(
            session=sid, seconds=time.perf_counter() - t0, queued_s=launcher.queued_s,
            engines_s=engines_s, restore_s=time.perf_counter() - t1,
            names=_names_a_rank(installed), bytes=parked.bytes, parked=parked,
            lost=sorted({x for i in installed for x in i["lost"]}),
        )  # fmt: skip

    def _restore(self, parked: ParkInfo, size: int) -> list[dict[str, Any]]:
        """Check and load every rank's part; put them in the namespaces only if all loaded."""
        g, launcher = self.group, self.launcher
        parts = {r.rank: r for r in parked.ranks}
        timeout = 300.0 + parked.bytes / WRITE_RATE
        calls = []
        for engine in g.engines:
            part = parts[park.part_of(engine.rank, size, parked.world)]
            args = (parked.directory, part.rank, part.bytes, part.crc32, timeout)
            calls.append(g.client[engine.engine_id].apply_async(park.restore_prepare, *args))
        try:
            self._gather(calls, timeout)
        except ParkError as e:
            self._on_all(park.restore_discard, [], g.options.timeout_s)
            sid, launcher.resuming = launcher.resuming, None  # it runs on, as a fresh one
            try:  # it cannot be restored: keeping it would only park it again, as it is
                self._service("DELETE", f"/v1/sessions/{sid}/snapshot")
            except HoraError as gone:
                log.warning("could not delete the snapshot of session %s: %s", sid, gone)
            raise ResumeError(
                f"the snapshot of session {sid} was not restored, on any rank: {e}; it is "
                "deleted, and the engines run on without its variables"
            ) from None
        return self._on_all(park.restore_install, [], g.options.timeout_s)

    # --- plumbing -----------------------------------------------------------------------------
    def _service(self, method: str, path: str, data: dict[str, Any] | None = None) -> Any:
        resp = self.launcher.service.request(method, path, json=data)
        return resp.json()

    def _on_all(self, func: Callable[..., Any], args: list[Any], timeout: float) -> list[Any]:
        g = self.group
        calls = [g.client[e.engine_id].apply_async(func, *args) for e in g.engines]
        return self._gather(calls, timeout)

    def _gather(self, calls: list[Any], timeout: float) -> list[Any]:
        """Every engine's answer, in rank order.

        Raises:
            ParkError: naming the first rank that failed, or did not answer in ``timeout``.
        """
        from ipyparallel.error import KernelError

        out = []
        deadline = time.monotonic() + timeout
        for rank, call in enumerate(calls):
            try:
                out.append(call.get(timeout=max(0.1, deadline - time.monotonic())))
            except KernelError as e:  # what the rank raised, or its engine died
                name = getattr(e, "ename", type(e).__name__)
                raise ParkError(f"rank {rank}: {name}: {getattr(e, 'evalue', e)}") from None
            except TimeoutError:
                raise ParkError(f"rank {rank} did not answer within {timeout:.0f}s") from None
        return out


def parked_table(sessions: Sequence[SessionInfo]) -> list[dict[str, Any]]:
    """The rows ``%dist_resume`` lists: id, engines, since, size, why.

    Example:
        >>> parked_table([])
        []
    """
    rows = []
    for s in sessions:
        p = s.park
        if p is None:
            continue
        rows.append({
            "session": s.id, "name": s.name, "engines": p.world,
            "parked at": p.parked_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
            "size": fmt_bytes(p.bytes), "why": p.reason,
        })  # fmt: skip
    return rows
