"""hora.torch's public names and signatures mirror horovod.torch (docs/dev/architecture.md,
"Conventions the tests hold")."""

from __future__ import annotations

import inspect

import hora.torch as hvd
import pytest

HOROVOD_NAMES = [
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
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
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
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
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "DistributedOptimizer",
    "Compression",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "SyncBatchNorm",
    "start_timeline",
    "stop_timeline",
]

# Horovod 0.28's leading parameters, in order.
SIGNATURES = {
    "allreduce": [
        "tensor",
        "average",
        "name",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "allreduce_": [
        "tensor",
        "average",
        "name",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "allreduce_async_": [
        "tensor",
        "average",
        "name",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "grouped_allreduce": [
        "tensors",
        "average",
        "name",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "allgather": ["tensor", "name", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "reducescatter": ["tensor", "name"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    "allgather_object": ["obj", "name", "process_set"],
    "join": ["device"],
    "init": ["comm", "process_sets"],
    "start_timeline": ["file_path", "mark_cycles"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_reducescatter": ["tensors", "name", "op", "process_set", "prescale_factor",
                              "postscale_factor"],
    "sparse_allreduce_async": ["tensor", "name", "op", "process_set"],
}


def test_every_horovod_name_is_exported() -> None:
    missing = [n for n in HOROVOD_NAMES if n not in hvd.__all__ or not hasattr(hvd, n)]
    assert not missing


def test_all_has_no_dangling_names() -> None:
    assert [n for n in hvd.__all__ if not hasattr(hvd, n)] == []
    assert len(set(hvd.__all__)) == len(hvd.__all__)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_horovod(name: str) -> None:
    params = list(inspect.signature(getattr(hvd, name)).parameters)
    assert params[: len(SIGNATURES[name])] == SIGNATURES[name]


def test_reduce_op_values_are_horovods() -> None:
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


def test_unsupported_capabilities_raise_clearly() -> None:
    with pytest.raises(hvd.UnsupportedError, match="comm"):
        hvd.init(comm=object())
    with pytest.raises(hvd.NotInitializedError, match="add_process_set"):
        hvd.add_process_set([0])  # process sets work (tests/dist/test_process_sets.py) after init


def test_horovods_exception_names_are_runtime_errors() -> None:
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.HostsUpdatedInterrupt(skip_sync=True).skip_sync is True
    # Horovod's suite expects a RuntimeError for mismatched shapes, dtypes and roots
    assert issubclass(hvd.TensorMismatchError, RuntimeError)
    assert issubclass(hvd.TensorMismatchError, ValueError)
