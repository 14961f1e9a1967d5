"""The private parts of torch.distributed that hora.torch must use, in one place (data plane).

torch has no public way to abort a process group (close its connections at once, failing the
work in flight, as a failed rank requires) or to reach the store the default group was made
with (a user's own ``init_process_group`` that hora adopts). Everything else in
:mod:`hora.torch` goes through torch's public API; a torch upgrade that moves these names
breaks here only.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def abort_default_group() -> None:
    """Abort the default process group and its subgroups: their connections close at once.

    In-flight collectives fail, here and on every peer waiting for this rank; afterwards
    ``dist.is_initialized()`` is false. (``destroy_process_group`` would wait for them.)
    """
    dist.distributed_c10d._abort_process_group()


def default_store() -> Any:
    """The store the default process group was created with (requires an initialised group)."""
    return dist.distributed_c10d._get_default_store()
