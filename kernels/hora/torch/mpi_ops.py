"""Horovod's collectives on torch.distributed: allreduce, broadcast, ... (data plane).

Same names, signatures and semantics as ``horovod.torch.mpi_ops``: out-of-place forms return a
new tensor and leave the input alone, ``_`` forms work in place, ``_async`` forms return a
handle for :func:`synchronize` / :func:`poll`. Each collective runs on its process set's group
(NCCL or gloo) once every member submitted its name: the ranks negotiate on a gloo side group
first (:mod:`hora.torch._engine`), so ranks passing different tensors get
:class:`~hora.errors.TensorMismatchError` instead of garbage, a hang or a gloo abort.
Failures and timeouts name the ranks at fault.

This module only gathers the public names: the implementations are in the ops layer
(:mod:`hora.torch._ops`, :mod:`~hora.torch._gather`, :mod:`~hora.torch._objects`), the
differentiable out-of-place forms in :mod:`hora.torch._autograd`.
"""

from __future__ import annotations

from hora.torch._autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
    reducescatter,
)
from hora.torch._gather import allgather_async, alltoall_async, reducescatter_async
from hora.torch._kinds import Adasum, Average, Max, Min, Product, Sum
from hora.torch._objects import allgather_object, barrier, broadcast_object, join
from hora.torch._ops import (
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from hora.torch._process_sets import ProcessSet, global_process_set

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "ProcessSet",
    "global_process_set",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "synchronize",
    "poll",
    "barrier",
    "join",
    "broadcast_object",
    "allgather_object",
]
