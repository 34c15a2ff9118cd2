"""Execution: running the coordinator's ordered response lists on this rank.

Owns: applying the response-cache rule to each list (identical on every rank), taking the
entries of a response out of the table, running the response on the data plane (``ops``:
fusion buffer, scaling, algorithm choice), completing handles with results or errors, eager
responses that arrived already reduced, process-set additions and removals, and autotune's
parameter switches. Every rank executes the same responses in the same order.

Must not touch: negotiation (the coordinator's), the board (``peer_rounds``), transports other
than through a process set's view."""

from __future__ import annotations

import math
import threading
from typing import Any, cast

import numpy as np

from horovod.common.dtypes import DTYPE_OF_CODE, NAME_OF_CODE
from horovod.common.exceptions import shutdown_message
from horovod.core import ops
from horovod.core.engine_state import EngineState
from horovod.core.fusion import merge
from horovod.core.handles import Entry
from horovod.core.messages import (
    ALLREDUCE,
    BROADCAST,
    CACHEABLE,
    CPU_DEVICE,
    ERROR,
    JOIN,
    OP_NAMES,
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
    Response,
)
from horovod.core.timeline import timeline_rows


class Executor(EngineState):
    """Runs response lists (the cache rule, the data plane, handle completion)."""

    def _process_list(
        self, items: list[tuple], shutdown_why: str | None, params: tuple | None = None
    ) -> bool:
        self.stats["cycles"] += 1
        self.lists_done += 1
        # Every cache id of the list is live before the list runs (the coordinator built it
        # from the same cache): look them all up first, so that a full response placed earlier
        # in the list cannot evict one that a later item names.
        cached = [self._cached_parts(item) for item in items]
        for item, parts in zip(items, cached, strict=True):
            resp = self._decode_response(item, parts)
            if resp is not None:
                if item[0] == "V":
                    self._execute_eager(resp, item[3])
                else:
                    self._execute(resp)
        if params is not None:  # autotune: every rank switches at this same point
            self.apply_params(params)
        if shutdown_why is not None:
            self.closing = True
            with self.lock:
                if self.closed is None:
                    self.closed = shutdown_message(shutdown_why)
            return False
        return True

    def _cached_parts(self, item: tuple) -> list[Response] | None:
        """The cached responses a ``K``/``V`` item names (None: another kind, or a set this
        rank neither belongs to nor coordinates)."""
        if item[0] != "K" and item[0] != "V":
            return None
        ss = self.sets.get(item[1])
        if ss is None or (not ss.member and self.coordinator is None):
            return None
        live = ss.cache.live
        return [live[cid] for cid in item[2]]

    def _decode_response(self, item: tuple, parts: list[Response] | None) -> Response | None:
        """Turn a wire item into a Response and apply the cache rule (identical on all ranks).
        ``parts``: what ``_cached_parts`` found for it."""
        if item[0] == "K" or item[0] == "V":
            if parts is None:
                return None
            cache = self.sets[item[1]].cache
            for cid in item[2]:
                if cid in cache.live:  # a response put earlier in this list may evict it
                    cache.touch(cid)
            return merge(parts)
        resp = Response.from_wire(item)
        ss = self.sets.get(resp.ps_id)
        if resp.op in (PROCESS_SET_ADD, PROCESS_SET_REMOVE):
            return resp
        if ss is None or (not ss.member and self.coordinator is None):
            return None
        if ss.cache.enabled and resp.op in CACHEABLE and not resp.error and not resp.joined:
            for single in resp.split():
                ss.cache.put(single)
        return resp

    def _execute(self, resp: Response) -> None:
        op = resp.op
        if op in (PROCESS_SET_ADD, PROCESS_SET_REMOVE):
            self._apply_process_set_op(resp)
            return
        ss = self.sets[resp.ps_id]
        if not ss.member:
            return
        # Until their handles complete, running entries are failed with the table if the data
        # plane breaks or raises mid-way.
        entries = self._claim(resp, running=op != ERROR and op != JOIN)
        tl = self.timeline
        if op == ERROR:
            if tl is not None:
                rows = timeline_rows(resp)
                tl.ops_start(rows, "ERROR")
                tl.ops_end(rows, None, [()] * len(rows))
            for e in entries:
                if e is not None:
                    e.handle._complete(e.index, error=resp.error, rejected=True)
            return
        if op == JOIN:
            for e in entries:
                if e is not None:
                    e.handle._complete(e.index, resp.last_joined)
            return
        assert ss.view is not None
        if op == BROADCAST:
            resp = with_root(resp, ss.ranks.index(resp.root))
        run = ops.execute if resp.device == CPU_DEVICE else self._device().execute
        if tl is None:
            results = run(resp, entries, ss.view, self.buffers, ops._no_trace)
        else:
            rows = timeline_rows(resp)
            tl.ops_start(rows, OP_NAMES[op])
            results = run(resp, entries, ss.view, self.buffers, lambda act: tl.activity(rows, act))
            tl.ops_end(rows, NAME_OF_CODE.get(resp.dtype, "?"), resp.shapes)
        with self.lock:
            self.running = []
        for e, r in zip(entries, results, strict=False):
            if e is not None:
                e.handle._complete(e.index, r)
        if self.autotuner is not None and op == ALLREDUCE and resp.ps_id == 0:
            self._autotune(resp)

    def _device(self) -> Any:
        """The device data plane, made on the first device response (every rank of a set
        meets that response at the same point, so the plane's collective set-up lines up)."""
        if self.device_plane is None:
            if self.device_factory is None:
                raise RuntimeError("a device tensor reached an engine without a device plane")
            self.device_plane = self.device_factory()
        return self.device_plane

    def _claim(self, resp: Response, running: bool) -> list[Entry | None]:
        """Take this rank's entries of ``resp`` out of the table (None for a joined rank's),
        as ``self.running`` too if ``running``, and count the response."""
        ps_id, table, stats = resp.ps_id, self.table, self.stats
        with self.lock:
            entries = [table.pop((ps_id, n), None) for n in resp.names]
            if running:
                self.running = entries
        stats["responses"] += 1
        if threading.get_ident() != self._thread.ident:
            stats["responses_run_by_caller"] += 1
        if len(entries) > 1:
            stats["fused_responses"] += 1
        return entries

    def _execute_eager(
        self, resp: Response, data: Any, activity: str = "COORDINATOR_ALLREDUCE"
    ) -> None:
        """A response that arrived reduced: the coordinator (or, after a peer round, this
        rank) combined every rank's data, so only the copies into the outputs are left."""
        if not self.sets[resp.ps_id].member:
            return
        entries = self._claim(resp, running=False)
        self.stats["eager_responses"] += 1
        tl = self.timeline
        if tl is not None:
            rows = timeline_rows(resp)
            tl.ops_start(rows, OP_NAMES[resp.op])
            tl.activity(rows, activity)
        result = np.frombuffer(data, DTYPE_OF_CODE[resp.dtype])
        off = 0
        for e, shape in zip(entries, resp.shapes, strict=True):
            end = off + math.prod(shape)
            if e is not None:
                np.copyto(e.output.reshape(-1), result[off:end])
                e.handle._complete(e.index, e.output)
            off = end
        if tl is not None:
            tl.activity(rows, None)
            tl.ops_end(rows, NAME_OF_CODE.get(resp.dtype, "?"), resp.shapes)
        if self.autotuner is not None and resp.ps_id == 0:
            self._autotune(resp)

    def _autotune(self, resp: Response) -> None:
        assert self.autotuner is not None and self.coordinator is not None
        item = DTYPE_OF_CODE[resp.dtype].itemsize
        nbytes = resp.nbytes(item)
        new = self.autotuner.record(resp.names, nbytes, self.clock())
        if new is not None:
            # Fusion and cycle time act on the coordinator only: at once. The cache flag
            # travels with the next response list, which every rank applies at its end.
            self.fusion_threshold = new.fusion_bytes
            self.cycle_s = new.cycle_ms / 1000.0
            self.coordinator.pending_params = new.wire()

    def apply_params(self, params: tuple) -> None:
        fusion, cycle_ms, cache = params
        self.fusion_threshold = int(fusion)
        self.cycle_s = float(cycle_ms) / 1000.0
        for ss in self.sets.values():
            ss.cache.suspended = not cache

    def _apply_process_set_op(self, resp: Response) -> None:
        with self.lock:
            entries = [self.table.pop((0, n), None) for n in resp.names]
        if resp.error:
            for e in entries:
                if e is not None:
                    e.handle._complete(e.index, error=resp.error, rejected=True)
            return
        if resp.op == PROCESS_SET_ADD:
            new_id, ranks = cast(tuple[int, list[int]], resp.extra)
            self._register(new_id, ranks)
            result: Any = new_id
        else:
            ps_id = cast(int, resp.extra)
            self.sets.pop(ps_id, None)
            if self.coordinator is not None:
                self.coordinator.forget_set(ps_id)
            if self.device_plane is not None:
                self.device_plane.forget(ps_id)
            self._close_table(f"process set {ps_id} was removed", only_set=ps_id)
            result = True
        for e in entries:
            if e is not None:
                e.handle._complete(e.index, result)


def with_root(resp: Response, set_root: int) -> Response:
    r = Response.from_wire(resp.wire())
    r.root = set_root
    return r
