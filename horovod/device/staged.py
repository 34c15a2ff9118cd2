"""The staged path: device tensors through pinned host memory and the CPU data planes, for
where NCCL cannot run (several ranks on one GPU, no NCCL library) or is not wanted.

Allreduce is pipelined per chunk: the entries are fused on the device, the fused buffer goes
to pinned host memory chunk by chunk (asynchronously, on the plane's stream, an event after
each chunk), and while later chunks are still crossing, the host reduces the first on the CPU
plane and sends it back (asynchronously too). Other collectives copy their inputs down, run
``core.ops.execute`` on host arrays and copy the results up.

The pinned buffers are reused: before the host writes into them again it waits for the last
staged op's done event (the copies up that read them).

Must not touch: the CPU algorithms beyond ``core.ops.execute`` and ``algorithms.allreduce``,
the engine, process groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.collectives import algorithms as alg
from horovod.core import ops as cpu_ops
from horovod.core.messages import ALLGATHER, ALLREDUCE, ALLTOALL, AVERAGE, REDUCESCATTER, Response
from horovod.device.arrays import NUMPY_OF, TORCH_OF, DeviceArray, byte_view, host_numpy
from horovod.device.collectives import Fusion, fuse_in, fuse_out

CHUNK_BYTES = 8 * 1024 * 1024  # pipeline unit of the staged allreduce


class HostStage:
    """Pinned host memory of one process set's staged path, grown as needed and reused."""

    def __init__(self, streams: Any) -> None:
        self.streams = streams
        self.buf = streams.pinned(0)
        self.used = 0
        self.last_done: Any = None  # the previous staged op's done event

    def begin(self) -> None:
        """Before the host writes into the buffers again: the previous op's copies up,
        which read them, are done."""
        if self.last_done is not None:
            self.streams.host_wait(self.last_done)
            self.last_done = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned memory, 64-byte aligned, valid until the next ``begin``."""
        start = -(-self.used // 64) * 64
        end = start + nbytes
        if end > self.buf.numel():
            # Earlier takes of this op keep their (old) buffer alive through their views.
            self.buf = self.streams.pinned(max(end, 2 * self.buf.numel(), 1 << 20))
            start, end = 0, nbytes
        self.used = end
        return self.buf[start:end]

    def like(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        return self.take(n).view(TORCH_OF[dtype]).reshape(shape)


class _HostEntry:
    """What ``core.ops.execute`` reads of an entry, with host arrays."""

    __slots__ = ("array", "output", "splits", "alloc")

    def __init__(self, array: np.ndarray, output: np.ndarray, splits: list[int], alloc) -> None:
        self.array, self.output, self.splits, self.alloc = array, output, splits, alloc


Trace = Callable[[str | None], None]


def execute(
    resp: Response,
    entries: Sequence[Any],
    view: Any,
    stage: HostStage,
    fusion: Fusion,
    buffers: cpu_ops.Buffers,
    trace: Trace,
    device: torch.device,
) -> list:
    stage.begin()
    if resp.op == ALLREDUCE and resp.reduce_op in cpu_ops.UFUNCS:
        return _allreduce(resp, entries, view, stage, fusion, buffers, trace)
    return _generic(resp, entries, view, stage, buffers, trace, device)


def _allreduce(
    resp: Response,
    entries: Sequence[Any],
    view: Any,
    stage: HostStage,
    fusion: Fusion,
    buffers: cpu_ops.Buffers,
    trace: Trace,
) -> list:
    trace("MEMCPY_IN_FUSION_BUFFER")
    dev = fuse_in(resp, entries, fusion)
    post = (
        alg.average_post(resp.postscale, view.size) if resp.reduce_op == AVERAGE else resp.postscale
    )
    allreduce_flat(dev, view, stage, buffers, trace, resp.reduce_op, resp.prescale, post)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    return fuse_out(resp, entries, dev)


def allreduce_flat(
    dev: torch.Tensor,
    view: Any,
    stage: HostStage,
    buffers: cpu_ops.Buffers,
    trace: Trace,
    reduce_op: int,
    prescale: float,
    post: alg.Post,
) -> None:
    """In-place allreduce of the flat device tensor ``dev`` on the CPU plane of ``view``,
    chunk by chunk through pinned memory (see the module docstring)."""
    np_dtype = NUMPY_OF[dev.dtype]
    total = dev.numel()
    host_t = stage.take(total * np_dtype.itemsize).view(dev.dtype)
    host = host_numpy(host_t)
    step = max(1, CHUNK_BYTES // np_dtype.itemsize)
    chunks = [(s, min(s + step, total)) for s in range(0, total, step)] or [(0, 0)]
    streams = stage.streams
    trace("MEMCPY_DEVICE_TO_HOST")
    arrived = []
    for s, e in chunks:
        host_t[s:e].copy_(dev[s:e], non_blocking=True)
        arrived.append(streams.record())
    reducer = cpu_ops.UFUNCS[reduce_op]
    kind = getattr(alg.native(view), "kind", None) or getattr(view, "kind", "DIRECT")
    for (s, e), ev in zip(chunks, arrived, strict=True):
        streams.host_wait(ev)
        trace(f"STAGED_{kind}_ALLREDUCE")
        part = host[s:e]
        alg.scale(part, prescale)
        alg.allreduce(view, part, reducer, buffers.scratch, post)
        trace("MEMCPY_HOST_TO_DEVICE")
        dev[s:e].copy_(host_t[s:e], non_blocking=True)


def _generic(
    resp: Response,
    entries: Sequence[Any],
    view: Any,
    stage: HostStage,
    buffers: cpu_ops.Buffers,
    trace: Trace,
    device: torch.device,
) -> list:
    """Inputs down, the CPU planes' op on host arrays, results up."""
    streams = stage.streams
    trace("MEMCPY_DEVICE_TO_HOST")
    hosts: list[Any] = []
    for e in entries:
        if e is None:
            hosts.append(None)
            continue
        h = stage.like(e.array.shape, e.array.dtype)
        h.copy_(e.array.tensor, non_blocking=True)
        if e.output is e.array or e.output is None:
            o = h
        else:
            o = stage.like(e.output.shape, e.output.dtype)
        hosts.append((h, o))
    streams.host_wait(streams.record())

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return host_numpy(stage.like(shape, dtype))

    proxies = [
        None if h is None else _HostEntry(host_numpy(h[0]), host_numpy(h[1]), e.splits, alloc)
        for e, h in zip(entries, hosts, strict=True)
    ]

    def staged_trace(activity: str | None) -> None:
        trace(None if activity is None else "STAGED_" + activity)

    results: list[Any] = cpu_ops.execute(resp, proxies, view, buffers, staged_trace)  # type: ignore[arg-type]
    trace("MEMCPY_HOST_TO_DEVICE")
    out: list = []
    for e, r in zip(entries, results, strict=True):
        if e is None or r is None:
            out.append(None)
            continue
        splits = None
        if resp.op == ALLTOALL:
            r, splits = r
        if resp.op in (ALLGATHER, ALLTOALL, REDUCESCATTER):
            dst = torch.empty(r.shape, dtype=TORCH_OF[r.dtype], device=device)
            res: Any = DeviceArray(dst)
        else:  # broadcast, and Adasum's allreduce: into the entry's output
            dst, res = e.output.tensor, e.output
        src = torch.from_numpy(np.ascontiguousarray(r).reshape(-1).view(np.uint8))
        byte_view(dst).copy_(src, non_blocking=True)
        out.append((res, splits) if resp.op == ALLTOALL else res)
    return out
