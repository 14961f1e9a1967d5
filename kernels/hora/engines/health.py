"""Health of a running cluster: liveness, device and memory per rank (data plane).

Liveness and resident memory come from the operating system (the kernel started the engine
processes and reads ``/proc``), so ``%dist_status`` answers even while a cell is running. GPU
memory needs torch inside the engine: it is asked for with a short timeout and shown as
"busy" when the engine is running a cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hora.engines import bootstrap
from hora.engines.errors import exit_status
from hora.engines.group import Engine


def engine_status(
    engines: Sequence[Engine], client: Any, timeout: float = 3.0
) -> list[dict[str, Any]]:
    """Return one row per rank: rank, engine id, pid, alive, state, device, rss_mb, cuda_mb.

    Args:
        engines: a started cluster's engines, by rank.
        client: its ipyparallel client (None: no CUDA memory numbers).
        timeout: seconds to wait for GPU engines' CUDA memory numbers.

    Returns:
        The rows, by rank.

    Example:
        >>> engine_status(cluster.engines, cluster.client)[0]["alive"]  # doctest: +SKIP
        True
    """
    rows = []
    cuda = _cuda_memory(engines, client, timeout)
    for e in engines:
        code = e.proc.poll()
        rows.append(
            {
                "rank": e.rank,
                "engine_id": e.engine_id,
                "pid": e.pid,
                "alive": code is None,
                "state": "alive" if code is None else exit_status(code),
                "device": e.device,
                "rss_mb": _rss_mb(e) if code is None else 0.0,
                "cuda_mb": cuda.get(e.rank, "-"),
            }
        )
    return rows


def _rss_mb(e: Engine) -> float | str:
    """The engine's resident memory in MiB ("-" for one on another machine)."""
    return round(bootstrap._rss(e.pid) / 2**20, 1) if e.local else "-"


def _cuda_memory(engines: Sequence[Engine], client: Any, timeout: float) -> dict[int, Any]:
    gpu = [e for e in engines if e.device.startswith("cuda") and e.proc.poll() is None]
    if not gpu or client is None:
        return {}
    ars = {e.rank: client[e.engine_id].apply_async(bootstrap.memory) for e in gpu}
    out: dict[int, Any] = {}
    for rank, ar in ars.items():
        ar.wait(timeout)
        out[rank] = round(ar.get(0).get("cuda", 0) / 2**20, 1) if ar.successful() else "busy"
    return out
