"""The lifecycle states of a notebook cluster (data plane).

STOPPED -> STARTING -> READY; READY -> BROKEN when a rank can be reached no more (it died
while another was still inside the cell); ``restart`` leads back to READY. A session of the
hora service may be READY -> PARKED (its engines' state on disk, its engines gone); resuming
starts it again (PARKED -> STARTING -> READY).
"""

from __future__ import annotations

import enum


class ClusterState(enum.Enum):
    """Lifecycle of a cluster."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
    PARKED = "parked"
