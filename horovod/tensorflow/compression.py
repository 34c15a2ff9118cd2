"""Gradient compression for transport (upstream's ``horovod.tensorflow.compression``).

Must not touch: anything but the tensors it is given.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.frontend import Compressor, NoneCompressor
from horovod.frontend import lossy as _lossy


def _cast_compressor(target: tf.DType) -> type[Compressor]:
    class _Cast(Compressor):
        @staticmethod
        def compress(tensor: Any) -> tuple[Any, Any]:
            if tensor.dtype.is_floating and tensor.dtype != target:
                return tf.cast(tensor, target), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: Any, ctx: Any) -> Any:
            return tensor if ctx is None else tf.cast(tensor, ctx)

    return _Cast


FP16Compressor = _cast_compressor(tf.float16)
BF16Compressor = _cast_compressor(tf.bfloat16)


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compression:
    """Floating-point gradients sent as float16 (``fp16``) or bfloat16 (``bf16``); ``int8``,
    ``topk(ratio)`` and ``powersgd(rank)``: lossy with error feedback, running their own
    exchange (``horovod.frontend.lossy``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = _lossy.Int8()
    topk = staticmethod(_lossy.TopK)
    powersgd = staticmethod(_lossy.PowerSGD)
