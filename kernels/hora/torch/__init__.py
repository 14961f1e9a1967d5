"""hora.torch: Horovod's PyTorch API on torch.distributed (data plane).

Move a Horovod script over by changing one line::

    import hora.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())      # done by init() already; harmless
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

``__all__`` is the compatibility list: the ``horovod.torch`` names hora provides, plus hora's
error classes and metric helpers (``allreduce_metrics``, ``Metric``). Capabilities
hora lacks (Adasum, MPI communicators) raise
:class:`hora.errors.UnsupportedError` when used. This package imports only torch, the
standard library and hora.
"""

from __future__ import annotations

from hora.errors import (
    CollectiveTimeout,
    HoraError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    NotInitializedError,
    PeerFailedError,
    RankFailedError,
    RendezvousError,
    TensorMismatchError,
    UnsupportedError,
)

# hooks; preflight's init hook runs after the timeline's and the process sets'
from hora.torch import _handles, _process_sets, elastic, preflight, timeline  # noqa: F401
from hora.torch._autograd import grouped_allgather, grouped_reducescatter
from hora.torch._grouped import (
    grouped_allgather_async,
    grouped_reducescatter_async,
    sparse_allreduce_async,
)
from hora.torch._process_sets import add_process_set, remove_process_set
from hora.torch._state import init, shutdown
from hora.torch.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from hora.torch.compression import Compression
from hora.torch.functions import (
    Metric,
    allreduce_metrics,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sync_batch_norm import SyncBatchNorm
from hora.torch.timeline import start_timeline, stop_timeline

__all__ = [
    # init and world queries
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "nccl_built",
    "gloo_built",
    "mpi_built",
    "cuda_built",
    "rocm_built",
    "ddl_built",
    "ccl_built",
    "mpi_enabled",
    "gloo_enabled",
    "mpi_threads_supported",
    # reduce ops
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    # collectives
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
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
    "poll",
    "barrier",
    "join",
    "broadcast_object",
    "allgather_object",
    # process sets
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    # training helpers
    "DistributedOptimizer",
    "Compression",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "allreduce_metrics",
    "Metric",
    "SyncBatchNorm",
    # elastic training (hvd.elastic.run, TorchState, ElasticSampler...)
    "elastic",
    # timeline
    "start_timeline",
    "stop_timeline",
    # errors
    "HoraError",
    "NotInitializedError",
    "TensorMismatchError",
    "CollectiveTimeout",
    "RankFailedError",
    "UnsupportedError",
    "RendezvousError",
    "HorovodInternalError",
    "PeerFailedError",
    "HostsUpdatedInterrupt",
]
