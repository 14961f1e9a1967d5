"""Where this rank stands in the job, and what this build has (Horovod's ``basics``; data plane).

The world queries (``size``, ``rank``, ``local_rank``, ...) read the state ``init()`` made
(:mod:`hora.torch._state`); the ``*_built`` / ``*_enabled`` answers are Horovod's, for a
build on torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hora.torch._state import current, require_init


def is_initialized() -> bool:
    """Return whether ``init()`` has run (and ``shutdown()`` has not)."""
    return current() is not None


def size() -> int:
    """Return the number of ranks in the job.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("size").size


def rank() -> int:
    """Return this process's global rank.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("rank").rank


def local_size() -> int:
    """Return the number of ranks on this host.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("local_size").local_size


def local_rank() -> int:
    """Return this process's rank on its host (use it to pick the GPU).

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("local_rank").local_rank


def cross_size() -> int:
    """Return the number of hosts.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("cross_size").cross_size


def cross_rank() -> int:
    """Return this host's index among hosts.

    Raises:
        NotInitializedError: before ``init()``.
    """
    return require_init("cross_rank").cross_rank


def is_homogeneous() -> bool:
    """Return whether every host runs the same number of ranks."""
    st = require_init("is_homogeneous")
    return st.size == st.local_size * st.cross_size


def nccl_built() -> bool:
    """Return whether torch.distributed has NCCL (Horovod returns a version int; truthy here)."""
    return bool(dist.is_nccl_available())


def gloo_built() -> bool:
    """Return whether torch.distributed has gloo."""
    return bool(dist.is_gloo_available())


def mpi_built() -> bool:
    """Return whether torch.distributed was built with MPI."""
    return bool(dist.is_mpi_available())


def mpi_enabled() -> bool:
    """Return whether the MPI backend is in use (hora uses NCCL/gloo, so normally False)."""
    state = current()
    return state is not None and state.backend == "mpi"


def gloo_enabled() -> bool:
    """Return whether gloo carries the collectives."""
    state = current()
    return state is not None and "gloo" in state.backend


def mpi_threads_supported() -> bool:
    """Return False: hora does not use MPI threads (kept for Horovod compatibility)."""
    return False


def cuda_built() -> bool:
    """Return whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Return whether torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """Return False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Return False: oneCCL is not supported."""
    return False
