"""Upstream's compression interface for what travels (``Compression.none``, ``fp16``, and
``bf16``) on NumPy arrays, and the lossy compressors of ``horovod.frontend.lossy``; frameworks
wrap it for their tensors.

Must not touch: anything but the array it is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod.frontend.lossy import Int8, PowerSGD, TopK


class Compressor:
    """Upstream's interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def _cast_compressor(target: np.dtype) -> type[Compressor]:
    class _Cast(Compressor):
        @staticmethod
        def compress(tensor: Any) -> tuple[Any, Any]:
            arr = np.asarray(tensor)
            if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
                return arr.astype(target), arr.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: Any, ctx: Any) -> Any:
            return tensor if ctx is None else np.asarray(tensor).astype(ctx)

    return _Cast


class Compression:
    """Gradient compression for transport: ``none``, ``fp16`` (upstream) and ``bf16`` (cast
    around the allreduce); ``int8``, ``topk(ratio)`` and ``powersgd(rank)``, lossy with error
    feedback, which run their own exchange (``horovod.frontend.lossy``)."""

    none = NoneCompressor
    int8 = Int8()  # call it for other settings: Compression.int8(bucket=1024)
    topk = staticmethod(TopK)
    powersgd = staticmethod(PowerSGD)
    fp16 = _cast_compressor(np.dtype(np.float16))
    try:
        import ml_dtypes as _mld

        bf16 = _cast_compressor(np.dtype(_mld.bfloat16))
        del _mld
    except ImportError:  # pragma: no cover
        pass
