"""Peer rounds: one-host jobs decide cached ops among themselves on the board, without rank 0.

A rank whose ops in flight are all cached ops of the global set posts their ids (and, for small
ones, their data) to its next round on the transport's board; once every rank has posted, each
reads every post and decides the same (``decide``): a *data* round is computed from the posts
alone (allreduce folded in rank order with the data plane's numerics, allgather concatenated,
broadcast copied), a *plane* round runs the ops on the data plane fused as the coordinator
would, anything else falls back to rank 0. Owns: posting, answering a peer's round, holding
back lists during a plane round, the output slots of lone allgathers, and the decision rule.
See "Peer rounds" in docs/architecture.md.

Needs a transport with a board (``PolledTransport.board``); must not touch the coordinator's
tables or the board's layout (only its interface in ``horovod.transport.base``)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.common.dtypes import DTYPE_OF_CODE, NAME_OF_CODE
from horovod.common.log import logger
from horovod.core import ops
from horovod.core.executor import Executor
from horovod.core.fusion import fusible, merge
from horovod.core.handles import Entry, np_alloc
from horovod.core.messages import (
    ALLGATHER,
    ALLREDUCE,
    BARRIER,
    BROADCAST,
    CACHEABLE,
    CPU_DEVICE,
    FUSIBLE,
    OP_NAMES,
    Response,
    display_name,
)
from horovod.core.numerics import fold, one_fold
from horovod.core.stall import ranks_text
from horovod.core.timeline import timeline_rows


class PeerRounds(Executor):
    """The peer-round layer of the engine (see the module docstring)."""

    def _may_post(self, op: int, nbytes: int, plane: bool = False) -> bool:
        """(``drive`` held.) May this rank post a lone data round of ``op`` (``nbytes``) now
        (or, with ``plane``, a plane round if it is too large for a data round): no round open
        and no lists held, nothing in the inbox or the control rings, the cache on, an
        allreduce within the eager budget, the coordinator not paused, and no peer's post made
        after lists this rank has yet to process?"""
        board = self.board
        assert board is not None
        return (
            not self.round_items
            and not board.open
            and not self.held
            and self.inbox.empty()
            and self.polled.ctrl_idle()
            and self.sets[0].cache.enabled
            and (plane or op != ALLREDUCE or nbytes <= self.round_budget)
            and (self.coordinator is None or not self.coordinator.paused)
            and (not board.opened() or max(board.tags()) >> 1 <= self.lists_done)
        )

    def _open_round(self, e: Entry, resp: Response, cid: int, tag: int, out: int) -> None:
        """The round state of a lone op posted by ``_post_lone``, as the general path keeps
        it for an open round."""
        self.round_items, self.round_cids, self.round_tag = [(e, resp)], [cid], tag
        self.round_out = out
        self.round_totals = list(self._posted_by_cid[cid])
        self._round_posted(self.clock())

    def _round_posted(self, now: float) -> None:
        """This rank's ops are posted in its open round: its timers start."""
        self.round_posted_at = now
        self.round_warn_at = now + self.round_warn_s

    def _await_posts(self, deadline: float) -> bool:
        """Poll the board until every peer has posted this rank's open round (True), or give
        up (False) past ``deadline``, when something else arrives (a control message, a
        submission) or the transport aborts."""
        t = self.polled
        board = self.board
        assert board is not None
        clock = time.perf_counter
        inbox = self.inbox
        due = board.due
        polls = 0
        while not due():
            polls += 1
            if polls & 3 == 0 and (  # the board every time, the rest every 4th poll
                clock() > deadline
                or not inbox.empty()
                or not t.ctrl_idle()
                or t.aborted is not None
            ):
                return False
            if self._yield:
                os.sched_yield()  # more ranks than cores: let the one we wait for run
        return True

    def _posted_sizes(self, cid: int, resp: Response) -> tuple[int, ...]:
        """Bytes each rank posts for cached op ``cid`` in a data round (memoized)."""
        memo = self._posted_by_cid
        if len(memo) > 4096:
            memo.clear()
        sizes = memo[cid] = tuple(posted_bytes(resp, r) for r in range(self.size))
        return sizes

    def _post_round(self, entries: list[Entry]) -> bool:
        """Post ``entries`` to the next peer round if all of them are cached ops of the global
        set (the ops alone in flight on this rank, nothing of it waits at rank 0). Small
        ops post their data ("data" round), anything else only the ids ("plane")."""
        ss = self.sets[0]
        cache = ss.cache
        if not cache.enabled or self.closing or len(entries) > self.board_ids:
            return False
        budget = self.round_budget  # allreduces (folded by every rank: a bit of compute)
        room = self.board_data  # everything posted, by the rank that posts the most
        data = True
        cids: list[int] = []
        items: list[tuple[Entry, Response]] = []
        totals = [0] * self.size
        memo = self._posted_by_cid
        for e in entries:
            req = e.request
            if req.ps_id != 0 or req.op not in CACHEABLE or req.device != CPU_DEVICE:
                return False
            cid = cache.lookup(req.name, req.signature(), ss.set_rank)
            if cid is None:
                return False
            resp = cache.live[cid]
            if data:
                if req.op == ALLREDUCE:
                    budget -= e.array.nbytes
                    data = req.reduce_op in ops.UFUNCS and budget >= 0
                else:  # (a barrier's post is its arrival: no data)
                    data = req.op == ALLGATHER or req.op == BROADCAST or req.op == BARRIER
                if data:
                    sizes = memo.get(cid) or self._posted_sizes(cid, resp)
                    room -= max(sizes)
                    data = room >= 0 and (req.op != BROADCAST or max(sizes) <= self.round_broadcast)
                    for r in range(self.size):
                        totals[r] += sizes[r]
            cids.append(cid)
            items.append((e, resp))
        out = -1
        if data:
            me = self.rank
            if len(items) == 1 and items[0][1].op == ALLGATHER:
                head = items[0][0]
                out = self._out_post(head.array, head.alloc, items[0][1], cids[0])
            parts = [
                memoryview(e.array.reshape(-1).view(np.uint8))
                for e, resp in items
                if (resp.op != BROADCAST or resp.root == me) and resp.op != BARRIER and out < 0
            ]
            tag = self.lists_done << 1
        else:
            parts = []
            tag = self.lists_done << 1 | 1
        self.polled.board_post(cids, parts, tag, out)
        self.round_items, self.round_cids, self.round_tag = items, cids, tag
        self.round_out = out
        self.round_totals = totals
        self._round_posted(self.clock())
        self.stats["rounds_posted"] += 1
        return True

    def _out_post(self, array: np.ndarray, alloc: Any, resp: Response, cid: int) -> int:
        """An allgather (of ``array``, result allocated by ``alloc``) alone in its data round
        whose result can live in an output slot of this rank (shared memory): copy this rank's
        block to its place there, where the peers read it from, and return the slot (else -1:
        the block goes into the post)."""
        t = self.polled
        if alloc is not np_alloc or not t.outputs:
            return -1
        sizes = self._posted_by_cid.get(cid) or self._posted_sizes(cid, resp)
        me = self.rank
        nb = sizes[me]
        if nb < t.out_min:
            return -1
        k: int = t.out_slot(sum(sizes))
        if k >= 0:
            at = sum(sizes[:me])
            owner = t.out_owner(k)
            owner[at : at + nb] = array.reshape(-1).view(np.uint8)
        return k

    def _round_step(self) -> None:
        """Decide the peer rounds that can be decided: answer a peer that posted a round this
        rank has not (with nothing: this rank's own ops went to rank 0 or are not cached ops
        of the global set), and run or hand over this rank's posted ops once every peer has
        posted."""
        board = self.board
        assert board is not None
        while True:
            if not board.open:
                if not board.opened():
                    break
                if self.unsent > 0 and not self.closing:
                    break  # a submission waits in the inbox: it posts or answers first
                if max(board.tags()) >> 1 > self.lists_done:
                    # A peer posted after more response lists than this rank has processed:
                    # process those first (they were sent before that post, and the peer is
                    # done with them), then answer, likely with the same ops.
                    break
                if not self.table and not self.closing:
                    # Nothing in flight here: this rank is most likely about to submit the
                    # same ops (a loop of synchronous calls, or gradients of the same step).
                    # Leave the answer to that submission, for up to ``answer_wait_s``.
                    now = self.clock()
                    if not board.deferred:
                        board.deferred = True
                        self.answer_by = now + self.answer_wait_s
                    if now < self.answer_by:
                        break
                self.polled.board_post((), (), self.lists_done << 1)
                self.round_items, self.round_cids, self.round_tag = [], [], 0
                continue
            if not board.due():
                break
            self._close_round()
        if self.round_items and self.round_warn_s > 0:
            now = self.clock()
            if now >= self.round_warn_at:
                self.round_warn_at = now + self.round_warn_s
                e = self.round_items[0][0]
                waited = now - self.round_posted_at
                text = (
                    f"rank {self.rank}: {display_name(e.request.op, e.request.name)}"
                    + (f" (submitted at {e.handle.callsite})" if e.handle.callsite else "")
                    + f" has waited {waited:.1f} s in a peer round for "
                    + f"{ranks_text(board.waiting())} to post too: not submitted there yet, "
                    "and that engine has not answered (busy or blocked outside Horovod?)"
                )
                if self.round_shutdown_s and waited >= self.round_shutdown_s:
                    self.unresponsive = sorted(board.waiting())
                    text += (
                        f"\nStopping the job: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
                        f"{self.round_shutdown_s:g} was exceeded."
                    )
                    logger.error(text)
                    self.on_fatal_report(text)
                    self._abort(text)
                    return
                logger.warning(text)

    def _close_round(self) -> None:
        """Every peer has posted this rank's open round: read the posts, decide, and run the
        ops this rank posted (or hand them to rank 0)."""
        board = self.board
        assert board is not None
        posts = board.read()
        board.open = False
        items, self.round_items = self.round_items, []
        out, self.round_out = self.round_out, -1
        if not items:
            return
        cids, self.round_cids = self.round_cids, []
        how = decide(items, cids, self.round_tag, posts, self.round_totals)
        if how == "plane":
            self._run_plane_round(items)
        elif how == "data":
            self._run_round(items, posts, out)
        else:
            # Some peer posted something else (or nothing): every rank sees the same posts,
            # so all of them hand their ops to rank 0 as usual.
            with self.lock:
                live = [e for e, _ in items if self.table.get(e.key) is e]
            if live:
                self._send_requests(live, rounds=False)

    def _run_plane_round(self, items: list[tuple[Entry, Response]]) -> None:
        """Every rank posted these cached ops at the same place: each runs them on the data
        plane, fused the way the coordinator would (consecutive fusible ones up to the fusion
        threshold), so every rank runs the same responses in the same order."""
        self.stats["rounds_run"] += 1
        threshold = self.fusion_threshold
        group: list[Response] = []
        acc = 0
        for _, resp in items:
            nb = resp.nbytes(DTYPE_OF_CODE[resp.dtype].itemsize)
            if (
                group
                and threshold > 0
                and resp.op in FUSIBLE
                and fusible(group[0], resp, self.disable_group_fusion)
                and acc + nb <= threshold
            ):
                group.append(resp)
                acc += nb
                continue
            if group:
                self._execute(merge(group))
            group, acc = [resp], nb
        if group:
            self._execute(merge(group))

    def _run_round(
        self, items: list[tuple[Entry, Response]], posts: list[tuple], out: int = -1
    ) -> None:
        """Every rank posted these ops with its data (a "data" round): each rank computes
        every result from the posts alone. Allreduces reduce all parts in rank order with the
        data plane's numerics, so every rank computes the same bits; allgathers concatenate
        the parts; broadcasts take the root's; a barrier is done (every rank posted it, so
        every rank has reached it). ``out``: this rank's output slot that holds its block of
        a lone allgather (which is then the result)."""
        self.stats["rounds_run"] += 1
        self.stats["data_rounds"] += 1
        me, n = self.rank, self.size
        data: list[Any] = [None] * n
        outs = [-1] * n
        for r, _, _, d, o in posts:
            data[r] = d
            outs[r] = o
        outs[me] = out
        offs = [0] * n
        for e, resp in items:
            op = resp.op
            dtype = DTYPE_OF_CODE[resp.dtype]
            if op == ALLREDUCE:
                mine = e.array.reshape(-1)
                count = mine.size
                parts = [mine] * n
                for r in range(n):
                    if r != me:
                        parts[r] = np.frombuffer(data[r], dtype, count, offs[r])
                    offs[r] += mine.nbytes
                if self.timeline is None and self.autotuner is None and one_fold(resp, n):
                    # The common latency case, without the general path's temporaries: the
                    # one fold straight into the output (the same bits as ``_fold``).
                    entries = self._claim(resp, running=False)
                    self.stats["eager_responses"] += 1
                    one = entries[0]
                    if one is not None:
                        ops.UFUNCS[resp.reduce_op](parts[0], parts[1], out=one.output.reshape(-1))
                        one.handle._complete(one.index, one.output)
                    continue
                self._execute_eager(resp, fold(parts, resp, n), "PEER_ALLREDUCE")
                continue
            got = self._claim(resp, running=False)[0]
            if got is None:  # failed meanwhile (the table closed): only skip its bytes
                for r in range(n):
                    offs[r] += posted_bytes(resp, r)
                self._out_done(outs)
                continue
            tl = self.timeline
            if tl is not None:
                rows = timeline_rows(resp)
                tl.ops_start(rows, OP_NAMES[op])
                tl.activity(rows, "PEER_" + OP_NAMES[op].upper())
            if op == ALLGATHER:
                res = self._gathered(resp, got.array, got.alloc, data, offs, outs)
                self._out_done(outs)
            elif op == BARRIER:  # every rank posted it: every rank has reached it
                res = None
            else:  # BROADCAST
                res = self._broadcasted(resp, got.array, got.output, data, offs)
            if tl is not None:
                tl.activity(rows, None)
                tl.ops_end(rows, NAME_OF_CODE.get(resp.dtype, "?"), resp.shapes)
            got.handle._complete(got.index, res)

    def _gathered(
        self,
        resp: Response,
        array: np.ndarray,
        alloc: Any,
        data: list[Any],
        offs: list[int],
        outs: list[int],
    ) -> np.ndarray:
        """A data round's allgather result: this rank's ``array`` and the peers' blocks, from
        their posts (``data[r]`` at ``offs[r]``, advanced past them) or their output slots
        (``outs[r]``; ``outs[me]``: this rank's block is in its own slot, which is then the
        result; else ``alloc`` makes it)."""
        me, n = self.rank, self.size
        dtype = array.dtype
        assert resp.dim0s is not None
        shape = (sum(resp.dim0s[0]),) + tuple(resp.shapes[0][1:])
        t = self.polled
        if outs[me] >= 0:  # this rank's block is in place already
            self.stats["slot_outputs"] += 1
            owner = t.out_owner(outs[me])
            res = owner[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        else:
            res = alloc(shape, dtype)
        flat = res.reshape(-1).view(np.uint8)
        at = 0
        for r in range(n):
            nb = posted_bytes(resp, r)
            if outs[r] >= 0:
                if r != me:  # the peer's block, at the same place of its result
                    src = t.peer_out(r, outs[r])
                    flat[at : at + nb] = np.frombuffer(src, np.uint8, nb, at)
            else:
                flat[at : at + nb] = (
                    array.reshape(-1).view(np.uint8)
                    if r == me
                    else np.frombuffer(data[r], np.uint8, nb, offs[r])
                )
                offs[r] += nb
            at += nb
        return res  # type: ignore[no-any-return]

    def _broadcasted(
        self,
        resp: Response,
        array: np.ndarray,
        output: Any,
        data: list[Any],
        offs: list[int],
    ) -> np.ndarray:
        """A data round's broadcast result in ``output``: the root's post (``data[root]`` at
        ``offs[root]``, advanced past it), or on the root its own ``array``."""
        root = resp.root
        nb = posted_bytes(resp, root)
        if root != self.rank:
            output.reshape(-1).view(np.uint8)[:] = np.frombuffer(
                data[root], np.uint8, nb, offs[root]
            )
        elif output is not array:
            np.copyto(output, array)
        offs[root] += nb
        return output  # type: ignore[no-any-return]

    def _out_done(self, outs: list[int]) -> None:
        """After reading a lone allgather's round: tell the peers whose output slots it read
        from, then (if this rank's block was in its own slot) wait until every peer has read
        it there, so that the result can be handed out (and changed by the caller)."""
        me = self.rank
        readers_of = [r for r, o in enumerate(outs) if o >= 0 and r != me]
        if readers_of:
            self.polled.board_ack(readers_of)
        if outs[me] >= 0:
            self.polled.board_wait_acked()


def decide(
    items: Sequence[tuple[Entry | None, Response]],
    cids: list[int],
    tag: int,
    posts: list[tuple],
    totals: Sequence[int] | None = None,
) -> str:
    """How a peer round this rank posted ``items`` (ids ``cids``, ``tag``) to runs, given the
    peers' ``posts`` (rank, tag, ids, data, output slot): "data" (from the posts and the
    output slots they name; only a lone allgather's post may name one), "plane" (on the
    data plane) or "fallback" (through rank 0). Every rank sees the same posts and decides
    the same. ``totals``: the bytes each rank posts for ``items`` (computed if not given)."""
    if tag & 1:
        # Same ops, posted after the same number of response lists: run on the data plane,
        # exactly as a list from rank 0 would. After different numbers, one rank may have run
        # a list (a broadcast it is root of) whose bytes the other has yet to read.
        ok = all(c == cids and t == tag for _, t, c, _, _ in posts)
        return "plane" if ok else "fallback"
    lone_gather = len(items) == 1 and items[0][1].op == ALLGATHER
    ok = all(
        c == cids
        and not t & 1
        and (
            d.nbytes == (totals[r] if totals else sum(posted_bytes(resp, r) for _, resp in items))
            or (out >= 0 and lone_gather and d.nbytes == 0)
        )
        for r, t, c, d, out in posts
    )
    return "data" if ok else "fallback"


def decide_lone(cid: int, op: int, tag: int, posts: list[tuple], sizes: Sequence[int]) -> str:
    """``decide`` for one op (id ``cid``, ``op``) alone in its round, ``sizes`` the bytes each
    rank posts for it: the same answer, without the lists (an express call's check)."""
    if tag & 1:
        for _, t, c, _, _ in posts:
            if t != tag or len(c) != 1 or c[0] != cid:
                return "fallback"
        return "plane"
    for r, t, c, d, out in posts:
        if t & 1 or len(c) != 1 or c[0] != cid:
            return "fallback"
        if d.nbytes != sizes[r] and not (out >= 0 and op == ALLGATHER and d.nbytes == 0):
            return "fallback"
    return "data"


def posted_bytes(resp: Response, r: int) -> int:
    """Bytes that rank ``r`` posts for cached op ``resp`` (one tensor) in a data round."""
    shape = resp.shapes[0]
    item = DTYPE_OF_CODE[resp.dtype].itemsize
    if resp.op == ALLGATHER:
        assert resp.dim0s is not None
        return resp.dim0s[0][r] * math.prod(shape[1:]) * item
    size = math.prod(shape) * item
    if resp.op == BROADCAST:
        return size if r == resp.root else 0
    if resp.op == BARRIER:
        return 0
    return size
