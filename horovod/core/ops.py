"""Execution of one response on this rank: fusion-buffer copies, scaling, the collective
algorithm, copies out. All ranks of the process set run the same responses in the same order.

Entries missing on this rank belong to ranks that have joined: they contribute zeros to an
allreduce (and take part in a barrier); the coordinator refuses other collectives while ranks
are joined, so no other op reaches here without an entry.

Must not touch: the engine's tables or negotiation; a transport beyond the ``Transport``
contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from horovod.collectives import algorithms as alg
from horovod.collectives.adasum import adasum_allreduce
from horovod.common.dtypes import DTYPE_OF_CODE
from horovod.core.messages import (
    ADASUM_OP,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    AVERAGE,
    BARRIER,
    BROADCAST,
    MAX,
    MIN,
    PRODUCT,
    REDUCESCATTER,
    SUM,
    Response,
)

if TYPE_CHECKING:
    from horovod.core.handles import Entry

Trace = Callable[[str | None], None]
UFUNCS = {SUM: np.add, AVERAGE: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}


class Buffers:
    """The fusion buffer and the algorithms' scratch space, reused across cycles. The fusion
    buffer grows to the largest fused payload seen (never above the fusion threshold) and is
    otherwise never reallocated."""

    def __init__(self) -> None:
        self.fusion = alg.Scratch()
        self.scratch = alg.Scratch()
        self.fusion_allocations = 0

    def fusion_view(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        before = self.fusion.nbytes
        view = self.fusion.get(nbytes, dtype)
        if self.fusion.nbytes != before:
            self.fusion_allocations += 1
        return view


scale = alg.scale  # (the engine's data rounds scale with it too)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _present(entries: Sequence[Entry | None]) -> list[Entry]:
    """Entries of an op that joined ranks never take part in (the coordinator refuses it)."""
    assert all(e is not None for e in entries)
    return cast("list[Entry]", list(entries))


def _no_trace(activity: str | None) -> None:
    pass


# An op's name for ``takes`` of a plane's own collectives (the others always run there).
_NATIVE_NAMES = {
    ALLREDUCE: "allreduce",
    ALLGATHER: "allgather",
    BROADCAST: "broadcast",
    REDUCESCATTER: "reduce_scatter",
}


def execute(
    resp: Response,
    entries: Sequence[Entry | None],
    t,
    buffers: Buffers,
    trace: Trace = _no_trace,
) -> list[object]:
    """Run ``resp`` over transport view ``t``; return one result per entry (the output array,
    or for alltoall ``(output, received_splits)``). ``trace(name)`` marks the start of each
    activity (timeline spans such as ``MEMCPY_IN_FUSION_BUFFER``); ``trace(None)`` the end."""
    op = resp.op
    # The plane's own collectives (MPI) name the activities where they run the op (Adasum:
    # never, the project's tree runs over the transport's point-to-point).
    nat = alg.native(t)
    kind = getattr(t, "kind", "DIRECT")
    if nat is not None and resp.reduce_op != ADASUM_OP:
        name = _NATIVE_NAMES.get(op)
        if name is None or nat.takes(name, resp.nbytes(DTYPE_OF_CODE[resp.dtype].itemsize)):
            kind = nat.kind
    if op == ALLREDUCE:
        out = _allreduce(resp, entries, t, buffers, trace, kind)
    elif op == ALLGATHER:
        out = _allgather(resp, _present(entries), t, buffers, trace, kind)
    elif op == BROADCAST:
        trace(f"{kind}_BCAST")
        out = _broadcast(resp, _present(entries), t)
    elif op == ALLTOALL:
        trace(f"{kind}_ALLTOALL")
        out = _alltoall(resp, _present(entries), t)
    elif op == REDUCESCATTER:
        out = _reducescatter(resp, _present(entries), t, buffers, trace, kind)
    elif op == BARRIER:
        trace(f"{kind}_BARRIER")
        alg.barrier(t)
        out = [None] * len(entries)
    else:
        raise AssertionError(f"no executor for op {op}")
    trace(None)
    return out


def _allreduce(
    resp: Response, entries: Sequence[Entry | None], t, bufs: Buffers, trace: Trace, kind: str
) -> list:
    dtype = DTYPE_OF_CODE[resp.dtype]
    if resp.reduce_op == ADASUM_OP:
        return _adasum(resp, entries, t, bufs, trace, kind)
    post = alg.average_post(resp.postscale, t.size) if resp.reduce_op == AVERAGE else resp.postscale
    reducer = UFUNCS[resp.reduce_op]
    if len(entries) == 1:
        e = entries[0]
        src = None  # the input, where the algorithm reads it itself (not scaled first)
        if e is None:
            buf = bufs.fusion_view(math.prod(resp.shapes[0]) * dtype.itemsize, dtype)
            buf.fill(0)
        else:
            buf = _flat(e.output)
            if e.output is not e.array:
                if resp.prescale == 1.0:
                    src = _flat(e.array)
                else:
                    np.copyto(buf, _flat(e.array))
        if trace is not _no_trace:
            trace(f"{kind}_ALLREDUCE")
        if resp.prescale != 1.0:
            scale(buf, resp.prescale)
        alg.allreduce(t, buf, reducer, bufs.scratch, post, src)
        return [None if e is None else e.output]
    counts = [math.prod(s) for s in resp.shapes]
    total = sum(counts)
    trace("MEMCPY_IN_FUSION_BUFFER")
    buf = bufs.fusion_view(total * dtype.itemsize, dtype)
    _fuse_in(entries, counts, buf)
    trace(f"{kind}_ALLREDUCE")
    scale(buf, resp.prescale)
    alg.allreduce(t, buf, reducer, bufs.scratch, post)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    return _fuse_out(entries, counts, buf)


def _fuse_in(entries: Sequence[Entry | None], counts: Sequence[int], buf: np.ndarray) -> None:
    """The entries' arrays into the fusion buffer, in order (zeros for a joined rank's)."""
    if all(e is not None for e in entries):
        # One C loop for all the copies in (fused gradients: often hundreds of small ones).
        np.concatenate([e.array.reshape(-1) for e in entries], out=buf)  # type: ignore[union-attr]
        return
    off = 0
    for e, c in zip(entries, counts, strict=False):
        seg = buf[off : off + c]
        if e is None:
            seg.fill(0)
        else:
            np.copyto(seg, _flat(e.array))
        off += c


def _fuse_out(entries: Sequence[Entry | None], counts: Sequence[int], buf: np.ndarray) -> list:
    """The fusion buffer's segments into the entries' outputs; the outputs (None where the
    entry is a joined rank's)."""
    off = 0
    results: list = []
    copyto = np.copyto
    for e, c in zip(entries, counts, strict=False):
        end = off + c
        if e is not None:
            out = e.output
            copyto(out.reshape(-1), buf[off:end])
            results.append(out)
        else:
            results.append(None)
        off = end
    return results


def _adasum(
    resp: Response, entries: Sequence[Entry | None], t, bufs: Buffers, trace: Trace, kind: str
) -> list:
    """An Adasum allreduce (``collectives.adasum``): per tensor, also when fused; a joined
    rank's zeros leave the others' vectors as they are."""
    dtype = DTYPE_OF_CODE[resp.dtype]
    counts = [math.prod(s) for s in resp.shapes]
    trace("MEMCPY_IN_FUSION_BUFFER")
    buf = bufs.fusion_view(sum(counts) * dtype.itemsize, dtype)
    _fuse_in(entries, counts, buf)
    trace(f"{kind}_ADASUM")
    scale(buf, resp.prescale)
    adasum_allreduce(t, buf, counts, bufs.scratch)
    scale(buf, resp.postscale)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    return _fuse_out(entries, counts, buf)


def _allgather(
    resp: Response, entries: list[Entry], t, bufs: Buffers, trace: Trace, kind: str
) -> list:
    dtype = DTYPE_OF_CODE[resp.dtype]
    assert resp.dim0s is not None
    n, me = t.size, t.rank
    rows = [math.prod(s[1:]) for s in resp.shapes]  # elements per first-dim row
    outputs = []
    trace("ALLOCATE_OUTPUT")
    for e, s, d0 in zip(entries, resp.shapes, resp.dim0s, strict=True):
        outputs.append(e.alloc((sum(d0),) + tuple(s[1:]), dtype))
    if len(entries) == 1:
        e, out = entries[0], outputs[0]
        nbytes = [d * rows[0] * dtype.itemsize for d in resp.dim0s[0]]
        trace(f"{kind}_ALLGATHER")
        # (the own block is copied in during the exchange: between reads of the others')
        alg.allgatherv(t, _bytes(out), nbytes, _bytes(e.array))
        return outputs
    # Fused: rank-major blocks, each block tensor-major.
    per_rank = [
        sum(d0[r] * rows[i] for i, d0 in enumerate(resp.dim0s)) * dtype.itemsize for r in range(n)
    ]
    trace("MEMCPY_IN_FUSION_BUFFER")
    buf = bufs.fusion_view(sum(per_rank), np.dtype(np.uint8))
    block_start = [sum(per_rank[:r]) for r in range(n)]
    off = block_start[me]
    for e in entries:
        b = _bytes(e.array)
        buf[off : off + b.size] = b
        off += b.size
    trace(f"{kind}_ALLGATHER")
    alg.allgatherv(t, buf, per_rank)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    for r in range(n):
        off = block_start[r]
        for i, out in enumerate(outputs):
            nb = resp.dim0s[i][r] * rows[i] * dtype.itemsize
            dst_off = sum(resp.dim0s[i][:r]) * rows[i] * dtype.itemsize
            _bytes(out)[dst_off : dst_off + nb] = buf[off : off + nb]
            off += nb
    return outputs


def _broadcast(resp: Response, entries: list[Entry], t) -> list:
    e = entries[0]
    if e.output is not e.array:
        np.copyto(e.output, e.array)
    alg.broadcast(t, _flat(e.output), resp.root)
    return [e.output]


def _alltoall(resp: Response, entries: list[Entry], t) -> list:
    e = entries[0]
    dtype = DTYPE_OF_CODE[resp.dtype]
    shape = tuple(e.array.shape)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    splits = e.splits
    received = alg.exchange_counts(t, splits)
    out = e.alloc((sum(received),) + shape[1:], dtype)
    alg.alltoallv_flat(
        t,
        _bytes(e.array),
        [s * row_bytes for s in splits],
        _bytes(out),
        [r * row_bytes for r in received],
    )
    return [(out, np.asarray(received, dtype=np.int32))]


def _reducescatter(
    resp: Response, entries: list[Entry], t, bufs: Buffers, trace: Trace, kind: str
) -> list:
    dtype = DTYPE_OF_CODE[resp.dtype]
    n, me = t.size, t.rank
    post = alg.average_post(resp.postscale, n) if resp.reduce_op == AVERAGE else resp.postscale
    row_counts = [alg.split_even(s[0], n) for s in resp.shapes]
    rows = [math.prod(s[1:]) for s in resp.shapes]
    seg = [sum(rc[r] * rows[i] for i, rc in enumerate(row_counts)) for r in range(n)]
    trace("MEMCPY_IN_FUSION_BUFFER")
    buf = bufs.fusion_view(sum(seg) * dtype.itemsize, dtype)
    if len(entries) == 1:
        np.copyto(buf, _flat(entries[0].array))  # natural layout is already by destination
    else:
        off = 0
        for r in range(n):
            for i, e in enumerate(entries):
                start = sum(row_counts[i][:r]) * rows[i]
                cnt = row_counts[i][r] * rows[i]
                np.copyto(buf[off : off + cnt], _flat(e.array)[start : start + cnt])
                off += cnt
    trace(f"{kind}_REDUCESCATTER")
    scale(buf, resp.prescale)
    mine = alg.reduce_scatter(t, buf, seg, UFUNCS[resp.reduce_op], bufs.scratch, post)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    results = []
    off = 0
    for i, (e, s) in enumerate(zip(entries, resp.shapes, strict=False)):
        out = e.alloc((row_counts[i][me],) + tuple(s[1:]), dtype)
        cnt = row_counts[i][me] * rows[i]
        np.copyto(_flat(out), mine[off : off + cnt])
        off += cnt
        results.append(out)
    return results
