"""Gradient compression for transport (upstream's ``horovod.torch.compression``).

Must not touch: anything but the tensors it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from horovod.frontend import lossy as _lossy


class Compressor:
    """``compress(tensor) -> (tensor, ctx)``; ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    target: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating_point and tensor.dtype != cls.target:
            return tensor.to(cls.target), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating tensors travel as float16 and come back in their own dtype."""

    target = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors travel as bfloat16 (float32's range, half the bytes)."""

    target = torch.bfloat16


class Compression:
    """``none``, ``fp16``, ``bf16`` (cast around the allreduce); ``int8``, ``topk(ratio)``,
    ``powersgd(rank)``: lossy with error feedback, running their own exchange
    (``horovod.frontend.lossy``; with ``DistributedOptimizer`` or ``allreduce``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = _lossy.Int8()
    topk = staticmethod(_lossy.TopK)
    powersgd = staticmethod(_lossy.PowerSGD)
