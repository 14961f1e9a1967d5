"""Autograd for allreduce, allgather and broadcast, as in Horovod (data plane).

When the input requires grad, the out-of-place collectives run through these Functions so
that gradients flow back: the gradient of an allreduce is the allreduce of the gradient (same
op and factors), of an allgather the summed gradient's slice for this rank, of a broadcast
the summed gradient on the root rank and zeros elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.torch import _state


class AllreduceFn(torch.autograd.Function):
    """Differentiable allreduce."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, average: Any, name: Any, op: Any, pre: float, post: float
    ) -> torch.Tensor:
        from hora.torch.mpi_ops import _allreduce, global_process_set

        ctx.args = (average, op, pre, post)
        return _allreduce(
            tensor, False, average, name, op, pre, post, global_process_set, sync=True
        ).wait()  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from hora.torch.mpi_ops import _allreduce, global_process_set

        average, op, pre, post = ctx.args
        out = _allreduce(grad, False, average, None, op, pre, post, global_process_set, sync=True)
        return out.wait(), None, None, None, None, None


class AllgatherFn(torch.autograd.Function):
    """Differentiable allgather."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any) -> torch.Tensor:
        from hora.torch._gather import allgather_async

        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        return allgather_async(tensor.detach(), name).wait()  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from hora.torch._gather import allgather_async
        from hora.torch.mpi_ops import Sum, _allreduce, global_process_set

        summed = _allreduce(grad, False, None, None, Sum, 1.0, 1.0, global_process_set, sync=True)
        dims = allgather_async(torch.tensor([ctx.dim]), None).wait()
        offset = int(dims[: _state.rank()].sum())
        return summed.wait().narrow(0, offset, ctx.dim), None


class BroadcastFn(torch.autograd.Function):
    """Differentiable broadcast."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any) -> torch.Tensor:
        from hora.torch.mpi_ops import broadcast_async

        ctx.root = root_rank
        return broadcast_async(tensor.detach(), root_rank, name).wait()  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from hora.torch.mpi_ops import Sum, _allreduce, global_process_set

        out = _allreduce(
            grad, False, None, None, Sum, 1.0, 1.0, global_process_set, sync=True
        ).wait()
        if _state.rank() != ctx.root:
            out = torch.zeros_like(out)
        return out, None, None
