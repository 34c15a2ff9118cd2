"""The shared-GPU path: allreduce, broadcast and allgather among ranks that share one GPU,
through each other's device memory, where NCCL refuses them (it wants a GPU per rank).

Each rank of such a set exposes a *window*, a device buffer of ``WINDOW_BYTES``, to the set's
other ranks: with CUDA IPC (``torch.multiprocessing``'s handles for the buffer, and an
interprocess event per rank that says how far the rank's own stream got). The handles travel
once over the set's CPU view. An op then runs in steps on the plane's stream, with a CPU
barrier over the view between them; before a step reads a peer's window, the stream waits
for the peers' events, which they recorded before that barrier:

- allreduce (chunks of the window's size): every rank copies its chunk into its window; each
  reduces its own slice of the chunk from every window, in rank order (so every rank gets the
  same bits), into its window; every rank copies every slice back out;
- broadcast: the root's data into its window, the others copy it out;
- allgather: every rank's rows into its window, every rank copies every block out.

A last barrier after each op lets the next one overwrite the windows safely. The bytes never
leave the GPU: a 64 MiB allreduce is a few device copies and three CPU barriers, where the
staged path would copy it to the host and back and reduce it on the CPU.

The stand-in (``HOROVOD_DEVICE_PLANE_TEST=shared``, no GPU) runs the same steps on CPU
tensors, its windows in host shared memory; CPU tensor ops are synchronous, so its events
are no-ops and the barriers alone order the steps.

Must not touch: the engine, process groups, the CPU planes beyond the set's view (barriers,
the handle exchange).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import pickle
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from horovod.collectives import algorithms as alg
from horovod.common.dtypes import DTYPE_OF_CODE
from horovod.core.messages import AVERAGE, MAX, MIN, PRODUCT, SUM, Response
from horovod.device.arrays import TORCH_OF, DeviceArray, byte_view
from horovod.device.collectives import allreduce_by, broadcast_by

WINDOW_BYTES = 64 * 1024 * 1024
CLOSE_WAIT_S = 5.0  # at shutdown, the longest a rank waits for its peers to let go

REDUCERS: dict[int, Any] = {
    SUM: torch.add,
    AVERAGE: torch.add,
    MIN: torch.minimum,
    MAX: torch.maximum,
    PRODUCT: torch.mul,
}
# bool as uint8: or for Sum/Max, and for Min/Product (as the device path's NCCL ops)
BOOL_REDUCERS: dict[int, Any] = {
    SUM: torch.maximum,
    MAX: torch.maximum,
    MIN: torch.minimum,
    PRODUCT: torch.minimum,
}


class CudaWindow:
    """This rank's window and interprocess event, shared with CUDA IPC."""

    def __init__(self, device: torch.device, stream: Any, nbytes: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.stream = stream
        self.device = device
        with torch.cuda.device(device):
            self.mine = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.event = torch.cuda.Event(interprocess=True)
            self.event.record(stream)
        self._reduce = reduce_tensor
        self._event_handle = bytes(self.event.ipc_handle())
        self.peer_events: list[Any] = []

    def export(self) -> bytes:
        """A handle for one peer. Each peer gets one of its own: torch counts the handles it
        gave out, and each one opened is let go of once (one handle opened by two peers
        would be let go of twice, and the window would never be free)."""
        _, args = self._reduce(self.mine)
        return pickle.dumps((args, self._event_handle))

    def open(self, blob: bytes) -> torch.Tensor:
        """A peer's window (its event kept for ``wait_peers``)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args, handle = pickle.loads(blob)
        self.peer_events.append(torch.cuda.Event.from_ipc_handle(self.device, handle))
        return rebuild_cuda_tensor(*args)

    def signal(self) -> None:
        """Peers may read what this rank's stream has written so far (after the barrier)."""
        self.event.record(self.stream)

    def wait_peers(self) -> None:
        for ev in self.peer_events:
            self.stream.wait_event(ev)

    def release(self) -> None:
        """Before the peers' windows are closed: the plane's work on them is done."""
        self.stream.synchronize()
        self.peer_events.clear()

    def close(self) -> None:
        """This rank's window goes, once no peer holds it (``SharedGpu.close``)."""
        self.mine = torch.empty(0, dtype=torch.uint8, device=self.device)
        with contextlib.suppress(Exception):
            torch.cuda.ipc_collect()


class HostWindow:
    """The stand-in's window: a host shared-memory file, mapped by every rank of the set."""

    def __init__(self, nbytes: int) -> None:
        self.path = f"/dev/shm/hvd-window-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._maps = [mmap.mmap(fd, nbytes)]
        finally:
            os.close(fd)
        self.mine = torch.frombuffer(self._maps[0], dtype=torch.uint8)

    def export(self) -> bytes:
        return self.path.encode()

    def open(self, blob: bytes) -> torch.Tensor:
        path = blob.decode()
        fd = os.open(path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._maps.append(m)
        return torch.frombuffer(m, dtype=torch.uint8)

    def opened(self) -> None:
        """Every peer mapped the file: its name can go."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def signal(self) -> None:
        pass  # CPU tensor ops are done when they return

    def wait_peers(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        self.opened()


class SharedGpu:
    """The windows of one process set's ranks and the collectives over them (see the module
    docstring). Made collectively: every rank of ``view`` at once. (The handles are pickled:
    they come from the job's own ranks, over its authenticated connections.)"""

    def __init__(self, view: Any, window: Any) -> None:
        self.view = view
        self.window = window
        me = view.rank
        sent = [b"" if r == me else window.export() for r in range(view.size)]
        lists = [pickle.loads(b) for b in _allgather_bytes(view, pickle.dumps(sent))]
        self.windows = [
            window.mine if r == me else window.open(theirs[me]) for r, theirs in enumerate(lists)
        ]
        alg.barrier(view)  # every rank has opened every window
        if isinstance(window, HostWindow):
            window.opened()

    def _step(self) -> None:
        """End of a step: this rank's writes are visible to its peers once the others are
        here too, and its stream waits for theirs."""
        self.window.signal()
        alg.barrier(self.view)
        self.window.wait_peers()

    # --- allreduce ---------------------------------------------------------------------
    def allreduce(self, flat: torch.Tensor, reduce_op: int) -> None:
        """``flat`` (contiguous, 1-D) reduced over the set's ranks, in place."""
        is_bool = flat.dtype == torch.bool
        data = flat.view(torch.uint8) if is_bool else flat
        fn = (BOOL_REDUCERS if is_bool else REDUCERS)[reduce_op]
        n, me = self.view.size, self.view.rank
        per = max(1, WINDOW_BYTES // data.element_size())
        for start in range(0, data.numel(), per):
            chunk = data[start : start + per]
            m = chunk.numel()
            wins = [w[: m * data.element_size()].view(data.dtype) for w in self.windows]
            counts = alg.split_even(m, n)
            bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
            wins[me].copy_(chunk)
            self._step()
            lo, hi = bounds[me], bounds[me + 1]
            if hi > lo:
                _reduce_into(wins[me][lo:hi], [w[lo:hi] for w in wins], fn, me)
            self._step()
            for r in range(n):
                chunk[bounds[r] : bounds[r + 1]].copy_(wins[r][bounds[r] : bounds[r + 1]])
            self._step()

    # --- broadcast ---------------------------------------------------------------------
    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        data = byte_view(flat)
        for start in range(0, data.numel(), WINDOW_BYTES):
            chunk = data[start : start + WINDOW_BYTES]
            if self.view.rank == root:
                self.windows[root][: chunk.numel()].copy_(chunk)
            self._step()
            if self.view.rank != root:
                chunk.copy_(self.windows[root][: chunk.numel()])
            self._step()

    # --- allgather ---------------------------------------------------------------------
    def fits_allgather(self, resp: Response, itemsize: int) -> bool:
        return max(_allgather_bytes_per_rank(resp, itemsize)) <= WINDOW_BYTES

    def allgather(self, resp: Response, entries: Sequence[Any], outs: list[torch.Tensor]) -> None:
        """Every rank's rows of every entry (packed rank-major into its window) copied out
        into ``outs`` (one per entry, every rank's rows in rank order)."""
        n, me = self.view.size, self.view.rank
        assert resp.dim0s is not None
        rows = [math.prod(o.shape[1:]) * o.element_size() for o in outs]
        mine = self.windows[me]
        off = 0
        for e in entries:
            b = byte_view(e.array.tensor)
            mine[off : off + b.numel()].copy_(b)
            off += b.numel()
        self._step()
        out_bytes = [byte_view(o) for o in outs]
        for r in range(n):
            src = 0
            for i, o in enumerate(out_bytes):
                nb = resp.dim0s[i][r] * rows[i]
                dst = sum(resp.dim0s[i][:r]) * rows[i]
                o[dst : dst + nb].copy_(self.windows[r][src : src + nb])
                src += nb
        self._step()

    def close(self) -> None:
        """At shutdown: every rank lets go of its peers' windows before any frees its own
        (CUDA IPC: a window freed while a peer still maps it outlives its process, and torch
        says so at exit). The barrier is bounded: a lost peer cannot hold shutdown up."""
        self.window.release()
        self.windows = []
        _bounded(lambda: alg.barrier(self.view), CLOSE_WAIT_S)
        self.window.close()


def _bounded(fn: Any, seconds: float) -> None:
    """``fn()`` on a thread of its own for at most ``seconds``; errors are dropped (at
    shutdown, a peer that is gone only means there is nobody left to wait for)."""

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    t = threading.Thread(target=run, name="horovod-window-close", daemon=True)
    t.start()
    t.join(seconds)


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], fn: Any, me: int) -> None:
    """``out`` = parts[0] op parts[1] op ... in rank order. ``out`` is ``parts[me]``: it may
    be written first only when it is one of the first two operands."""
    if len(parts) == 1:
        return
    if me < 2:
        fn(parts[0], parts[1], out=out)
        for p in parts[2:]:
            fn(out, p, out=out)
        return
    acc = fn(parts[0], parts[1])
    for p in parts[2:]:
        fn(acc, p, out=acc)
    out.copy_(acc)


def _allgather_bytes(view: Any, mine: bytes) -> list[bytes]:
    """Every rank's ``mine`` (any length) over the view."""
    n = view.size
    if n == 1:
        return [mine]
    lengths = np.zeros(n, np.int64)
    alg.allgatherv(
        view, lengths.view(np.uint8), [8] * n, np.array([len(mine)], np.int64).view(np.uint8)
    )
    out = np.empty(int(lengths.sum()), np.uint8)
    alg.allgatherv(view, out, lengths.tolist(), np.frombuffer(mine, np.uint8).copy())
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return [bytes(out[bounds[r] : bounds[r + 1]]) for r in range(n)]


def _allgather_bytes_per_rank(resp: Response, itemsize: int) -> list[int]:
    assert resp.dim0s is not None
    n = len(resp.dim0s[0])
    rows = [math.prod(s[1:]) * itemsize for s in resp.shapes]
    return [sum(d0[r] * rows[i] for i, d0 in enumerate(resp.dim0s)) for r in range(n)]


def allreduce(resp: Response, entries: Sequence[Any], shared: SharedGpu, fusion: Any) -> list:
    """As ``collectives.allreduce``, through the windows (the same fusion and scaling)."""
    return allreduce_by(resp, entries, shared.view.size, fusion, shared.allreduce)


def broadcast(resp: Response, e: Any, shared: SharedGpu) -> list:
    return broadcast_by(resp, e, lambda t, root: shared.broadcast(t.reshape(-1), root))


def allgather(
    resp: Response, entries: Sequence[Any], shared: SharedGpu, device: torch.device
) -> list:
    np_dtype = DTYPE_OF_CODE[resp.dtype]
    dtype = TORCH_OF[np_dtype]
    assert resp.dim0s is not None
    outs = [
        torch.empty((sum(d0),) + tuple(s[1:]), dtype=dtype, device=device)
        for s, d0 in zip(resp.shapes, resp.dim0s, strict=True)
    ]
    shared.allgather(resp, entries, outs)
    return [DeviceArray(o) for o in outs]
