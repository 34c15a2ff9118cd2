"""The coordinator (global rank 0): negotiation for every process set.

Owns: the per-set tables of names and which ranks submitted them, readiness (every non-joined
member submitted), the cycle-time hold that lets bursts fuse, joins and shutdown, cache hits
and eager data arriving with requests, building responses (validated by ``validation``), the
fusion plan of each ordered response list, and ids of new process sets. One coordinator orders
the responses of every set, so ranks that share sets run them in the same order. Stalls are
the ``StallInspector``'s (``stall``).

Must not touch: execution (the ranks run the lists), transports beyond sending control
messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from horovod.common.dtypes import DTYPE_OF_CODE
from horovod.core.diagnose import (
    WaitStats,
)
from horovod.core.fusion import fusible, merge
from horovod.core.messages import (
    ALLREDUCE,
    ERROR,
    FUSIBLE,
    JOIN,
    OP_NAMES,
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
    Request,
    Response,
    encode,
)
from horovod.core.numerics import fold
from horovod.core.pending import Built, Pending
from horovod.core.set_state import SetState
from horovod.core.stall import Diagnosis, StallInspector, crossed_grace
from horovod.core.timeline import timeline_row
from horovod.core.validation import REFUSED_WHILE_JOINED, validate

if TYPE_CHECKING:
    from horovod.core.engine_state import EngineState

# The longest a shutdown list waits for this rank's open peer round (``_round_may_finish``).
SHUTDOWN_HOLD_S = 5.0


# ====================================================================================== coordinator
class Coordinator(StallInspector):
    """Negotiation on global rank 0 for every process set."""

    def __init__(
        self,
        engine: EngineState,
        stall_check: float,
        stall_shutdown: float,
        first_free: int,
        wait_summary_seconds: float = 0.0,
    ) -> None:
        self.e = engine
        self.tables: dict[int, dict[str, Pending]] = {}
        self.ready: list[tuple[int, str]] = []
        self.joined: dict[int, None] = {}  # global ranks joined, in join order
        self.shutdown_why: str | None = None
        self.shut_ranks: set[int] = set()  # ranks that said they are shutting down
        self.holding_since: float | None = None  # a shutdown list waits for a round (below)
        self.stall_check = stall_check
        self.stall_shutdown = stall_shutdown if stall_shutdown > stall_check else 0.0
        self.next_stall = engine.clock() + stall_check if stall_check > 0 else float("inf")
        self.resend: dict[int, list[tuple[int, int]]] = {}
        self.next_ps_id = first_free
        self.free_ids: list[int] = []
        self.partial = 0  # names submitted by some ranks but not yet by all
        self.ready_since = 0.0  # when the current ready list got its first entry
        now = engine.clock()
        self.waits = WaitStats(engine.size, now)
        self.wait_period = wait_summary_seconds
        self.diagnosis: Diagnosis | None = None
        self.tokens = 0
        self.pending_params: tuple | None = None  # autotune's next parameters, for every rank
        self.hit_requests: dict[tuple[int, int, int], tuple[Response, Request]] = {}
        self.arrivals: list[dict[int, float]] = []  # for self.waits, not yet recorded
        self.eager_left = 0  # bytes of eager results the list being built may still carry
        self.paused = False  # rank 0 has a plane round open: no list is emitted meanwhile
        self.next_crossed = 0.0  # the next look for crossed collectives (``_crossed``)
        self.crossed_grace = crossed_grace(stall_check)

    def on_message(self, peer: int, msg: tuple) -> None:
        tag = msg[0]
        if tag == "Q":
            for item in msg[1]:
                if item[0] == "H" or item[0] == "D":
                    ps_id, cid = int(item[1]), int(item[2])
                    ss = self.e.sets.get(ps_id)
                    resp = ss.cache.resolve(cid) if ss is not None else None
                    if resp is None or ss is None:
                        self.resend.setdefault(peer, []).append((ps_id, cid))
                        continue
                    data = memoryview(item[3]) if item[0] == "D" else None
                    self.add(peer, self._hit_request(ss, resp, peer, cid), cid, data)
                else:
                    self.add(peer, Request.from_wire(item[1]), None)
        elif tag == "S":
            if self.shutdown_why is None:
                self.shutdown_why = str(msg[1])
            self.shut_ranks.add(peer)
            self.e.closing = True
        elif tag == "A":
            self.e._abort(str(msg[1]))
        elif tag == "STACK":
            d = self.diagnosis
            if d is not None and msg[1] == d.token:
                d.stacks[peer] = list(msg[2])

    def _hit_request(self, ss: SetState, resp: Response, peer: int, cid: int) -> Request:
        """The request a cache hit stands for. Built once per (set, id, rank) and reused while
        that id resolves to the same response: steady-state training sends the same ids every
        step. (Nothing modifies a Request once it is submitted.)"""
        key = (ss.id, cid, peer)
        memo = self.hit_requests.get(key)
        if memo is not None and memo[0] is resp:
            return memo[1]
        op, dtype, shape, reduce_op, root, pre, post, device, extra = resp.request_for(
            ss.ranks.index(peer)
        )
        req = Request(
            ss.id,
            resp.names[0],
            op,
            dtype,
            shape,
            reduce_op,
            root,
            pre,
            post,
            device,
            resp.group,
            extra,
        )
        if len(self.hit_requests) >= 4 * max(1, ss.cache.capacity) * self.e.size:
            self.hit_requests.clear()  # ids of evicted responses are never sent again
        self.hit_requests[key] = (resp, req)
        return req

    def add(self, rank: int, req: Request, cid: int | None, data: Any = None) -> None:
        if req.op == JOIN:
            self.joined.pop(rank, None)
            self.joined[rank] = None
            for name, p in self.tables.get(0, {}).items():
                self._check_ready(0, name, p)
            if len(self.joined) == self.e.size:
                self.ready.append((0, "__join__"))
            return
        now = self.e.clock()
        ps_id, name = req.ps_id, req.name
        table = self.tables.get(ps_id)
        if table is None:
            table = self.tables[ps_id] = {}
        pend = table.get(name)
        if pend is None:
            pend = table[name] = Pending(now)
        if not pend.reqs:
            self.partial += 1
        pend.reqs[rank] = req
        pend.cids[rank] = cid
        pend.times[rank] = now
        if data is not None:
            if pend.data is None:
                pend.data = {}
            pend.data[rank] = data
        tl = self.e.timeline
        if tl is not None:
            tl.negotiate_ready(timeline_row(ps_id, name), OP_NAMES.get(req.op, "?"), rank, now)
        self._check_ready(ps_id, name, pend, now)

    def _check_ready(self, ps_id: int, name: str, p: Pending, now: float | None = None) -> None:
        if p.ready:
            return
        ss = self.e.sets.get(ps_id)
        if ss is None:
            need = 0
        else:
            need = len(ss.ranks)
            if ps_id == 0 and self.joined:
                need -= len(self.joined)
                if next(iter(p.reqs.values())).op in REFUSED_WHILE_JOINED:
                    # Refused at once for whoever submitted it: waiting for every other rank
                    # could wait forever (unnamed ops of ranks that joined at different
                    # times carry different names), and the answer would be the same.
                    need = 1
        if len(p.reqs) >= need:
            p.ready = True
            self.partial -= 1
            if now is None:
                now = self.e.clock()
            if not self.ready:
                self.ready_since = now
            self.ready.append((ps_id, name))
            tl = self.e.timeline
            if tl is None:
                # Wait attribution is bookkeeping: done after the response list is sent.
                self.arrivals.append(p.times)
            else:
                self.record_arrivals()  # in order
                slowest = self.waits.record(p.times.items())
                if slowest is None:
                    tl.negotiate_end(timeline_row(ps_id, name), now)
                else:
                    tl.negotiate_end(
                        timeline_row(ps_id, name),
                        now,
                        last_rank=slowest[0],
                        waited_ms=round(slowest[1] * 1e3, 3),
                    )

    def forget_set(self, ps_id: int) -> None:
        self.partial -= sum(1 for p in self.tables.get(ps_id, {}).values() if not p.ready)
        self.tables.pop(ps_id, None)
        self.ready = [(p, n) for p, n in self.ready if p != ps_id]

    def _hold_until(self) -> float:
        """Ready responses are held back (to be fused with what follows) only while other
        tensors are partially submitted, i.e. more work is known to be on its way, and for at
        most one cycle time. Otherwise a round starts at once: a lone or sequential op never
        waits for a tick."""
        if self.partial > 0 and self.shutdown_why is None:
            return self.ready_since + self.e.cycle_s
        return 0.0

    def timeout(self) -> float | None:
        now = self.e.clock()
        waits = []
        if self.holding_since is not None:  # (posts on their way wake the engine)
            board = self.e.board
            due = board is not None and board.open and board.due()
            waits.append(0.0 if due else max(0.0, self.holding_since + SHUTDOWN_HOLD_S - now))
        elif self.resend or (not self.paused and (self.ready or self.shutdown_why is not None)):
            waits.append(max(0.0, self._hold_until() - now))
        if self.next_stall != float("inf") and any(self.tables.values()):
            waits.append(max(0.0, self.next_stall - now))
        if self.partial > 0:  # the look for crossed collectives (``_crossed``)
            waits.append(max(0.0, self.next_crossed - now))
        if self.diagnosis is not None:
            waits.append(max(0.0, self.diagnosis.deadline - now))
        return min(waits) if waits else None

    def _round_may_finish(self, now: float) -> bool:
        """Does a shutdown list wait, for now, for this rank's open peer round? It does while
        every rank the round waits for is still running: their posts are on their way (over
        TCP a post and a peer's later shutdown message travel on different connections, so
        the shutdown can arrive first; ranks that finished the round and left must not fail
        it here). A rank that said it is shutting down posts nothing more, so a round waiting
        for one cannot finish. At most ``SHUTDOWN_HOLD_S``."""
        e = self.e
        board = e.board
        if board is None or not e.round_items or not board.open:
            self.holding_since = None
            return False
        if board.due():  # (reads what arrived) every post is there: the round runs first
            if self.holding_since is None:
                self.holding_since = now
            return True
        if set(board.waiting()) & self.shut_ranks:
            self.holding_since = None
            return False
        if self.holding_since is None:
            self.holding_since = now
        if now - self.holding_since >= SHUTDOWN_HOLD_S:
            self.holding_since = None
            return False
        return True

    def maybe_emit(self) -> tuple | None:
        e = self.e
        now = e.clock()
        if self.resend:
            for peer, wanted in self.resend.items():
                e._send(peer, encode(("RESEND", wanted)))
            self.resend = {}
        if now >= self.next_stall:
            self._stall_check(now)
        if self.diagnosis is not None:
            self._finish_diagnosis(now)
        if self.wait_period > 0 and now - self.waits.start >= self.wait_period:
            self.report_waits(now)
        crossed: list[Built] = []
        if self.partial > 0 and now >= self.next_crossed:
            self.next_crossed = now + self.crossed_grace / 2
            if not self.paused:
                crossed = self._crossed(now)
        if self.paused or (not self.ready and not crossed and self.shutdown_why is None):
            return None
        if self.shutdown_why is not None and self._round_may_finish(now):
            return None
        if now < self._hold_until() and not crossed:
            return None
        self.eager_left = e.eager_bytes  # what this list may carry reduced (small messages)
        built = [self._build(ps_id, name) for ps_id, name in self.ready] + crossed
        self.ready = []
        if self.shutdown_why is not None:
            built.extend(self._orphans())
        items = self._fuse(built)
        if e.timeline is not None:
            e.timeline.cycle()
        msg = ("P", items, self.shutdown_why, self.pending_params)
        self.pending_params = None
        if e.size > 1:
            wire = encode(msg)
            for p in range(1, e.size):
                e._send(p, wire)
        self.record_arrivals()
        return msg

    def record_arrivals(self) -> None:
        waits = self.waits
        for times in self.arrivals:
            waits.record(times.items())
        self.arrivals.clear()

    def _build(self, ps_id: int, name: str) -> Built:
        if name == "__join__":
            last = next(reversed(self.joined))
            self.joined = {}
            return Response(JOIN, 0, ["join.noname"], last_joined=last), None, None
        p = self.tables[ps_id].pop(name)
        ss = self.e.sets.get(ps_id)
        joined = tuple(self.joined) if ps_id == 0 and self.joined else ()
        if ss is None:
            return (
                Response(
                    ERROR,
                    ps_id,
                    [name],
                    error=(
                        f"{name}: process set {ps_id} does not exist (it was removed or never added)"
                    ),
                ),
                None,
                None,
            )
        cids = set(p.cids.values())
        if (
            ss.cache.enabled
            and not joined
            and len(cids) == 1
            and None not in cids
            and len(p.reqs) == len(ss.ranks)
        ):
            cid = cids.pop()
            assert cid is not None
            cached = ss.cache.live.get(cid)
            if cached is not None:
                return cached, cid, self._eager_data(ss, cached, p)
        resp = validate(ss, name, p, joined, self.e.sets)
        if resp.op == PROCESS_SET_ADD:
            resp.extra = (self._new_set_id(), cast(tuple, resp.extra)[1])
        elif resp.op == PROCESS_SET_REMOVE:
            self.free_ids.append(cast(int, resp.extra))
        return resp, None, None

    def _new_set_id(self) -> int:
        """The id of a process set being added: the lowest one freed by a removal, else a
        new one."""
        if self.free_ids:
            return self.free_ids.pop(0)
        self.next_ps_id += 1
        return self.next_ps_id - 1

    def _eager_data(self, ss: SetState, resp: Response, p: Pending) -> dict[int, Any] | None:
        """Every member's data for a cached allreduce, when all of them sent it (and of the
        size the response says), else None: the data plane runs it."""
        data = p.data
        if data is None or len(data) != len(ss.ranks) or resp.op != ALLREDUCE:
            return None
        nbytes = resp.nbytes(DTYPE_OF_CODE[resp.dtype].itemsize)
        if nbytes > self.eager_left:
            return None
        for r in ss.ranks:
            d = data.get(r)
            if d is None or d.nbytes != nbytes:
                return None
        self.eager_left -= nbytes
        return data

    def _reduce_eager(self, group: list[Built]) -> tuple:
        """The "V" item of responses whose data every rank sent: reduced here, in rank order,
        with the data plane's numerics (``_fold``)."""
        head = group[0][0]
        ss = self.e.sets[head.ps_id]
        dtype = DTYPE_OF_CODE[head.dtype]
        parts = []
        for r in ss.ranks:
            mine = [np.frombuffer(d[r], dtype) for _, _, d in group]  # type: ignore[index]
            parts.append(np.concatenate(mine) if len(mine) > 1 else mine[0])
        acc = fold(parts, head, len(ss.ranks))
        return ("V", head.ps_id, [c for _, c, _ in group], acc.tobytes())

    def _fuse(self, built: list[Built]) -> list[tuple]:
        e = self.e
        if len(built) == 1:  # a lone response (sequential ops): nothing to fuse
            head, hcid, data = built[0]
            if data is not None:
                return [self._reduce_eager(built)]
            return [("K", head.ps_id, [hcid]) if hcid is not None else head.wire()]
        threshold = e.fusion_threshold
        out: list[tuple] = []
        rest = list(built)
        while rest:
            first = rest.pop(0)
            head, hcid, hdata = first
            group = [first]
            if hdata is not None:
                # Eager ones fuse only with each other (reduced here, in one buffer).
                acc = head.nbytes(DTYPE_OF_CODE[head.dtype].itemsize)
                keep = []
                for cand in rest:
                    r = cand[0]
                    nb = r.nbytes(DTYPE_OF_CODE[r.dtype].itemsize)
                    if (
                        cand[2] is not None
                        and fusible(head, r, e.disable_group_fusion)
                        and acc + nb <= threshold
                    ):
                        group.append(cand)
                        acc += nb
                    else:
                        keep.append(cand)
                rest = keep
                out.append(self._reduce_eager(group))
                continue
            if head.op in FUSIBLE and not head.error and threshold > 0:
                item = DTYPE_OF_CODE[head.dtype].itemsize
                acc = head.nbytes(item)
                skipped = 0
                keep = []
                for cand in rest:
                    r = cand[0]
                    if cand[2] is not None:  # eager: reduced here, with its own kind
                        keep.append(cand)
                        continue
                    nb = r.nbytes(item) if r.op in FUSIBLE and not r.error else 0
                    if acc + skipped > threshold:
                        keep.append(cand)
                        continue
                    if fusible(head, r, e.disable_group_fusion) and acc + nb <= threshold:
                        group.append(cand)
                        acc += nb
                    else:
                        keep.append(cand)
                        skipped += nb
                rest = keep
            if all(c is not None for _, c, _ in group) and group[0][1] is not None:
                out.append(("K", head.ps_id, [c for _, c, _ in group]))
            else:
                out.append(merge([r for r, _, _ in group]).wire())
        return out
