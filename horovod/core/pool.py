"""Reuse of large output buffers for the NumPy API.

A fresh large NumPy array costs the kernel's page faults the first time it is written (zeroing
64 MiB takes about 3 ms here), which a collective that returns a new array pays on every call.
Outputs of 1 MiB and more are therefore views of buffers kept in this pool. A buffer is handed
out again only once no view of it is alive: every NumPy view keeps a reference to the buffer
that owns its memory, so the buffer's reference count tells. This is what PyTorch's caching
allocator does for tensors. The pool keeps at most ``capacity`` bytes; beyond that, outputs are
ordinary arrays. ``HOROVOD_OUTPUT_POOL_BYTES=0`` turns it off.

Must not touch: arrays a caller still holds (a buffer is reused only when nothing else refers to
it).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

MIN_BYTES = 1 << 20


def _refcounts_are_exact() -> bool:
    """Reference counts tell liveness on CPython with the GIL (not on free-threaded builds,
    where they may be deferred)."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return sys.implementation.name == "cpython" and gil


class OutputPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity if _refcounts_are_exact() else 0
        self._bufs: list[np.ndarray] = []  # uint8 owners, most recently used last
        self._lock = threading.Lock()
        self.reused = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > self.capacity:
            return np.empty(shape, dtype)
        with self._lock:
            bufs = self._bufs
            for i in range(len(bufs) - 1, -1, -1):
                # 2 = the list's reference and getrefcount's argument: no view is alive.
                if nbytes <= bufs[i].nbytes <= 2 * nbytes and sys.getrefcount(bufs[i]) == 2:
                    buf = bufs.pop(i)
                    bufs.append(buf)
                    self.reused += 1
                    return buf[:nbytes].view(dtype).reshape(shape)
            total = sum(b.nbytes for b in bufs)
            i = 0
            while total + nbytes > self.capacity and i < len(bufs):
                if sys.getrefcount(bufs[i]) == 2:  # evict free buffers, oldest first
                    total -= bufs.pop(i).nbytes
                else:
                    i += 1
            if total + nbytes > self.capacity:
                return np.empty(shape, dtype)
            buf = np.empty(nbytes, np.uint8)
            bufs.append(buf)
            return buf.view(dtype).reshape(shape)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)


POOL = OutputPool(256 << 20)  # capacity set from HOROVOD_OUTPUT_POOL_BYTES at hvd.init()
