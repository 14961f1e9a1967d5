"""What a host of ranks may do with this process's world: hora's engines and launchers (data plane).

``hora.torch`` keeps its world (process group, store, rank) in a private module; the notebook's
engines, which stay alive across worlds, need a few things from it that a training script never
calls: read the world, rebuild or abort its process group in place, say where the next
``init()`` finds its world, and whether the last one failed. This module is their one public
door (not part of Horovod's API: ``hora.torch.__all__`` does not name it).

Example:
    >>> from hora.torch import host
    >>> state = host.current()  # None before hvd.init()
    >>> state is None or state.rank < state.size
    True
"""

from __future__ import annotations

from hora.torch._state import (
    RankState,
    WorldSource,
    abort,
    current,
    left_broken,
    rebuild,
    require_init,
    set_world_source,
)

__all__ = [
    "RankState",
    "WorldSource",
    "abort",
    "current",
    "left_broken",
    "rebuild",
    "require_init",
    "set_world_source",
]
