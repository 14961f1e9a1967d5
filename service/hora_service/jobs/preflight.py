"""A job's communication preflight, read from its attempt's run directory (control plane).

The service asks for a preflight by setting ``HORA_PREFLIGHT=1`` in every rank's
environment (``preflight`` setting; a job's own ``env`` may set it to 0).
``hora.torch.init()`` then measures the collective paths (:mod:`hora.torch.preflight`) and
rank 0 hands the figures to its rank shim on a pipe (``HORA_PREFLIGHT_FD``), which keeps the
newest report as ``preflight.json`` in the attempt's run directory
(:attr:`~hora_service.runtimes.paths.JobPaths.preflight`, at most
:data:`FILE_MAX` bytes); nothing reaches the job's log. This module reads that file the way
every run file is read (:func:`hora_service.runtimes.runfiles.read_chunk`: no link followed,
nothing that can block, bounded), validates it into :class:`PreflightFigures` (bounded
lists, finite numbers), and keeps the figures of each job's attempt and the last bandwidth
seen per node and path for ``/metrics``.

A notebook session's engines are measured by ``%dist_start`` instead
(:func:`hora.engines.profile.engine_preflight`); its rank 0 engine hands them over the same
way.

While an attempt runs, the monitor looks at the file (:meth:`PreflightBook.poll`, at most
every :data:`POLL_S` seconds) and records each new report as an event of the job: a
transition with the job's state (``running``) and the figures' line as its reason, naming any
rank or link far below its node's recorded baseline (an elastic job's world measures again
each time it re-forms). When the admin's threshold (``job_preflight_fail_below``) was
crossed, rank 0 hands the figures over with ``failed`` set before every rank's
``hvd.init()`` raises, and the failed attempt's reason starts with that message, naming the
rank.

The figures are the job's own word: a job can write false ones. They only change its own
page, events and failure reason, and the ``hora_preflight_bandwidth_gbps`` gauge of the nodes
its ranks ran on until the next job's; nothing is scheduled on them. The gauge's labels are
bounded by what the service knows, never by what the job wrote
(:meth:`PreflightBook.measured`): a node is one of the nodes the service placed that attempt
on (this machine, or the nodes Slurm gave it), a path one of :data:`PATHS`; a rank naming any
other host or path adds no series.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

FILE_MAX = 256 << 10  # the shim keeps no larger report (shim.FIGURES_MAX)
_KEEP = 4096  # attempts whose figures are kept in memory
INF = float("inf")
POLL_S = 1.0  # how often a running attempt's figures file is looked at
EVENT_MAX = 2000
PATHS = frozenset({"gloo", "nccl", "mpi", "ucc", "shm"})  # the paths a preflight measures

Num = Annotated[float, Field(ge=0, le=1e9)]
Name = Annotated[str, Field(max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class RankRow(_Strict):
    """One rank's figures on one path."""

    rank: Annotated[int, Field(ge=0, le=1 << 20)]
    host: Name
    latency_us: Num
    copy_gbps: Num
    busbw_gbps: Num
    coll_s: Num = 0.0
    wait_s: Num = 0.0


class LinkRow(_Strict):
    """A ring neighbour pair's ping-pong."""

    a: Annotated[int, Field(ge=0, le=1 << 20)]
    b: Annotated[int, Field(ge=0, le=1 << 20)]
    latency_us: Num
    gbps: Num


class PathRow(_Strict):
    """The world's figures on one path (``gloo``, ``nccl`` or ``shm``)."""

    path: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,16}$")]
    sizes: Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(max_length=16)]
    busbw_gbps: Annotated[list[Num], Field(max_length=16)]
    latency_us: Num
    ranks: Annotated[list[RankRow], Field(max_length=4096)]
    links: Annotated[list[LinkRow], Field(max_length=4096)] = []


class FindingRow(_Strict):
    """A rank, link or path far below its reference."""

    kind: Annotated[str, Field(pattern=r"^(rank|link|path)$")]
    who: Name
    path: Name
    text: Annotated[str, Field(max_length=500)]


class PreflightFigures(_Strict):
    """What rank 0 measured: the world's size, the paths' figures, and what is far below."""

    size: Annotated[int, Field(ge=1, le=1 << 20)]
    backend: Name
    seconds: Num
    paths: Annotated[list[PathRow], Field(max_length=4)]
    findings: Annotated[list[FindingRow], Field(max_length=64)] = []
    failed: Annotated[str | None, Field(max_length=4000)] = None  # the threshold's error
    baseline: bool = False  # judged against a node's recorded baseline

    def line(self) -> str:
        """One line of figures, as ``%dist_start`` prints it."""
        parts = [
            f"{p.path} busbw {p.busbw_gbps[-1]:.2f} GB/s, {p.latency_us:.0f} us"
            for p in self.paths if p.busbw_gbps
        ]
        slow = "; ".join(f.text for f in self.findings)
        tail = f"; SLOW: {slow}" if slow else (
            "; no rank or link far below its baseline" if self.baseline
            else "; no baseline recorded: nothing judged"
        )
        tail += "; FAILED: threshold crossed" if self.failed else ""
        return f"preflight ({self.size} ranks, {self.seconds:.2f}s): " + "; ".join(parts) + tail

    def event(self) -> str:
        """The job's event for these figures (its line, at most :data:`EVENT_MAX` chars)."""
        text = self.line()
        return text if len(text) <= EVENT_MAX else text[: EVENT_MAX - 1] + "…"

    def explain(self, why: str) -> str:
        """A failed attempt's reason: the threshold's message (naming the rank) first.

        Example:
            >>> PreflightFigures(size=2, backend="gloo", seconds=0.1, paths=[],
            ...                  failed="preflight: below 0.3 of the baseline: rank 1 (...)"
            ...                  ).explain("rank 0 exited with code 1")
            'preflight: below 0.3 of the baseline: rank 1 (...); rank 0 exited with code 1'
        """
        if not self.failed or why.startswith(self.failed):
            return why
        return f"{self.failed}; {why}" if why else self.failed


def parse(data: bytes) -> PreflightFigures | None:
    """The figures in ``data`` (one JSON document, at most :data:`FILE_MAX` bytes), or None.

    Example:
        >>> parse(b'{"size": 2, "backend": "gloo", "seconds": 0.1, "paths": []}').size
        2
        >>> parse(b"HORA_PREFLIGHT {}") is None
        True
    """
    if len(data) > FILE_MAX:
        return None
    try:
        return PreflightFigures.model_validate(json.loads(data))
    except (ValueError, ValidationError):
        return None


def read_file(path: Path) -> PreflightFigures | None:
    """The figures in an attempt's ``preflight.json`` (None: none yet, invalid, unreadable)."""
    from hora_service.runtimes.runfiles import UntrustedRunFile, read_chunk

    try:
        return parse(read_chunk(path, 0, FILE_MAX + 1))
    except (OSError, UntrustedRunFile) as e:
        log.debug("preflight: cannot read %s: %s", path, e)
        return None


def _stamp(path: Path) -> tuple[int, int] | None:
    """The file's change time and size without following a link (None: no file yet)."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _bound(table: dict[tuple[int, int], Any]) -> None:
    """Keep at most :data:`_KEEP` entries (the oldest go first)."""
    while len(table) > _KEEP:
        table.pop(next(iter(table)))


class PreflightBook:
    """Each attempt's figures, and the last bus bandwidth per node and path (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._figures: dict[tuple[int, int], PreflightFigures] = {}
        self._by_node: dict[str, dict[str, float]] = {}
        self._next: dict[tuple[int, int], float] = {}  # running attempts: when to look again
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}  # the file's stamp last read
        self._told: dict[tuple[int, int], PreflightFigures] = {}  # the monitor's last event

    def poll(
        self, job_id: int, attempt: int, path: Path, now: float, force: bool = False
    ) -> PreflightFigures | None:
        """A running attempt's figures each time they are new, else None.

        The monitor calls it on every pass; the file (``preflight.json``) is looked at at
        most every :data:`POLL_S` seconds (``force``: now, as when a rank has ended) and read
        again only when it changed.
        """
        key = (job_id, attempt)
        with self._lock:
            if not force and now < self._next.get(key, 0.0):
                return None
            self._next[key] = now + POLL_S
            _bound(self._next)
            stamp = _stamp(path)
            if stamp is None or stamp == self._seen.get(key):
                return None
            self._seen[key] = stamp
            _bound(self._seen)
        figures = read_file(path)
        if figures is None:
            return None
        self._keep(key, figures)
        with self._lock:
            if self._told.get(key) == figures:
                return None
            self._told[key] = figures
            _bound(self._told)
        return figures

    def done(self, job_id: int, attempt: int) -> None:
        """The attempt has ended: forget when to look at its file."""
        with self._lock:
            for table in (self._next, self._seen, self._told):
                table.pop((job_id, attempt), None)

    def known(self, job_id: int, attempt: int) -> PreflightFigures | None:
        """The figures already read for an attempt, or None."""
        with self._lock:
            return self._figures.get((job_id, attempt))

    def note(self, job_id: int, attempt: int, path: Path) -> PreflightFigures | None:
        """The attempt's figures: those already read, else its file's (then kept)."""
        known = self.known(job_id, attempt)
        if known is not None:
            return known
        figures = read_file(path)
        if figures is not None:
            self._keep((job_id, attempt), figures)
        return figures

    def _keep(self, key: tuple[int, int], figures: PreflightFigures) -> None:
        with self._lock:
            self._figures.pop(key, None)
            if len(self._figures) >= _KEEP:
                self._figures.pop(next(iter(self._figures)))
            self._figures[key] = figures

    def measured(self, figures: PreflightFigures, nodes: frozenset[str]) -> None:
        """Set the gauge of the ``nodes`` the service placed an attempt on from its figures.

        A rank's host counts only if it is one of ``nodes`` (the service's own inventory,
        never the job's word) and a path only if it is one of :data:`PATHS`.

        Example:
            >>> book = PreflightBook()
            >>> rank = {"latency_us": 1, "copy_gbps": 1, "busbw_gbps": 1}
            >>> path = {"sizes": [1], "busbw_gbps": [2.5], "latency_us": 1, "ranks": [
            ...     {"rank": 0, "host": "n1", **rank}, {"rank": 1, "host": "made-up", **rank}]}
            >>> book.measured(PreflightFigures(size=2, backend="gloo", seconds=1, paths=[
            ...     {"path": "gloo", **path}, {"path": "invented", **path}]), frozenset({"n1"}))
            >>> book.by_node()
            {'n1': {'gloo': 2.5}}
        """
        with self._lock:
            for p in figures.paths:
                if p.path not in PATHS or not p.busbw_gbps:
                    continue
                for host in {r.host for r in p.ranks} & nodes:
                    self._by_node.setdefault(host, {})[p.path] = p.busbw_gbps[-1]

    def by_node(self) -> dict[str, dict[str, float]]:
        """Each node's path -> GB/s of the last preflight measured there (for ``/metrics``)."""
        with self._lock:
            return {n: dict(p) for n, p in self._by_node.items()}


def job_preflight(manager: Any, job: Any) -> dict[str, Any] | None:
    """The job's or session's current attempt's figures as JSON (with ``line``), or None."""
    if job.attempt < 1:
        return None
    try:
        path = manager.preflight_path(job.id, job.attempt)
    except Exception:  # noqa: BLE001  (no such attempt directory: nothing to show)
        return None
    figures = manager.preflight.note(job.id, job.attempt, path)
    if figures is None:
        return None
    return figures.model_dump(mode="json") | {"line": figures.line()}
