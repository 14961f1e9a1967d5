"""Gradient compression for DistributedOptimizer, Horovod's Compressor interface (data plane).

A compressor turns a tensor into the tensor that travels (``compress``) and back
(``decompress``). :class:`DistributedOptimizer` applies it once per fusion bucket (a flat
buffer of many gradients), so fp16 halves the bytes on the wire at the cost of one cast each
way. Integer and already-narrow tensors pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
           "cast_dtype"]


class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's ``Compressor``)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compress a tensor.

        Args:
            tensor: the tensor to send.

        Returns:
            The tensor that travels and a context that :meth:`decompress` needs.
        """
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompress a tensor produced by :meth:`compress` (after it was reduced).

        Args:
            tensor: the reduced, compressed tensor.
            ctx: what :meth:`compress` returned next to it.

        Returns:
            The tensor in its original dtype.
        """
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor unchanged.

        Args:
            tensor: the tensor to send.

        Returns:
            ``(tensor, None)``.
        """
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor unchanged.

        Args:
            tensor: the reduced tensor.
            ctx: ignored.

        Returns:
            ``tensor``.
        """
        return tensor


class _CastCompressor(Compressor):
    """Cast wider floating-point tensors to ``wire_dtype`` for the trip."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # noqa: D102
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype and (
            tensor.element_size() > torch.finfo(cls.wire_dtype).bits // 8
        ):
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # noqa: D102
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16 (range +-65504: scale losses that can overflow).

    Example:
        >>> c, ctx = FP16Compressor.compress(torch.ones(3))
        >>> c.dtype, FP16Compressor.decompress(c, ctx).dtype
        (torch.float16, torch.float32)
    """

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (float32's range, 8 bits of mantissa).

    Example:
        >>> c, ctx = BF16Compressor.compress(torch.ones(3))
        >>> c.dtype
        torch.bfloat16
    """

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors by name: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.

    Example:
        >>> opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def cast_dtype(compression: Any) -> torch.dtype | None:
    """Return the wire dtype when ``compression`` is a plain cast (hora's fp16 or bf16).

    :class:`DistributedOptimizer` then casts each gradient straight into a wire buffer it keeps
    across steps, and straight back after the reduction, instead of calling ``compress`` and
    ``decompress`` (which allocate a new tensor each way). A subclass that overrides either
    method is called as it is.

    Args:
        compression: a compressor class or instance.

    Returns:
        The dtype that floating-point tensors wider than it travel as, or None.

    Example:
        >>> cast_dtype(Compression.fp16), cast_dtype(Compression.none)
        (torch.float16, None)
    """
    cls = compression if isinstance(compression, type) else type(compression)
    if not issubclass(cls, _CastCompressor):
        return None
    below = cls.__mro__[: cls.__mro__.index(_CastCompressor)]
    if any("compress" in c.__dict__ or "decompress" in c.__dict__ for c in below):
        return None
    return cls.wire_dtype
