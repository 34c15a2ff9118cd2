"""The device data plane: runs the engine's responses whose tensors live on a device.

Negotiation, fusion decisions, the response cache, process sets, the timeline and error
reporting stay the engine's; the executor hands a device response here (``execute``) with the
process set's CPU view. Per process set the plane keeps a ``SetGroup``: which path each
collective takes, the torch process group (NCCL; Gloo in the stand-in) made on first use from
the set's own ranks, a device fusion buffer and pinned host memory for the staged path.

The path is chosen once per set, identically on every rank, from what every rank reports
(``choose_path``): the device path where each rank has a GPU of its own and NCCL is present,
the staged path (``staged``) elsewhere or where ``HOROVOD_GPU_<OP>``/``HOROVOD_GPU_OPERATIONS``
ask for it. Adasum always takes the staged path. With ``HOROVOD_HIERARCHICAL_ALLREDUCE`` and
several hosts, an allreduce reduces within each host on the device, among the hosts' leaders
on the CPU plane, and broadcasts within each host on the device.

Must not touch: the engine's tables and negotiation, CPU transports beyond the set's view,
framework code above torch tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.collectives import algorithms as alg
from horovod.common.config import Config
from horovod.common.dtypes import DTYPE_OF_CODE
from horovod.core import ops as cpu_ops
from horovod.core.messages import (
    ADASUM_OP,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    Response,
)
from horovod.device import collectives as dcol
from horovod.device import ipc, staged
from horovod.device.arrays import DeviceArray
from horovod.device.groups import bootstrap, choose_path, describe_self
from horovod.device.streams import CudaStreams, HostStreams

log = logging.getLogger("horovod.device")

OP_SETTING = {
    ALLREDUCE: "gpu_allreduce",
    ALLGATHER: "gpu_allgather",
    BROADCAST: "gpu_broadcast",
    ALLTOALL: "gpu_alltoall",
    REDUCESCATTER: "gpu_reducescatter",
}
ACTIVITY = {
    ALLREDUCE: "ALLREDUCE",
    ALLGATHER: "ALLGATHER",
    BROADCAST: "BCAST",
    ALLTOALL: "ALLTOALL",
    REDUCESCATTER: "REDUCESCATTER",
}
Trace = Callable[[str | None], None]


def plane_device(config: Config, local_rank: int) -> torch.device:
    """The device this rank's plane works on: GPU ``local_rank`` modulo the GPUs it sees (a
    rank that sees one GPU uses it), or the CPU in the stand-in."""
    if config.device_plane_test:
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % count)


class SetGroup:
    """The device plane's state for one process set."""

    def __init__(self, paths: dict[int, str], why: str, backend: str) -> None:
        self.paths = paths  # op -> "device" | "staged"
        self.why = why  # why the device path is out, if it is
        self.backend = backend
        self.pg: Any = None
        self.local: SetGroup | None = None  # hierarchical: the ranks of this host
        self.stores: list[Any] = []
        self.shared: ipc.SharedGpu | None = None  # ranks on one GPU: their windows


class DevicePlane:
    """Device responses of one rank (see the module docstring)."""

    def __init__(self, config: Config, local_rank: int, hierarchical: bool) -> None:
        self.config = config
        self.device = plane_device(config, local_rank)
        self.standin = bool(config.device_plane_test)
        self.shared_standin = config.device_plane_test == "shared"
        self.backend = "gloo" if self.standin else "nccl"
        self.streams: Any = (
            HostStreams(self.device) if self.device.type == "cpu" else CudaStreams(self.device)
        )
        self.fusion = dcol.Fusion(self.device)
        self.stage = staged.HostStage(self.streams)
        self.hierarchical = hierarchical
        self.groups: dict[int, SetGroup] = {}
        self.timeout = datetime.timedelta(seconds=max(30.0, config.timeout_seconds))
        self.path_counts = {"device": 0, "shared": 0, "staged": 0}

    # --- the set's group -------------------------------------------------------------------
    def _group(self, ps_id: int, view: Any) -> SetGroup:
        g = self.groups.get(ps_id)
        if g is None:
            mine = describe_self(self.device, self.backend, self.shared_standin)
            records = _gather_records(view, mine)
            settings = {
                op: getattr(self.config, name) or self.config.gpu_operations
                for op, name in OP_SETTING.items()
            }
            paths, why = choose_path(records, view.hosts, settings)
            g = SetGroup(paths, why, self.backend)
            if why and any(s == "nccl" for s in settings.values()):
                taken = sorted({p for p in paths.values() if p != "device"})
                log.warning(
                    "device plane: no NCCL for process set %d (%s): the %s path",
                    ps_id,
                    why,
                    " and ".join(taken),
                )
            self.groups[ps_id] = g
        return g

    def _pg(self, g: SetGroup, view: Any, tag: str) -> Any:
        if g.pg is None:
            g.pg, store = bootstrap(
                view, g.backend, self.device, self.timeout, self._address(view), tag
            )
            g.stores.append(store)
        return g.pg

    def _address(self, view: Any) -> str:
        hosts = view.hosts
        if not hosts or len(set(hosts)) == 1:
            return "127.0.0.1"
        from horovod.transport.tcp import interface_address, local_address_towards

        cfg = self.config
        if cfg.iface:
            return interface_address(cfg.iface)
        return local_address_towards(cfg.rendezvous_addr or hosts[0])

    # --- execution -------------------------------------------------------------------------
    def path_of(self, ps_id: int, op: int, reduce_op: int) -> str:
        """The path a response takes (once the set's group exists)."""
        if op == ALLREDUCE and reduce_op == ADASUM_OP:
            return "staged"
        return self.groups[ps_id].paths.get(op, "staged")

    def execute(
        self,
        resp: Response,
        entries: Sequence[Any],
        view: Any,
        buffers: cpu_ops.Buffers,
        trace: Trace,
    ) -> list:
        """Run ``resp`` on the device tensors of ``entries`` (None for a joined rank's);
        results as ``core.ops.execute``'s, each carrying the plane's done event."""
        g = self._group(resp.ps_id, view)
        path = self.path_of(resp.ps_id, resp.op, resp.reduce_op)
        with self.streams.plane():
            for e in entries:
                if e is not None:
                    self.streams.wait_ready(e.array.tensor, e.array.ready)
                    out = e.output
                    if out is not None and out is not e.array:
                        self.streams.keep(out.tensor)  # written on the plane's stream
            if path == "shared" and resp.op == ALLGATHER:
                if not self._shared(g, view).fits_allgather(resp, self._itemsize(resp)):
                    path = "staged"  # a rank's rows over the window: through the host
            if path == "staged":
                results = staged.execute(
                    resp, entries, view, self.stage, self.fusion, buffers, trace, self.device
                )
            elif path == "shared":
                results = self._on_shared_gpu(g, resp, entries, view, trace)
            else:
                results = self._on_device(g, resp, entries, view, trace)
            done = self.streams.record()
        self.path_counts[path] += 1
        if path == "staged":
            self.stage.last_done = done
        trace(None)
        for r in results:
            arr = r[0] if isinstance(r, tuple) else r
            if isinstance(arr, DeviceArray):
                arr.done = done
        return results

    def _on_device(
        self, g: SetGroup, resp: Response, entries: Sequence[Any], view: Any, trace: Trace
    ) -> list:
        op = resp.op
        trace(f"{g.backend.upper()}_{ACTIVITY[op]}")
        if op == ALLREDUCE:
            if self.hierarchical:
                hosts = alg.host_layout(view)
                if hosts is not None:
                    return self._hierarchical_allreduce(g, resp, entries, view, hosts, trace)
            return dcol.allreduce(resp, entries, self._pg(g, view, "set"), self.fusion)
        present = [e for e in entries if e is not None]
        pg = self._pg(g, view, "set")
        if op == ALLGATHER:
            return dcol.allgather(resp, present, pg, self.fusion, self.device, view.rank)
        if op == BROADCAST:
            return dcol.broadcast(resp, present[0], pg)
        if op == ALLTOALL:
            return dcol.alltoall(resp, present[0], pg, view, self.device)
        if op == REDUCESCATTER:
            return dcol.reducescatter(resp, present, pg, self.fusion, self.device, view.rank)
        raise AssertionError(f"no device executor for op {op}")

    def _shared(self, g: SetGroup, view: Any) -> ipc.SharedGpu:
        if g.shared is None:
            window: Any = (
                ipc.HostWindow(ipc.WINDOW_BYTES)
                if self.device.type == "cpu"
                else ipc.CudaWindow(self.device, self.streams.stream, ipc.WINDOW_BYTES)
            )
            g.shared = ipc.SharedGpu(view, window)
        return g.shared

    @staticmethod
    def _itemsize(resp: Response) -> int:
        return int(DTYPE_OF_CODE[resp.dtype].itemsize)

    def _on_shared_gpu(
        self, g: SetGroup, resp: Response, entries: Sequence[Any], view: Any, trace: Trace
    ) -> list:
        """Ranks on one GPU: through each other's device memory (``device.ipc``)."""
        trace(f"SHARED_GPU_{ACTIVITY[resp.op]}")
        shared = self._shared(g, view)
        if resp.op == ALLREDUCE:
            return ipc.allreduce(resp, entries, shared, self.fusion)
        present = [e for e in entries if e is not None]
        if resp.op == BROADCAST:
            return ipc.broadcast(resp, present[0], shared)
        return ipc.allgather(resp, present, shared, self.device)

    def _hierarchical_allreduce(
        self,
        g: SetGroup,
        resp: Response,
        entries: Sequence[Any],
        view: Any,
        hosts: Any,
        trace: Trace,
    ) -> list:
        """Reduce within the host on the device (every local rank gets the host's result),
        the leaders' allreduce of it on the CPU plane through pinned memory (scaled there as
        one flat allreduce of the whole set is), a broadcast within the host on the device."""
        if g.local is None:
            g.local = SetGroup({}, "", g.backend)
        local_pg = self._pg(g.local, hosts.local_view, "local")
        op = cpu_ops.SUM if resp.reduce_op == cpu_ops.AVERAGE else resp.reduce_op
        post = (
            alg.average_post(resp.postscale, view.size)
            if resp.reduce_op == cpu_ops.AVERAGE
            else resp.postscale
        )
        buf = dcol.fuse_in(resp, entries, self.fusion)
        dcol.scale(buf, resp.prescale)
        dcol.reduce_in_place(buf, op, local_pg)
        if hosts.leaders_view is not None:
            self.stage.begin()
            staged.allreduce_flat(
                buf, hosts.leaders_view, self.stage, cpu_ops.Buffers(), trace, op, 1.0, post
            )
            self.stage.last_done = self.streams.record()
        trace(f"{g.backend.upper()}_BCAST")
        dcol.broadcast_flat(buf, 0, local_pg)
        return dcol.fuse_out(resp, entries, buf)

    def forget(self, ps_id: int) -> None:
        """A removed process set: release its groups."""
        g = self.groups.pop(ps_id, None)
        if g is not None:
            _shutdown(g)

    def close(self) -> None:
        for g in list(self.groups.values()):
            _shutdown(g)
        self.groups.clear()

    def abort(self) -> None:
        """A collective blocked in NCCL does not see a lost peer: abort the communicators."""
        for g in list(self.groups.values()):
            for grp in (g, g.local):
                if grp is not None and grp.pg is not None and grp.backend == "nccl":
                    with contextlib.suppress(Exception):
                        grp.pg.abort()


def _shutdown(g: SetGroup) -> None:
    """Release a set's process groups (NCCL's communicators; Gloo's go with the object) and
    its shared-GPU windows."""
    if g.shared is not None:
        g.shared.close()
        g.shared = None
    for grp in (g, g.local):
        if grp is not None and grp.pg is not None and grp.backend == "nccl":
            with contextlib.suppress(Exception):
                grp.pg.shutdown()
        if grp is not None:
            grp.pg = None
            grp.stores.clear()


def _gather_records(view: Any, mine: bytes) -> list[bytes]:
    """Every rank's self-description (fixed-size records) over the set's CPU view."""
    size = 256
    if len(mine) > size:
        raise ValueError("device description too long")
    src = np.zeros(size, np.uint8)
    src[: len(mine)] = np.frombuffer(mine, np.uint8)
    out = np.empty(size * view.size, np.uint8)
    if view.size == 1:
        out[:] = src
    else:
        alg.allgatherv(view, out, [size] * view.size, src)
    return [bytes(out[i * size : (i + 1) * size]).rstrip(b"\0") for i in range(view.size)]
