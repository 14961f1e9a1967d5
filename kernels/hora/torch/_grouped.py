"""Grouped allgather / reducescatter and sparse allreduce, built on the single ops (data plane).

Horovod runs a group's members as one fused operation; hora launches each member (each one
checked and counted like a single call) and returns one handle for all of them, so
``synchronize`` gives the list of results in the order of the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from hora.torch._collective import Collective
from hora.torch._engine import GroupHandle
from hora.torch._gather import allgather_async, scatter_async
from hora.torch._handles import Handle
from hora.torch._kinds import Average, Kind, Sum
from hora.torch._ops import synchronize
from hora.torch._process_sets import ProcessSet, global_process_set


def _group(op: str, name: str | None, handles: list[Handle]) -> Handle:
    def finish() -> list[Any]:
        return [h.wait() for h in handles]

    return GroupHandle(op, name or f"{op}.group", handles, finish)


def _names(name: str | None, n: int) -> list[str | None]:
    return [None if name is None else f"{name}.{i}" for i in range(n)]


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start an allgather of each tensor; see :func:`grouped_allgather`."""
    handles = [
        allgather_async(t, n, process_set)
        for t, n in zip(tensors, _names(name, len(tensors)), strict=True)
    ]
    return _group(Kind.GROUPED_ALLGATHER, name, handles)



def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter of each tensor; see :func:`grouped_reducescatter`."""
    coll = Collective(op, None, name, prescale_factor, postscale_factor, process_set)
    return grouped_scatter_async(tensors, coll)


def grouped_scatter_async(tensors: Sequence[torch.Tensor], coll: Collective) -> Handle:
    """Start the reducescatter ``coll`` describes of each tensor (member i named ``name.i``)."""
    handles = [
        scatter_async(t, replace(coll, name=n))
        for t, n in zip(tensors, _names(coll.name, len(tensors)), strict=True)
    ]
    return _group(Kind.GROUPED_REDUCESCATTER, coll.name, handles)



def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
) -> Callable[[], torch.Tensor]:
    """Start a sparse allreduce: allgather every rank's indices and values (Horovod's way).

    Args:
        tensor: a sparse COO tensor of the same dense shape on every rank.
        name: a name for errors and the timeline.
        op: Average (default) or Sum.
        process_set: the process set to run on (default: every rank).

    Returns:
        A function that waits and returns the sparse result (duplicates not coalesced).

    Raises:
        ValueError: for a dense tensor or an op other than Average and Sum.

    Example:
        >>> wait = hvd.sparse_allreduce_async(grad.to_sparse(), name="emb")
        >>> total = wait()
    """
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async() expects a sparse COO tensor")
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async() supports op=Average or op=Sum")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    base = name or "sparse_allreduce"
    values = allgather_async(t._values(), f"{base}.values", process_set)
    indices = allgather_async(t._indices().t().contiguous(), f"{base}.indices", process_set)

    def wait() -> torch.Tensor:
        vals = synchronize(values)
        idx = synchronize(indices).t()
        if op == Average:
            vals = vals / process_set.size()
        # the pieces are every rank's valid indices; checking them again would cost a pass
        return torch.sparse_coo_tensor(idx, vals, t.shape, check_invariants=False)

    return wait
