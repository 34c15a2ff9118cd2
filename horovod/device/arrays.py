"""``DeviceArray``: a device tensor as the engine carries it, and the dtype tables between
torch and NumPy.

The engine negotiates ops by shape and NumPy dtype and never reads a device tensor's data; a
``DeviceArray`` gives it those (``shape``, ``dtype``, ``nbytes``) and carries the tensor, the
event that says it is written (``ready``) and, once the plane has run the op, the event that
says the result is (``done``).

Must not touch: collectives, streams beyond holding their events, the engine.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from horovod.common.dtypes import BFLOAT16

NUMPY_OF: dict[torch.dtype, Any] = {
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.bool: np.dtype(np.bool_),
}
if BFLOAT16 is not None:
    NUMPY_OF[torch.bfloat16] = np.dtype(BFLOAT16)
TORCH_OF = {v: k for k, v in NUMPY_OF.items()}


class DeviceArray:
    """A device tensor handed to the engine (see the module docstring)."""

    __slots__ = ("tensor", "shape", "dtype", "ready", "done")

    def __init__(self, tensor: torch.Tensor, ready: Any = None) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = NUMPY_OF[tensor.dtype]
        self.ready = ready
        self.done: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype.name}{list(self.shape)} on {self.tensor.device})"


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def host_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (bfloat16 through an int16 view)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[arg-type]
    return t.numpy()
