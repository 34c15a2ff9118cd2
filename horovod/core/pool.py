"""Reuse of large output buffers for the NumPy API.

A fresh large NumPy array costs the kernel's page faults the first time it is written (zeroing
64 MiB takes about 3 ms here), which a collective that returns a new array pays on every call.
Outputs of 1 MiB and more are therefore views of buffers kept in this pool. A buffer is handed
out again only once no view of it is alive: every NumPy view keeps a reference to the buffer
that owns its memory, so the buffer's reference count tells. This is what PyTorch's caching
allocator does for tensors. The pool keeps at most ``capacity`` bytes; beyond that, outputs are
ordinary arrays. ``HOROVOD_OUTPUT_POOL_BYTES=0`` turns it off.

The pool's buffers are anonymous mappings aligned to 2 MiB and advised for transparent huge
pages (``MADV_HUGEPAGE``; the machine's THP setting is usually ``madvise``, under which plain
NumPy arrays get 4 KiB pages). Copies into and out of them, and the peers' cross-memory reads
(Open MPI's single-copy path, the shared-memory plane's), then walk one page-table entry per 2
MiB instead of one per 4 KiB: a 16 MiB allgather over MPI takes half the time (docs/mpi.md).

Must not touch: arrays a caller still holds (a buffer is reused only when nothing else refers to
it).
"""

from __future__ import annotations

import math
import mmap
import sys
import threading

import numpy as np

MIN_BYTES = 1 << 20
HUGE_PAGE = 2 << 20


def huge_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """``(owner, offset)``: a uint8 array over a fresh anonymous mapping and the offset in it of
    ``nbytes`` that start on a 2 MiB boundary and are advised for huge pages (where the system
    has them; the slack before the offset is never touched, so it costs no memory)."""
    size = nbytes + HUGE_PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    owner = np.frombuffer(mapping, np.uint8)
    offset = (-owner.ctypes.data) % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        span = min(size - offset, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        try:
            mapping.madvise(advice, offset, span)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages
            pass
    return owner, offset


def _refcounts_are_exact() -> bool:
    """Reference counts tell liveness on CPython with the GIL (not on free-threaded builds,
    where they may be deferred)."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return sys.implementation.name == "cpython" and gil


class _Buffer:
    """A pooled buffer: its owner array (every view of the usable bytes refers to it, so its
    reference count tells whether any is alive), where the usable bytes start, how many."""

    __slots__ = ("owner", "offset", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.owner, self.offset = huge_buffer(nbytes)
        self.nbytes = nbytes

    def free(self) -> bool:
        # 2 = this object's reference and getrefcount's argument: no view is alive.
        return sys.getrefcount(self.owner) == 2

    def view(self, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        start = self.offset
        return self.owner[start : start + nbytes].view(dtype).reshape(shape)


class OutputPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity if _refcounts_are_exact() else 0
        self._bufs: list[_Buffer] = []  # most recently used last
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
                b = bufs[i]
                if nbytes <= b.nbytes <= 2 * nbytes and b.free():
                    bufs.append(bufs.pop(i))
                    self.reused += 1
                    return b.view(nbytes, shape, dtype)
            total = sum(b.nbytes for b in bufs)
            i = 0
            while total + nbytes > self.capacity and i < len(bufs):
                if bufs[i].free():  # evict free buffers, oldest first
                    total -= bufs.pop(i).nbytes
                else:
                    i += 1
            if total + nbytes > self.capacity:
                return np.empty(shape, dtype)
            buf = _Buffer(nbytes)
            bufs.append(buf)
            return buf.view(nbytes, shape, dtype)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)


POOL = OutputPool(256 << 20)  # capacity set from HOROVOD_OUTPUT_POOL_BYTES at hvd.init()
