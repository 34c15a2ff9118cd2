"""The output pool of the NumPy API: large outputs reuse memory only once nothing refers to it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from horovod.core.pool import MIN_BYTES, OutputPool, _refcounts_are_exact
from horovod.testing import run_ranks

pytestmark = pytest.mark.skipif(
    not _refcounts_are_exact(), reason="needs CPython reference counts (GIL build)"
)

MB = 1 << 20


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_is_reused_only_after_every_view_is_gone():
    p = OutputPool(64 * MB)
    a = p.empty((MB // 4,), np.float32)
    a[:] = 1
    first = addr(a)
    b = p.empty((MB // 4,), np.float32)  # a is alive: fresh memory
    assert addr(b) != first
    row = a[10:20]  # a view of a keeps the buffer busy even after a is dropped
    del a
    c = p.empty((MB // 4,), np.float32)
    assert addr(c) not in (first, addr(b))
    assert (row == 1).all()
    del row, c
    d = p.empty((MB // 8, 2), np.float32)  # same bytes, other shape: reuses a's buffer
    assert addr(d) in (first,) or p.reused >= 1
    assert d.shape == (MB // 8, 2) and d.dtype == np.float32


def test_small_outputs_and_a_disabled_pool_are_plain_arrays():
    p = OutputPool(64 * MB)
    small = p.empty((10,), np.float64)
    assert small.base is None and p.held_bytes() == 0
    off = OutputPool(0)
    big = off.empty((MIN_BYTES,), np.uint8)
    assert big.base is None and off.held_bytes() == 0


def test_capacity_is_respected_and_free_buffers_are_evicted_first():
    p = OutputPool(3 * MB)
    a = p.empty((MB,), np.uint8)
    b = p.empty((MB,), np.uint8)
    c = p.empty((MB,), np.uint8)
    d = p.empty((MB,), np.uint8)  # pool full of live buffers: a plain array
    assert d.base is None and p.held_bytes() == 3 * MB
    del a
    e = p.empty((2 * MB,), np.uint8)  # needs room: a's free buffer is evicted, no live one
    assert p.held_bytes() <= 3 * MB
    assert all(x.base is not None for x in (b, c)) and e.nbytes == 2 * MB


def test_concurrent_allocations_never_share_memory():
    p = OutputPool(256 * MB)
    got: list = []
    lock = threading.Lock()

    def grab():
        for _ in range(50):
            x = p.empty((MB,), np.uint8)
            with lock:
                got.append(x)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = {addr(x) for x in got}
    assert len(live) == len(got)  # every array still held has its own memory


def test_repeated_large_allgathers_keep_earlier_results_intact():
    import horovod.numpy as hvd

    def body(r):
        kept = []
        for i in range(4):
            out = hvd.allgather(np.full((MB // 8 + r, 2), r * 10 + i, np.float32), name="g")
            kept.append(out)
            y = hvd.allreduce(np.full(MB // 4, float(i)), name="a", op=hvd.Sum)
            assert (y == 2 * i).all()
        for i, out in enumerate(kept):  # nothing later overwrote a result we still hold
            assert (out[: MB // 8] == i).all() and (out[MB // 8 :] == 10 + i).all()
        return True

    assert run_ranks(body, 2) == [True, True]


def _mapping_of(addr_: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``addr_``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not line[0].isupper():
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                if inside:
                    break
                inside = lo <= addr_ < hi
            elif inside and ":" in head[0]:
                fields[head[0].rstrip(":")] = " ".join(head[1:])
    return fields


@pytest.mark.skipif(
    not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux's /proc"
)
def test_pooled_buffers_are_aligned_and_advised_for_huge_pages():
    """Cross-memory reads and copies walk one page-table entry per 2 MiB on them (a 16 MiB
    allgather over MPI took half the time: docs/mpi.md)."""
    p = OutputPool(64 * MB)
    a = p.empty((4 * MB,), np.uint8)
    a[:] = 1
    assert addr(a) % (2 * MB) == 0
    flags = _mapping_of(addr(a)).get("VmFlags", "")
    assert "hg" in flags.split()  # MADV_HUGEPAGE (whether the kernel had 2 MiB pages free varies)
    b = p.empty((3 * MB,), np.float32)
    assert addr(b) % (2 * MB) == 0
