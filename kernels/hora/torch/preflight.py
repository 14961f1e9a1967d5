"""Communication preflight: latency and bandwidth of the world's collective paths (data plane).

Every rank calls :func:`run` at the same point of an initialised world (``hvd.init()`` does
it when ``HORA_PREFLIGHT=1``; ``%dist_start`` does it on the engines). In well under a
second it measures, on each path the ranks will use:

* **latency**: a few allreduces of one float (median per rank, microseconds);
* **bandwidth**: allreduces of a few sizes (CPU: 4 KiB, 256 KiB, 4 MiB; GPU: 1, 8 and
  64 MiB), each preceded by a timed local copy of the same bytes (the rank's own memory
  bandwidth). Bus bandwidth follows the nccl-tests definition for allreduce:
  ``algbw = bytes / time`` and ``busbw = algbw * 2 (n - 1) / n``, with the time of the
  slowest rank (the collective ends when its last rank does);
* **links**: a ping-pong of 1 MiB (GPU: 64 MiB) between ring neighbours
  ``(i, i + 1 mod n)``, each link's bandwidth counted both ways (``2 * bytes / round trip``).

The paths are ``gloo`` (or ``nccl`` on GPUs: the default group), and ``shm`` (hora's
same-host shared-memory ring, :mod:`hora.torch._shm`) when every rank is on one host and
the ring is usable. The figures are gathered on every rank, so every rank returns the same
:class:`PreflightReport` and takes the same decision.

A rank, link or path *far below* its reference is named in ``report.findings``: the
reference is the node's recorded baseline (``<baseline_dir>/<host>.json``, written by
:func:`save_baseline`), never the other ranks, which share a loaded machine's slowness. "Far
below" is under ``warn_below`` of the baseline (default 0.5; env
``HORA_PREFLIGHT_WARN_BELOW``); without a baseline nothing is judged. With ``fail_below``
(env ``HORA_PREFLIGHT_FAIL_BELOW``) a finding under that fraction raises
:class:`PreflightError` on every rank.

At ``hvd.init()`` rank 0 hands the figures to the hora service through the descriptor the
rank shim opened for it (``HORA_PREFLIGHT_FD``, :func:`publish`), never through the rank's
output: a job's log holds only what the job printed.

This module imports only torch, the standard library and hora.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hora.contract import RankEnv, preflight_pipe  # _fraction's PreflightError says the range
from hora.errors import HoraError
from hora.torch import _shm, _state, timeline
from hora.torch._preflight_figures import (
    DEFAULT_WARN_BELOW,
    KIB,
    MIB,
    Finding,
    LinkFigures,
    PathFigures,
    PreflightReport,
    RankFigures,
    judge,
    load_baseline,
    save_baseline,
)
from hora.torch._process_sets import comm_of
from hora.torch._stall import run_guarded

__all__ = [
    "CPU_SIZES", "GPU_SIZES", "Finding", "LinkFigures", "PathFigures", "PreflightError",
    "PreflightReport", "RankFigures", "load_baseline", "publish", "run", "save_baseline",
]  # fmt: skip

log = logging.getLogger("hora.torch.preflight")

CPU_SIZES = (4 * KIB, 256 * KIB, 4 * MIB)
GPU_SIZES = (1 * MIB, 8 * MIB, 64 * MIB)
CPU_LINK_BYTES, GPU_LINK_BYTES = 1 * MIB, 64 * MIB
LATENCY_ITERS = 5
REPS = 2  # timed allreduces per size (the latency rounds warm the path up)
EXTRA_COPIES = 3  # more timed local copies of the largest size
FIGURES_MAX = 256 << 10  # most bytes of one report the shim keeps (shim.FIGURES_MAX)

# Fault injection for tests: each is called with the phase ("copy" or "link") on this rank
# inside the timed region. Empty in normal use.
SLOW_HOOKS: list[Callable[[str], None]] = []


class PreflightError(HoraError):
    """A rank, link or path measured below the fail threshold (raised on every rank).

    ``report`` is what was measured (None when a setting was invalid).
    """

    def __init__(self, message: str, report: PreflightReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def _fraction(value: str | None, name: str) -> float | None:
    if value is None or value.strip() == "":
        return None
    try:
        f = float(value)
    except ValueError:
        raise PreflightError(f"{name} must be a fraction such as 0.5, got {value!r}") from None
    if not 0.0 < f <= 1.0:
        raise PreflightError(f"{name} must be in (0, 1], got {value!r}")
    return f


# --- measuring ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hooks(phase: str) -> None:
    for hook in SLOW_HOOKS:
        hook(phase)


class _Path:
    """How one path reduces a tensor in place (gloo/NCCL group, or the shared-memory ring)."""

    def __init__(self, name: str, state: _state.RankState, ring: Any = None) -> None:
        self.name, self.state, self.ring = name, state, ring

    def allreduce(self, t: torch.Tensor, tag: str) -> None:
        if self.ring is not None:
            self.ring.allreduce_(t, "preflight", tag)
        else:
            run_guarded("preflight", tag, dist.all_reduce, t, group=self.state.group)
        _sync(t.device)


def _timed_allreduce(path: _Path, t: torch.Tensor, tag: str) -> float:
    t0 = time.perf_counter()
    path.allreduce(t, tag)
    return time.perf_counter() - t0


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    _sync(dst.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _hooks("copy")
    _sync(dst.device)
    return time.perf_counter() - t0


def _measure_path(path: _Path, sizes: tuple[int, ...]) -> dict[str, Any]:
    """This rank's raw timings on ``path``: latency rounds, then per size copy + allreduce.

    The copies go into a buffer already written once (no first-touch page faults); the
    largest size's copy is the best of ``REPS + EXTRA_COPIES`` (a descheduled rank is not
    named for one slow copy).
    """
    device = path.state.device
    one = torch.ones(1, device=device)
    lat = [_timed_allreduce(path, one, f"{path.name}.lat") for _ in range(LATENCY_ITERS)]
    copies, colls = [], []
    for size in sizes:
        src = torch.ones(size // 4, device=device)
        buf = src.clone()
        best_copy, times = math.inf, []
        for _ in range(REPS):
            best_copy = min(best_copy, _timed_copy(buf, src))
            times.append(_timed_allreduce(path, buf, f"{path.name}.{size}"))
        if size == sizes[-1]:
            best_copy = min([best_copy] + [_timed_copy(buf, src) for _ in range(EXTRA_COPIES)])
        copies.append(best_copy)
        colls.append(times)
    return {"lat": lat, "copy": copies, "coll": colls}


def _ring_pairs(n: int) -> list[tuple[int, int]]:
    if n < 2:
        return []
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


def _ping(state: _state.RankState, t: torch.Tensor, a: int, b: int, tag: str) -> float:
    """One round trip a -> b -> a; its time on ``a`` (0 on ``b``)."""
    t0 = time.perf_counter()
    if state.rank == a:
        run_guarded("preflight", tag, dist.send, t, b, group=state.group)
        run_guarded("preflight", tag, dist.recv, t, b, group=state.group)
        _hooks("link")
    else:
        run_guarded("preflight", tag, dist.recv, t, a, group=state.group)
        _hooks("link")
        run_guarded("preflight", tag, dist.send, t, a, group=state.group)
    _sync(t.device)
    return time.perf_counter() - t0 if state.rank == a else 0.0


def _measure_links(state: _state.RankState, nbytes: int) -> dict[str, list[float]]:
    """Ping-pong each ring neighbour pair this rank is in; times kept by the pair's first rank."""
    small = torch.zeros(1, device=state.device)
    big = torch.zeros(nbytes // 4, device=state.device)
    out: dict[str, list[float]] = {}
    for a, b in _ring_pairs(state.size):
        if state.rank not in (a, b):
            continue
        tag = f"link.{a}.{b}"
        lat = min(_ping(state, small, a, b, tag) for _ in range(3))
        bw = min(_ping(state, big, a, b, tag) for _ in range(2))  # best of 2: less noise
        if state.rank == a:
            out[f"{a}-{b}"] = [lat, bw]
    return out


def _shm_ring(state: _state.RankState) -> Any:
    """The shared-memory ring when the world's CPU buckets will use it, else None."""
    if state.device.type != "cpu" or state.size < 2 or state.local_size != state.size:
        return None
    return _shm.ring_of(comm_of(None, "preflight"), "preflight")  # one host: no _hier


# --- summarising -------------------------------------------------------------------------------
def _busbw(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for an allreduce (nccl-tests' definitions)."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (n - 1) / n


def _summarise(name: str, sizes: tuple[int, ...], raws: list[dict[str, Any]],
               hosts: list[str]) -> PathFigures:
    n = len(raws)
    busbw, algbw = [], []
    for i, size in enumerate(sizes):
        worst = max(statistics.median(r["coll"][i]) for r in raws)
        alg, bus = _busbw(size, worst, n)
        algbw.append(alg)
        busbw.append(bus)
    ranks = []
    for r, raw in enumerate(raws):
        mine = [statistics.median(t) for t in raw["coll"]]
        ranks.append(RankFigures(
            rank=r, host=hosts[r], latency_us=1e6 * statistics.median(raw["lat"]),
            copy_gbps=sizes[-1] / raw["copy"][-1] / 1e9 if raw["copy"][-1] > 0 else 0.0,
            busbw_gbps=_busbw(sizes[-1], mine[-1], n)[1], coll_s=sum(sum(t) for t in raw["coll"]),
        ))
    for i in range(len(sizes)):  # waiting: this rank's time beyond the fastest rank's, per op
        for k in range(REPS):
            fastest = min(raw["coll"][i][k] for raw in raws)
            for r, raw in enumerate(raws):
                ranks[r].wait_s += raw["coll"][i][k] - fastest
    lat = statistics.median(x.latency_us for x in ranks)
    return PathFigures(name, list(sizes), busbw, algbw, lat, ranks)


def _links(raw_links: list[dict[str, list[float]]], nbytes: int) -> list[LinkFigures]:
    out = []
    for mine in raw_links:
        for key, (lat, rt) in mine.items():
            a, b = (int(x) for x in key.split("-"))
            gbps = 2 * nbytes / rt / 1e9 if rt > 0 else 0.0
            out.append(LinkFigures(a, b, 1e6 * lat / 2, gbps))
    return sorted(out, key=lambda k: (k.a, k.b))


# --- running -----------------------------------------------------------------------------------
def _sizes(sizes: tuple[int, ...] | list[int] | None, gpu: bool) -> tuple[int, ...]:
    if not sizes:
        return GPU_SIZES if gpu else CPU_SIZES
    out = tuple(int(s) for s in sizes)
    bad = [s for s in out if s < 4 or s % 4 or s > 64 * MIB]
    if bad:
        raise PreflightError(f"preflight sizes: {bad[0]} is not a multiple of 4 in 4..64 MiB")
    return tuple(sorted(out))


def _settings(
    env: Mapping[str, str], warn_below: float | None, fail_below: float | None
) -> tuple[float, float | None]:
    warn_var, fail_var = RankEnv.var("preflight_warn_below"), RankEnv.var("preflight_fail_below")
    warn = warn_below or _fraction(env.get(warn_var), warn_var) or DEFAULT_WARN_BELOW
    fail = fail_below if fail_below is not None else _fraction(env.get(fail_var), fail_var)
    return warn, fail


def run(
    *,
    sizes: tuple[int, ...] | list[int] | None = None,
    baseline_dir: str | os.PathLike[str] | None = None,
    warn_below: float | None = None,
    fail_below: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> PreflightReport:
    """Measure the world's collective paths (every rank calls it at the same point).

    Args:
        sizes: allreduce sizes in bytes (multiples of 4, at most 64 MiB); default
            ``CPU_SIZES`` or ``GPU_SIZES``.
        baseline_dir: where each node's ``<host>.json`` baseline is (default env
            ``HORA_PREFLIGHT_BASELINE``; none: nothing is judged, only measured).
        warn_below: name what is under this fraction of its reference (default 0.5).
        fail_below: raise when something is under this fraction (default env
            ``HORA_PREFLIGHT_FAIL_BELOW``; unset: warn only).
        environ: the settings' environment (default ``os.environ``).

    Returns:
        The same report on every rank.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        PreflightError: on every rank, when ``fail_below`` is set and something is under it
            (the message names it), or a setting is invalid.
        CollectiveTimeout, RankFailedError: a rank did not take part (named).
    """
    state = _state.require_init("preflight")
    env = os.environ if environ is None else environ
    warn, fail = _settings(env, warn_below, fail_below)
    gpu = state.device.type == "cuda"
    chosen = _sizes(sizes, gpu)
    if state.size < 2:
        return PreflightReport(1, state.backend, 0.0, [], warn_below=warn)
    t0 = time.perf_counter()
    host = socket.gethostname()
    paths = [_Path(state.backend, state)]
    ring = _shm_ring(state)
    if ring is not None:
        paths.append(_Path("shm", state, ring))
    raws = {p.name: _measure_path(p, chosen) for p in paths}
    link_bytes = GPU_LINK_BYTES if gpu else CPU_LINK_BYTES
    links = _measure_links(state, link_bytes)
    base = load_baseline(baseline_dir or env.get(RankEnv.var("preflight_baseline")), host)
    mine = {"host": host, "raws": raws, "links": links, "base": base,
            "s": time.perf_counter() - t0}
    every: list[Any] = [None] * state.size
    run_guarded("preflight", "gather", dist.all_gather_object, every, mine,
                group=state.side_group)
    report = _report(state, chosen, every, link_bytes, max(warn, fail or 0.0))
    report.warn_below = warn
    if fail is not None:
        bad = [f for f in report.findings if f.fraction < fail]
        if bad:
            raise PreflightError(
                f"preflight: below {fail:g} of the baseline: "
                + "; ".join(f.text() for f in bad),
                report,
            )
    return report


def _report(state: _state.RankState, sizes: tuple[int, ...], every: list[dict[str, Any]],
            link_bytes: int, below: float) -> PreflightReport:
    hosts = [e["host"] for e in every]
    bases = {e["host"]: e["base"] for e in every}
    figures = []
    for name in every[0]["raws"]:
        p = _summarise(name, sizes, [e["raws"][name] for e in every], hosts)
        if name != "shm":  # links are measured on the group's transport
            p.links = _links([e["links"] for e in every], link_bytes)
        figures.append(p)
    findings = [f for p in figures for f in judge(p, bases, below)]
    seconds = max(e["s"] for e in every)
    report = PreflightReport(state.size, state.backend, seconds, figures, findings)
    report.baseline = any(bases.values())
    return report


def _at_init(environ: Mapping[str, str], _process_sets: Any) -> None:
    """``hvd.init()`` hook: run the preflight when ``HORA_PREFLIGHT`` asks; rank 0 publishes it.

    Rank 0 hands the figures to the hora service (:func:`publish`); nothing is written to the
    rank's output. When the fail threshold is crossed, rank 0 publishes them first, with
    ``failed`` set to the error's message, so that the service can say which rank or link
    failed the job. Without a service to hand them to (``HORA_PREFLIGHT=1`` set by hand), a
    finding is logged as a warning, the figures at INFO.
    """
    if environ.get(RankEnv.var("preflight"), "").strip().lower() not in ("1", "on", "true", "yes"):
        return
    t0 = timeline.now_ns()
    try:
        report = run(environ=environ)
    except PreflightError as e:  # the threshold was crossed (or a setting is wrong)
        if e.report is not None:
            publish(e.report.to_dict() | {"failed": str(e)}, environ)
        raise  # init() fails, naming it
    except Exception as e:  # noqa: BLE001  (a check must not stop training that would work)
        log.warning("preflight: no figures (%s: %s)", type(e).__name__, e)
        return
    if timeline.enabled():  # the job's scaling report starts after it (hora.scaling)
        timeline.record("preflight", "PREFLIGHT", t0, timeline.now_ns(), 0)
    if not publish(report.to_dict(), environ) and _state.require_init("preflight").rank == 0:
        if report.findings:
            log.warning("preflight: far below the baseline: %s", report.slowest())
        log.info("%s", report.line())


def publish(figures: dict[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Rank 0 hands the figures to the hora service, on the pipe ``HORA_PREFLIGHT_FD`` names.

    The rank shim gives rank 0 that pipe and keeps each JSON document written to it (one a
    line, at most :data:`FIGURES_MAX` bytes) as ``preflight.json`` in the attempt's run
    directory, where the service reads it; the newest replaces the older (an elastic job's
    world measures again when it re-forms). Nothing goes to the rank's output.

    Args:
        figures: :meth:`PreflightReport.to_dict`, with ``failed`` (the error's message) when
            the threshold was crossed.
        environ: where ``HORA_PREFLIGHT_FD`` is read (default ``os.environ``).

    Returns:
        True when they were written; False on ranks other than 0, without the pipe (no hora
        service started this rank) or when the figures pass :data:`FIGURES_MAX` bytes.

    Raises:
        NotInitializedError: before ``hvd.init()``.
    """
    if _state.require_init("preflight").rank != 0:
        return False
    fd = preflight_pipe(os.environ if environ is None else environ)
    data = json.dumps(figures, separators=(",", ":")).encode() + b"\n"
    if fd is None or len(data) > FIGURES_MAX:
        return False
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError as e:  # the shim is gone: the job is ending anyway
        log.debug("preflight: cannot hand the figures over: %s", e)
        return False
    return True


_state.register_init_hook(_at_init)
