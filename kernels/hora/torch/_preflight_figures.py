"""What the communication preflight found: its figures, its findings, the nodes' baselines.

Pure data and arithmetic for :mod:`hora.torch.preflight` (standard library only): the report
every rank returns, and the judging of each rank, link and path against the node's recorded
baseline (never against the other ranks: on a loaded machine they are slow together, and
one of them being slower says nothing of the hardware).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KIB, MIB = 1024, 1024 * 1024
DEFAULT_WARN_BELOW = 0.5


@dataclass
class RankFigures:
    """One rank's own measurements on one path."""

    rank: int
    host: str
    latency_us: float
    copy_gbps: float  # best local copy of the largest size (bytes / s / 1e9)
    busbw_gbps: float  # largest size, from this rank's own median time
    coll_s: float  # time this rank spent in the timed allreduces
    wait_s: float = 0.0  # of which waiting for later ranks (vs the fastest rank, per op)


@dataclass
class LinkFigures:
    """A ring neighbour pair's ping-pong."""

    a: int
    b: int
    latency_us: float
    gbps: float


@dataclass
class PathFigures:
    """The world's figures on one path."""

    path: str
    sizes: list[int]
    busbw_gbps: list[float]  # one per size, nccl-tests' definition (slowest rank's time)
    algbw_gbps: list[float]
    latency_us: float  # median over ranks
    ranks: list[RankFigures]
    links: list[LinkFigures] = field(default_factory=list)


@dataclass
class Finding:
    """A rank, link or path far below its reference."""

    kind: str  # "rank", "link" or "path"
    who: str  # "rank 1", "link 0<->1", "path gloo"
    path: str
    figure: str  # what was compared ("copy_gbps", "gbps", "busbw_gbps")
    value: float
    reference: float
    against: str = "baseline"

    @property
    def fraction(self) -> float:
        """``value / reference`` (0 when the reference is 0)."""
        return self.value / self.reference if self.reference > 0 else 0.0

    def text(self) -> str:
        """One phrase naming it, e.g. ``rank 1 (gloo copy_gbps 0.05, 3% of other ranks)``."""
        return (
            f"{self.who} ({self.path} {self.figure} {self.value:.3g}, "
            f"{100 * self.fraction:.0f}% of {self.against} {self.reference:.3g})"
        )


@dataclass
class PreflightReport:
    """What :func:`run` measured; the same on every rank."""

    size: int
    backend: str
    seconds: float
    paths: list[PathFigures]
    findings: list[Finding] = field(default_factory=list)
    warn_below: float = DEFAULT_WARN_BELOW
    baseline: bool = False  # some node had a recorded baseline to judge against

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``findings`` carry their ``text``)."""
        out = asdict(self)
        out["findings"] = [asdict(f) | {"text": f.text()} for f in self.findings]
        return out

    def slowest(self) -> str:
        """The findings as one phrase ("" when nothing is far below)."""
        return "; ".join(f.text() for f in self.findings)

    def line(self) -> str:
        """One line of figures, e.g. for ``%dist_start``'s output."""
        if not self.paths:
            return "preflight: one rank, no collective path to measure"
        parts = []
        for p in self.paths:
            top = _human(p.sizes[-1])
            part = f"{p.path} {top} busbw {p.busbw_gbps[-1]:.2f} GB/s, {p.latency_us:.0f} us"
            if p.links:
                lo = min(k.gbps for k in p.links)
                hi = max(k.gbps for k in p.links)
                part += f", links {lo:.2f}-{hi:.2f} GB/s"
            parts.append(part)
        return f"preflight ({self.size} ranks, {self.seconds:.2f}s): " + "; ".join(parts) + _tail(
            self.slowest(), self.baseline
        )


def _tail(slow: str, baseline: bool) -> str:
    """The line's verdict: what is far below its baseline, or why nothing is named.

    Example:
        >>> _tail("", False)
        '; no baseline recorded: nothing judged'
    """
    if slow:
        return f"; SLOW: {slow}"
    return "; no rank or link far below its baseline" if baseline else (
        "; no baseline recorded: nothing judged"
    )


def _human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def load_baseline(directory: str | os.PathLike[str] | None, host: str) -> dict[str, Any]:
    """The node's recorded baseline (``{path: {figure: value}}``), or {} when there is none.

    Args:
        directory: where the per-node files are (``<host>.json``); None: no baseline.
        host: the node's host name.
    """
    if not directory:
        return {}
    file = Path(directory) / f"{Path(host).name}.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    paths = data.get("paths") if isinstance(data, dict) else None
    return paths if isinstance(paths, dict) else {}


def save_baseline(report: PreflightReport, directory: str | os.PathLike[str]) -> list[Path]:
    """Record ``report`` as the baseline of every node in it (one ``<host>.json`` each).

    Each node's figures are the median of its ranks (links: of the links its ranks start).
    Call it on one rank, on a healthy world.

    Returns:
        The files written.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for host in sorted({r.host for p in report.paths for r in p.ranks}):
        paths: dict[str, dict[str, float]] = {}
        for p in report.paths:
            mine = [r for r in p.ranks if r.host == host]
            ranks_here = {r.rank for r in mine}
            links = [k.gbps for k in p.links if k.a in ranks_here]
            paths[p.path] = {
                "busbw_gbps": p.busbw_gbps[-1],
                "copy_gbps": statistics.median(r.copy_gbps for r in mine),
                "latency_us": statistics.median(r.latency_us for r in mine),
            } | ({"link_gbps": statistics.median(links)} if links else {})
        file = root / f"{host}.json"
        file.write_text(json.dumps({"host": host, "size": report.size, "paths": paths}, indent=1))
        written.append(file)
    return written


def _base(base: Mapping[str, Any], figure: str) -> float:
    """The baseline's ``figure`` (0 when the node has none: nothing to judge against)."""
    value = base.get(figure)
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def judge(p: PathFigures, bases: dict[str, dict[str, Any]], below: float) -> list[Finding]:
    """What of path ``p`` is under ``below`` of its node's baseline (``bases``: host -> paths).

    Example:
        >>> p = PathFigures("gloo", [4], [1.0], [1.0], 10.0,
        ...                 [RankFigures(0, "n1", 10.0, 0.2, 1.0, 0.0)])
        >>> [f.text() for f in judge(p, {"n1": {"gloo": {"copy_gbps": 4.0}}}, 0.5)]
        ['rank 0 (gloo copy_gbps 0.2, 5% of baseline 4)']
        >>> judge(p, {}, 0.5)
        []
    """
    found = []
    for r in p.ranks:
        ref = _base(bases.get(r.host, {}).get(p.path, {}), "copy_gbps")
        if ref > 0 and r.copy_gbps < below * ref:
            found.append(Finding("rank", f"rank {r.rank}", p.path, "copy_gbps", r.copy_gbps, ref))
    host_of = {r.rank: r.host for r in p.ranks}
    for k in p.links:
        ref = _base(bases.get(host_of.get(k.a, ""), {}).get(p.path, {}), "link_gbps")
        if ref > 0 and k.gbps < below * ref:
            found.append(Finding("link", f"link {k.a}<->{k.b}", p.path, "gbps", k.gbps, ref))
    refs = [ref for b in bases.values() if (ref := _base(b.get(p.path, {}), "busbw_gbps")) > 0]
    if refs and p.busbw_gbps[-1] < below * min(refs):
        found.append(Finding("path", f"path {p.path}", p.path, "busbw_gbps", p.busbw_gbps[-1],
                             min(refs)))
    return _merge_links(found, p)


def _merge_links(found: list[Finding], p: PathFigures) -> list[Finding]:
    """Name a rank instead of its links when every link it is in is slow (3+ ranks).

    The rank whose links are slowest is named first: when a loaded machine also slows a
    link between two sound ranks, the rank every slowest link goes through is the one named.
    """
    if len(p.ranks) < 3:
        return found
    slow = {f.who for f in found if f.kind == "link" and f.path == p.path}
    fraction = {f.who: f.fraction for f in found if f.who in slow}
    links_of = {
        r.rank: {f"link {k.a}<->{k.b}" for k in p.links if r.rank in (k.a, k.b)} for r in p.ranks
    }

    def worst_first(r: RankFigures) -> float:
        return max((fraction.get(w, 1.0) for w in links_of[r.rank]), default=1.0)

    for r in sorted(p.ranks, key=worst_first):
        mine = links_of[r.rank]
        if not mine or not mine <= slow:
            continue
        worst = min((f for f in found if f.who in mine), key=lambda f: f.fraction)
        found = [f for f in found if f.who not in mine]
        found.append(Finding("rank", f"rank {r.rank}", p.path, "link_gbps", worst.value,
                             worst.reference))
        slow -= mine
    return found
