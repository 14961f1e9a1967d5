"""SyncBatchNorm: batch normalization with statistics over every rank's batch (data plane).

Horovod-compatible ``hvd.SyncBatchNorm``. ``torch.nn.SyncBatchNorm`` refuses CPU tensors, so
this is an autograd Function that works on any device and backend (gloo or NCCL): forward
gathers each rank's per-channel (count, mean, M2) and combines them exactly (Chan et al.'s
parallel variance, no sum-of-squares cancellation); backward allreduces the two per-channel
sums the input gradient needs. Weight and bias gradients stay local, as in Horovod and torch:
DistributedOptimizer (or DDP) averages them with the other gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from hora.torch import _state
from hora.torch._engine import launch_planned
from hora.torch._stall import wait_work

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _bshape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


@torch.no_grad()
def _global_stats(
    x: torch.Tensor, state: _state.RankState
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return (mean, biased var, total count) over every rank's batch, per channel."""
    dims = _reduce_dims(x)
    n = x.numel() // x.size(1) if x.size(1) else 0
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if n:
        var, mean = torch.var_mean(xf, dim=dims, correction=0)
    else:
        mean = torch.zeros(x.size(1), dtype=xf.dtype, device=x.device)
        var = torch.zeros_like(mean)
    mine = torch.cat([torch.tensor([float(n)], dtype=xf.dtype, device=x.device), mean, var * n])
    rows = [torch.empty_like(mine) for _ in range(state.size)]
    work = launch_planned("allgather", "SyncBatchNorm.stats", dist.all_gather, rows, mine,
                          group=state.group, async_op=True)
    wait_work(work, "allgather", "SyncBatchNorm.stats")
    table = torch.stack(rows)
    counts, means, m2s = table[:, :1], table[:, 1 : 1 + x.size(1)], table[:, 1 + x.size(1) :]
    total = counts.sum()
    if total == 0:
        raise ValueError("SyncBatchNorm got an empty batch on every rank")
    gmean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - gmean) ** 2).sum(0)
    return gmean, m2 / total, int(total.item())


class _SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        mean: torch.Tensor, invstd: torch.Tensor, total: int,
    ) -> torch.Tensor:
        shape = _bshape(x)
        xhat = (x - mean.view(shape).to(x.dtype)) * invstd.view(shape).to(x.dtype)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd = ctx.saved_tensors
        dims, shape = _reduce_dims(dy), _bshape(dy)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        gw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        gb = sum_dy if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            state = _state.require_init("SyncBatchNorm")
            both = torch.cat([sum_dy, sum_dy_xhat])
            if both.dtype in (torch.float16, torch.bfloat16):  # float64 keeps its precision
                both = both.float()
            work = launch_planned("allreduce", "SyncBatchNorm.grad", dist.all_reduce, both,
                                  group=state.group, async_op=True)
            wait_work(work, "allreduce", "SyncBatchNorm.grad")
            c = dy.size(1)
            g_dy = (both[:c] / ctx.total).to(dy.dtype)
            g_dy_xhat = (both[c:] / ctx.total).to(dy.dtype)
            scale = invstd.to(dy.dtype) if weight is None else invstd.to(dy.dtype) * weight
            dx = (dy - g_dy.view(shape) - xhat * g_dy_xhat.view(shape)) * scale.view(shape)
        return dx, gw, gb, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover every rank's batch.

    Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (same arguments and state_dict keys). In
    training, mean and variance are computed over the union of all ranks' batches (one
    allgather of per-channel statistics in forward, one allreduce in backward); running
    statistics are updated from them identically on every rank. In eval mode with running
    statistics, or with one rank, it is plain batch normalization; in eval mode without them
    (``track_running_stats=False``) the batch statistics span every rank, as in training.
    Works on CPU (gloo) and GPU (NCCL).

    Args:
        num_features: channels C of an input of shape (N, C, ...).
        eps: added to the variance for stability.
        momentum: running-statistics factor (None: cumulative average).
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance for eval mode.
        device: where to create parameters and buffers.
        dtype: their dtype.

    Raises:
        NotInitializedError: in training with ``hvd.init()`` not called.

    Example:
        >>> bn = hvd.SyncBatchNorm(16)
        >>> y = bn(torch.randn(8, 16, 4, 4))
    """

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with statistics over all ranks (training) or running ones."""
        self._check_input_dim(input)
        # like torch's BatchNorm: batch statistics in training, and in eval mode too when no
        # running statistics are kept; those are the statistics that must span every rank
        batch_stats = self.training or self.running_mean is None or self.running_var is None
        state = _state.require_init("SyncBatchNorm") if batch_stats else None
        if state is None or state.size == 1:
            return super().forward(input)
        mean, var, total = _global_stats(input, state)
        if self.training and self.track_running_stats:
            self._update_running(mean, var, total)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBNFunction.apply(input, self.weight, self.bias, mean, invstd, total)

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: int) -> None:
        rm, rv, nbt = self.running_mean, self.running_var, self.num_batches_tracked
        if rm is None or rv is None or nbt is None:
            return
        with torch.no_grad():
            nbt.add_(1)
            factor = 1.0 / float(nbt) if self.momentum is None else self.momentum
            unbiased = var * (total / max(total - 1, 1))
            rm.mul_(1 - factor).add_(mean.to(rm.dtype), alpha=factor)
            rv.mul_(1 - factor).add_(unbiased.to(rv.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Return ``module`` with every BatchNorm*d replaced by a SyncBatchNorm (state kept).

        Args:
            module: a model (or a single BatchNorm layer).

        Returns:
            The converted module (the same object unless it was itself a BatchNorm).

        Example:
            >>> model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            new.load_state_dict(module.state_dict())
            new.train(module.training)
            return new.to(next(iter(module.state_dict().values()), torch.zeros(0)).device)
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child))
        return module

