"""Persistent notebook engines: start, bind GPUs, init the process group, run cells (data plane).

``from hora.engines import Cluster, ClusterOptions`` is the Python API behind the ``%dist_*``
magics. Importing this package is cheap: ipyparallel is imported when a cluster starts, torch
only inside the engines.
"""

from __future__ import annotations

from hora.engines.cluster import Cluster, ClusterState
from hora.engines.errors import (
    CellFailedError,
    ClusterBrokenError,
    ClusterNotRunningError,
    CudaInitializedError,
    EngineError,
    EngineStartError,
    NotEnoughGpusError,
    RankDiedError,
    StallError,
)
from hora.engines.execute import CellResult, EnginesInterrupted, OutputSink
from hora.engines.plan import ClusterOptions

__all__ = [
    "CellFailedError",
    "CellResult",
    "Cluster",
    "ClusterBrokenError",
    "ClusterNotRunningError",
    "ClusterOptions",
    "CudaInitializedError",
    "EngineError",
    "EngineStartError",
    "EnginesInterrupted",
    "NotEnoughGpusError",
    "OutputSink",
    "RankDiedError",
    "StallError",
    "ClusterState",
]
