"""The collectives on device tensors through a torch process group (NCCL; Gloo in the
stand-in), with the device-side fusion buffer and upstream's numerics.

Every function runs on the plane's stream (the caller set it) and returns one result per
entry as ``ops.execute`` does: the output ``DeviceArray`` (for alltoall, with the received
splits). Scaling follows ``collectives.algorithms.scale``: floats in their own type (float16
and bfloat16 through float32), integers in float64 truncated toward zero, an Average's
division correctly rounded (integers truncated), so a device result has the bits of the CPU
planes' result. bool travels as uint8 (or: max, and: min).

Must not touch: streams and events (``plane``), the engine, CPU transports beyond the
counts exchange of an alltoall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod.collectives import algorithms as alg
from horovod.common.dtypes import DTYPE_OF_CODE
from horovod.core.messages import AVERAGE, MAX, MIN, PRODUCT, SUM, Response
from horovod.device.arrays import TORCH_OF, DeviceArray, byte_view

REDUCE_OPS: dict[int, Any] = {
    SUM: dist.ReduceOp.SUM,
    AVERAGE: dist.ReduceOp.SUM,
    MIN: dist.ReduceOp.MIN,
    MAX: dist.ReduceOp.MAX,
    PRODUCT: dist.ReduceOp.PRODUCT,
}
# bool as uint8: or for Sum/Max, and for Min/Product.
BOOL_OPS: dict[int, Any] = {SUM: dist.ReduceOp.MAX, MAX: dist.ReduceOp.MAX, MIN: dist.ReduceOp.MIN}
BOOL_OPS[PRODUCT] = dist.ReduceOp.MIN


class Fusion:
    """A device buffer reused across ops, grown to the largest fused payload seen."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)
        self.allocations = 0

    def get(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(
                max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8, device=self.device
            )
            self.allocations += 1
        return self.buf[:nbytes].view(dtype)


def scale(buf: torch.Tensor, factor: alg.Post) -> None:
    """``algorithms.scale`` on a device tensor."""
    if isinstance(factor, alg.Finish):
        scale(buf, factor.factor)
        _divide(buf, factor.divisor)
        return
    if factor == 1.0 or buf.numel() == 0:
        return
    if buf.dtype.is_floating_point:
        buf.mul_(factor)  # float16/bfloat16 compute in float32, as NumPy's path does
    elif buf.dtype != torch.bool:
        buf.copy_(torch.trunc(buf.to(torch.float64) * factor))


def _divide(buf: torch.Tensor, n: int) -> None:
    if n == 1 or buf.numel() == 0:
        return
    if buf.dtype.is_floating_point:
        buf.div_(n)
    else:
        buf.copy_(torch.div(buf, n, rounding_mode="trunc"))


def _reduce_options(op: int, dtype: torch.dtype) -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = (BOOL_OPS if dtype == torch.bool else REDUCE_OPS)[op]
    return o


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _flat(a: DeviceArray) -> torch.Tensor:
    return a.tensor.reshape(-1)


def fuse_in(resp: Response, entries: Sequence[Any], fusion: Fusion) -> torch.Tensor:
    """The entries' tensors as one flat device tensor: a lone entry's output itself (its
    input copied in unless in place), else the fusion buffer (zeros for a joined rank's)."""
    dtype = TORCH_OF[DTYPE_OF_CODE[resp.dtype]]
    e0 = entries[0]
    if len(entries) == 1 and e0 is not None:
        buf = _flat(e0.output)
        if e0.output is not e0.array:
            buf.copy_(_flat(e0.array))
        return buf
    counts = [math.prod(s) for s in resp.shapes]
    buf = fusion.get(sum(counts) * DTYPE_OF_CODE[resp.dtype].itemsize, dtype)
    off = 0
    for e, c in zip(entries, counts, strict=True):
        if e is None:
            buf[off : off + c].zero_()
        else:
            buf[off : off + c].copy_(_flat(e.array))
        off += c
    return buf


def fuse_out(resp: Response, entries: Sequence[Any], buf: torch.Tensor) -> list:
    """``fuse_in`` undone: the outputs (None for a joined rank's entry)."""
    e0 = entries[0]
    if len(entries) == 1 and e0 is not None:
        return [e0.output]
    out: list = []
    off = 0
    for e, s in zip(entries, resp.shapes, strict=True):
        c = math.prod(s)
        if e is None:
            out.append(None)
        else:
            _flat(e.output).copy_(buf[off : off + c])
            out.append(e.output)
        off += c
    return out


def reduce_in_place(buf: torch.Tensor, reduce_op: int, pg: Any) -> None:
    if pg.size() > 1:
        pg.allreduce([_wire(buf)], _reduce_options(reduce_op, buf.dtype)).wait()


def allreduce(resp: Response, entries: Sequence[Any], pg: Any, fusion: Fusion) -> list:
    """Fused (or single, in place) allreduce; a joined rank's entry (None) contributes
    zeros."""
    return allreduce_by(resp, entries, pg.size(), fusion, lambda b, op: reduce_in_place(b, op, pg))


def allreduce_by(
    resp: Response,
    entries: Sequence[Any],
    n: int,
    fusion: Fusion,
    reduce: Callable[[torch.Tensor, int], None],
) -> list:
    """``allreduce`` with ``reduce(flat, reduce_op)`` (in place, over ``n`` ranks) doing the
    reduction itself: the fusion and upstream's scaling are the same on every path."""
    post = alg.average_post(resp.postscale, n) if resp.reduce_op == AVERAGE else resp.postscale
    buf = fuse_in(resp, entries, fusion)
    scale(buf, resp.prescale)
    reduce(buf, resp.reduce_op)
    scale(buf, post)
    return fuse_out(resp, entries, buf)


def allgather(
    resp: Response,
    entries: Sequence[Any],
    pg: Any,
    fusion: Fusion,
    device: torch.device,
    me: int,
) -> list:
    """Rank-major blocks of every entry's rows, padded to the largest rank's block so that
    the process group's equal-size allgather carries them; copied out per entry."""
    np_dtype = DTYPE_OF_CODE[resp.dtype]
    dtype = TORCH_OF[np_dtype]
    assert resp.dim0s is not None
    n = pg.size()
    rows = [math.prod(s[1:]) * np_dtype.itemsize for s in resp.shapes]  # bytes per row
    outs = [
        torch.empty((sum(d0),) + tuple(s[1:]), dtype=dtype, device=device)
        for s, d0 in zip(resp.shapes, resp.dim0s, strict=True)
    ]
    per_rank = [sum(d0[r] * rows[i] for i, d0 in enumerate(resp.dim0s)) for r in range(n)]
    width = max(per_rank)
    if len(entries) == 1 and len(set(per_rank)) == 1:  # one tensor, equal rows: no padding
        if n == 1:
            outs[0].copy_(entries[0].array.tensor)
        else:
            pg._allgather_base(byte_view(outs[0]), byte_view(entries[0].array.tensor)).wait()
        return [DeviceArray(o) for o in outs]
    buf = fusion.get(width * (n + 1), torch.uint8)
    mine, gathered = buf[:width], buf[width:]
    off = 0
    for e in entries:
        b = byte_view(e.array.tensor)
        mine[off : off + b.numel()].copy_(b)
        off += b.numel()
    if n == 1:
        gathered.copy_(mine)
    else:
        pg._allgather_base(gathered, mine).wait()
    out_bytes = [byte_view(o) for o in outs]
    for r in range(n):
        src = r * width
        for i, o in enumerate(out_bytes):
            nb = resp.dim0s[i][r] * rows[i]
            dst = sum(resp.dim0s[i][:r]) * rows[i]
            o[dst : dst + nb].copy_(gathered[src : src + nb])
            src += nb
    return [DeviceArray(o) for o in outs]


def broadcast(resp: Response, e: Any, pg: Any) -> list:
    return broadcast_by(resp, e, lambda t, root: broadcast_flat(t, root, pg))


def broadcast_by(resp: Response, e: Any, bcast: Callable[[torch.Tensor, int], None]) -> list:
    """The root's tensor into every rank's output, ``bcast(tensor, root)`` moving it."""
    if e.output is not e.array:
        e.output.tensor.copy_(e.array.tensor)
    bcast(e.output.tensor, resp.root)
    return [e.output]


def broadcast_flat(t: torch.Tensor, root: int, pg: Any) -> None:
    if pg.size() > 1:
        o = dist.BroadcastOptions()
        o.rootRank = root
        pg.broadcast([byte_view(t)], o).wait()


def alltoall(resp: Response, e: Any, pg: Any, view: Any, device: torch.device) -> list:
    """Rows by ``e.splits``; the received counts are exchanged on the CPU plane first (the
    engine's own negotiation does not carry them)."""
    np_dtype = DTYPE_OF_CODE[resp.dtype]
    shape = e.array.shape
    row = math.prod(shape[1:]) * np_dtype.itemsize
    received = alg.exchange_counts(view, e.splits)
    out = torch.empty((sum(received),) + tuple(shape[1:]), dtype=TORCH_OF[np_dtype], device=device)
    if pg.size() == 1:
        out.copy_(e.array.tensor)
    else:
        pg.alltoall_base(
            byte_view(out),
            byte_view(e.array.tensor),
            [r * row for r in received],
            [s * row for s in e.splits],
            dist.AllToAllOptions(),
        ).wait()
    return [(DeviceArray(out), np.asarray(received, dtype=np.int32))]


def reducescatter(
    resp: Response,
    entries: Sequence[Any],
    pg: Any,
    fusion: Fusion,
    device: torch.device,
    me: int,
) -> list:
    """Each rank's segment (rows split as evenly as the CPU planes split them), padded to the
    largest segment for the process group's equal-size reduce-scatter."""
    np_dtype = DTYPE_OF_CODE[resp.dtype]
    dtype = TORCH_OF[np_dtype]
    n = pg.size()
    post = alg.average_post(resp.postscale, n) if resp.reduce_op == AVERAGE else resp.postscale
    row_counts = [alg.split_even(s[0], n) for s in resp.shapes]
    rows = [math.prod(s[1:]) for s in resp.shapes]
    seg = [sum(rc[r] * rows[i] for i, rc in enumerate(row_counts)) for r in range(n)]
    width = max(seg)
    item = np_dtype.itemsize
    buf = fusion.get(width * (n + 1) * item, dtype)
    padded, mine = buf[: width * n], buf[width * n :]
    for r in range(n):
        off = r * width
        for i, e in enumerate(entries):
            start = sum(row_counts[i][:r]) * rows[i]
            cnt = row_counts[i][r] * rows[i]
            padded[off : off + cnt].copy_(_flat(e.array)[start : start + cnt])
            off += cnt
        padded[off : (r + 1) * width].zero_()
    scale(padded, resp.prescale)
    if n == 1:
        mine.copy_(padded)
    else:
        o = dist.ReduceScatterOptions()
        o.reduceOp = (BOOL_OPS if dtype == torch.bool else REDUCE_OPS)[resp.reduce_op]
        pg._reduce_scatter_base(_wire(mine), _wire(padded), o).wait()
    scale(mine, post)
    results = []
    off = 0
    for i, s in enumerate(resp.shapes):
        cnt = row_counts[i][me] * rows[i]
        out = torch.empty((row_counts[i][me],) + tuple(s[1:]), dtype=dtype, device=device)
        out.reshape(-1).copy_(mine[off : off + cnt])
        off += cnt
        results.append(DeviceArray(out))
    return results
