"""The fast paths of synchronous calls: the quick way and the express way.

*Quick*: a lone cached op that its submitting thread waits for at once posts its data round
and computes the result on that thread (``_alone`` admits it, ``_quick`` runs it). *Express*:
a frontend's synchronous call of such an op skips submission altogether (``express``): no
request, entry or handle unless the round cannot be finished on the spot, when the entry is
made in the state a submission would have had and the general path goes on. Both compute with
the same functions as the peer rounds, so they give the same bits. See "Quick rounds" and "The
express way" in docs/architecture.md.

Must not change any state unless the op is taken: a call that does not qualify returns
``NOT_EXPRESS`` having done nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from horovod.common.dtypes import CODE_OF
from horovod.core import ops, pool
from horovod.core.driving import Driving
from horovod.core.handles import BareEntry, Entry, Handle, np_alloc
from horovod.core.messages import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CPU_DEVICE,
    Request,
    Response,
)
from horovod.core.numerics import fold, one_fold
from horovod.core.peer_rounds import decide_lone

# ``Engine.express``: the op did not take the express way (the caller submits it as usual).
NOT_EXPRESS: Any = object()
# How much longer than the spin time an express call waits for its peers' posts, per byte of
# its op: a peer may still be moving the previous op's bytes (1 GB/s: 16 MiB, 17 ms).
WAIT_PER_BYTE_S = 1e-9
# The most an express call waits for the engine thread to let ``drive`` go (else it submits).
DRIVE_WAIT_MAX_S = 0.001
# Lanes kept at most (by name; all are dropped past this, and remade on the next calls).
MAX_LANES = 4096


class Lane:
    """What an express call needs to know about one cached op, kept by its name from its first
    express call on (the cache lookup, the bytes each rank posts, the reduction) so that the
    calls after it only compare: the cache id still being the name's (ids are never reused, so
    the response is the same) and the call's shape, dtype, op, reduction and root being the
    lane's (the rest of the request is fixed on the express way) stand for the lookup."""

    __slots__ = (
        "op",
        "cid",
        "resp",
        "shape",
        "dtype",
        "reduce_op",
        "root",
        "sizes",
        "most",
        "count",
        "fold",
        "starts",
        "gathered",
    )

    def __init__(
        self,
        op: int,
        cid: int,
        resp: Response,
        arr: np.ndarray,
        reduce_op: int,
        root: int,
        sizes: tuple[int, ...],
        nranks: int,
    ) -> None:
        self.op, self.cid, self.resp = op, cid, resp
        self.shape, self.dtype, self.count = arr.shape, arr.dtype, arr.size
        self.reduce_op, self.root = reduce_op, root
        self.sizes, self.most = sizes, max(sizes)
        # A two-rank allreduce that is one ufunc straight into the output (``one_fold``).
        self.fold = (
            ops.UFUNCS[resp.reduce_op] if op == ALLREDUCE and one_fold(resp, nranks) else None
        )
        # An allgather's result: where each rank's block starts (bytes), and its shape.
        self.starts = [sum(sizes[:r]) for r in range(nranks)]
        self.gathered: tuple[int, ...] = ()
        if op == ALLGATHER:
            assert resp.dim0s is not None
            self.gathered = (sum(resp.dim0s[0]),) + tuple(resp.shapes[0][1:])


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of C-contiguous ``arr``, as a flat memoryview (for a post)."""
    try:
        return arr.data.cast("B")
    except (TypeError, ValueError, NotImplementedError):  # (a dtype without a buffer format)
        raw: Any = arr.reshape(-1).view(np.uint8)
        return memoryview(raw)


class ExpressPaths(Driving):
    """The quick and express layer of the engine (see the module docstring)."""

    def _alone(self, e: Entry) -> bool:
        """(Called under ``self.lock`` by the submitting thread, which waits for ``e`` at once.)
        Can ``e`` take the quick way: nothing else in flight on this rank, the engine free,
        and ``e`` a cached op of the global set small enough for a data round? Then the
        calling thread holds ``drive`` on return, and ``_quick`` runs the round."""
        if (
            self.table
            or self.unsent
            or not self.peer_rounds
            or self.board is None
            or self.timeline is not None
            or self.autotuner is not None
            or not self.fast
            or self.closing
            or self._stop_now
        ):
            return False
        req = e.request
        op = req.op
        if (
            req.ps_id != 0
            or req.device != CPU_DEVICE
            or not (
                op == ALLGATHER
                or op == BROADCAST
                or (op == ALLREDUCE and req.reduce_op in ops.UFUNCS)
            )
        ):
            return False
        if not self.drive.acquire(blocking=False):
            return False
        try:
            ss = self.sets[0]
            cid = None
            if self._may_post(op, e.array.nbytes):
                cid = ss.cache.lookup(req.name, req.signature(), ss.set_rank)
            if cid is not None:
                sizes = self._posted_by_cid.get(cid) or self._posted_sizes(cid, ss.cache.live[cid])
                if max(sizes) <= (self.round_broadcast if op == BROADCAST else self.board_data):
                    e.cid = cid
                    return True
        except BaseException:
            self.drive.release()
            raise
        self.drive.release()
        return False

    def _post_lone(
        self, cid: int, resp: Response, array: np.ndarray, alloc: Any, plane: bool = False
    ) -> tuple:
        """Post a lone op's data round (``drive`` held): its data, or an allgather's block in
        an output slot; with ``plane``, a plane round (its id only, as ``_post_round`` posts
        it). Returns (tag, output slot or -1)."""
        # (a plane round's allgather runs on the data plane, which never reads output slots)
        out = self._out_post(array, alloc, resp, cid) if resp.op == ALLGATHER and not plane else -1
        if plane or out >= 0 or (resp.op == BROADCAST and resp.root != self.rank):
            parts = []
        else:
            parts = [byte_view(array)]
        tag = self.lists_done << 1 | plane
        self.polled.board_post((cid,), parts, tag, out)
        stats = self.stats
        stats["rounds_posted"] += 1
        stats["quick_rounds"] += 1
        return tag, out

    def _quick(self, e: Entry, deadline: float) -> None:
        """A lone small cached op that the calling thread (holding ``drive``) waits for at
        once: post its data round, wait for the peers' posts until ``deadline`` and compute
        the result, without the engine's event handling (what ``submit`` and ``run_until``
        do, less their generality). Anything else arriving meanwhile (a control message, a
        submission from another thread) or a longer wait leaves the state as the general path
        would have it, and ``run_until`` (``_drive``) or the engine thread goes on from there.
        A peer that posted something else makes the round fall back to rank 0 as usual."""
        cid = e.cid
        assert cid is not None
        resp = self.sets[0].cache.live[cid]
        tag, out = self._post_lone(cid, resp, e.array, e.alloc)
        self._open_round(e, resp, cid, tag, out)
        if self._await_posts(deadline):
            self._close_round()

    def express(
        self,
        op: int,
        name: str,
        arr: np.ndarray,
        out: np.ndarray | None,
        reduce_op: int,
        root: int,
        site: Callable[[], str],
    ) -> Any:
        """A frontend's synchronous call of an op that ``_alone`` would admit, run on the
        calling thread without being submitted at all: no request, entry or handle unless the
        round cannot be finished here (the quick way still pays for all three, and for the
        frontend's checks, which cost more than the round itself on a small op).

        ``name``: the core name (``allreduce.x``); ``arr``: a C-contiguous array; ``out``: the
        result's array for an allreduce or broadcast (``arr`` itself in place, None: a new
        one), None for an allgather; ``reduce_op`` and ``root`` as in the request (SUM and -1
        where they do not apply); ``site()``: the caller's file and line, for errors.

        Returns the result, or ``NOT_EXPRESS`` when the op does not qualify: nothing happened
        then, and the caller submits it as usual (which raises for bad arguments: an op whose
        request differs from its cached response never qualifies). Whatever the quick way
        leaves to the general path (a peer slower than the spin, a control message or a
        submission from another thread arriving, a fallback to rank 0, an allgather's result,
        an error) gets its entry at that point, in the state a submission would have had, and
        goes on from there. It computes in the job's floating-point environment (``fpenv``:
        every rank computes a data round's result itself, so all of them must compute alike)."""
        if self.fp_mode.differs():  # (this thread's mode is not the job's: the call in the job's)
            return self.fp_mode.run(self.express, op, name, arr, out, reduce_op, root, site)
        if (
            self.table
            or self.unsent
            or self.express_key is not None
            or not self.express_on
            or not self.quick
            or not self.peer_rounds
            or self.board is None
            or self.timeline is not None
            or self.autotuner is not None
            or not self.fast
            or self.closing
            or self._stop_now
            or self.closed is not None
        ):
            return NOT_EXPRESS
        lane = self._lanes.get(name)
        if (
            lane is None
            or lane.cid != self.sets[0].cache.by_name.get(name)
            or lane.op != op
            or lane.shape != arr.shape
            or lane.dtype != arr.dtype
            or lane.reduce_op != reduce_op
            or lane.root != root
        ):
            lane = self._lane(op, name, arr, reduce_op, root)
            if lane is None:
                return NOT_EXPRESS
        self.express_key = (0, name)  # from here a submission under this name is refused
        # (the engine thread may hold ``drive`` for a moment more, finishing the loop that
        # ran this thread's previous op: waiting a little for it keeps a loop of large calls
        # on the express way instead of handing every call over)
        drive = self.drive
        try:
            took = not self.table and (
                drive.acquire(False)
                or (self.spin_s > 0 and drive.acquire(timeout=min(self.spin_s, DRIVE_WAIT_MAX_S)))
            )
        except BaseException:  # (interrupted while waiting: nothing happened)
            self.express_key = None
            raise
        if not took:
            self.express_key = None
            return NOT_EXPRESS
        nbytes = arr.nbytes
        resp: Response | None = None
        plane = False  # an op too large for a data round: a plane round
        try:
            if self._may_post(op, nbytes, plane=True):
                plane = (
                    lane.most > self.board_data
                    or (op == ALLREDUCE and nbytes > self.round_budget)
                    or (op == BROADCAST and nbytes > self.round_broadcast)
                )
                resp = lane.resp  # (set last: nothing after it can raise)
        finally:
            if resp is None:  # it does not qualify after all (or a check raised)
                self.express_key = None
                drive.release()
        if resp is None:
            return NOT_EXPRESS
        cid = lane.cid
        if out is None and op != ALLGATHER:
            out = pool.POOL.empty(arr.shape, arr.dtype)
        e: Entry | None = None
        board = self.board
        try:
            self._enter()
            # (a large op's peers may still be busy with the previous one, which took about
            # as long: waiting here beats handing over to the engine thread and back)
            began = time.perf_counter()
            deadline = began + self.spin_s + nbytes * WAIT_PER_BYTE_S
            if plane and self._napping:  # (twice as long as the last one took, a byte)
                self._stretch_lease(self.spin_s + 2 * nbytes * self._plane_s_per_byte)
            tag, outk = self._post_lone(cid, resp, arr, np_alloc, plane)
            self.stats["express"] += 1
            ready = self._await_posts(deadline)
            if ready:
                posts = board.read()
                if decide_lone(cid, op, tag, posts, lane.sizes) == ("plane" if plane else "data"):
                    board.open = False
                    if plane:
                        result = self._express_plane(resp, arr, out)
                        spent = time.perf_counter() - began  # (with the wait for the posts)
                        self._plane_s_per_byte = spent / (nbytes or 1)
                    else:
                        result = self._express_result(lane, arr, out, posts, outk)
                    self.express_key = None
                    self._leave(True)
                    return result
            # The general path from here, as if the op had been submitted and posted.
            e = self._express_entry(op, name, arr, out, reduce_op, root, cid, site)
            self._open_round(e, resp, cid, tag, outk)
            if ready:
                self._close_round()
        except BaseException as err:
            if e is None:
                e = self._express_entry(op, name, arr, out, reduce_op, root, cid, site)
            self._driving_failed(err)
            self._leave(e.handle.done())
            if not isinstance(err, Exception):
                raise
            return e.handle.wait()[0]
        self._drive(e.handle)
        return e.handle.wait()[0]

    def _lane(self, op: int, name: str, arr: np.ndarray, reduce_op: int, root: int) -> Lane | None:
        """The lane of a call whose op is cached with this request (kept for the next calls),
        or None: not cached (so not for the express way)."""
        code = CODE_OF.get(arr.dtype)
        if code is None:
            return None
        ss = self.sets[0]
        cache = ss.cache
        sig = (op, code, arr.shape, reduce_op, root, 1.0, 1.0, CPU_DEVICE, None)
        cid = cache.lookup(name, sig, ss.set_rank)
        if cid is None:
            return None
        resp = cache.live[cid]
        sizes = self._posted_by_cid.get(cid) or self._posted_sizes(cid, resp)
        lanes = self._lanes
        if len(lanes) >= MAX_LANES:
            lanes.clear()
        lane = lanes[name] = Lane(op, cid, resp, arr, reduce_op, root, sizes, self.size)
        return lane

    def _express_entry(
        self,
        op: int,
        name: str,
        arr: np.ndarray,
        out: np.ndarray | None,
        reduce_op: int,
        root: int,
        cid: int,
        site: Callable[[], str],
    ) -> Entry:
        """The entry (and handle) that submitting an express op would have made, in the table
        (or failed at once if the table is closed meanwhile)."""
        where = site()
        handle = Handle(1, where)
        if self.fast:
            handle.driver = self.run_until
        code = CODE_OF[arr.dtype]
        req = Request(
            0, name, op, code, arr.shape, reduce_op, root, 1.0, 1.0, CPU_DEVICE, -1, site=where
        )
        e = Entry(req, arr, out, handle)
        e.cid = cid
        with self.lock:
            if self.closed is not None:
                handle._complete(0, error=self.closed)
            else:
                self.table[(0, name)] = e
            self.express_key = None
        return e

    def _express_result(
        self, lane: Lane, arr: np.ndarray, out: Any, posts: list[tuple], outk: int
    ) -> np.ndarray:
        """An express call's result from its data round's ``posts`` (``outk``: this rank's
        output slot holding its block of an allgather, or -1), as ``_run_round`` computes it
        (the same bits)."""
        stats = self.stats
        stats["rounds_run"] += 1
        stats["data_rounds"] += 1
        stats["responses"] += 1
        stats["responses_run_by_caller"] += 1
        op = lane.op
        fold_into = lane.fold
        if fold_into is not None:  # two ranks' allreduce: one ufunc, rank 0's part first
            stats["eager_responses"] += 1
            peer = np.frombuffer(posts[0][3], lane.dtype, lane.count)
            if self.rank == 0:
                fold_into(arr.ravel(), peer, out=out.ravel())
            else:
                fold_into(peer, arr.ravel(), out=out.ravel())
            return out  # type: ignore[no-any-return]
        me = self.rank
        if op == BROADCAST:
            root = lane.root
            if root != me:
                for r, _, _, d, _ in posts:
                    if r == root:
                        byte_view(out)[:] = d
            elif out is not arr:
                np.copyto(out, arr)
            return out  # type: ignore[no-any-return]
        if op == ALLGATHER and outk < 0:
            for post in posts:
                if post[4] >= 0:
                    break  # (a peer's block in its output slot: below)
            else:
                res = np_alloc(lane.gathered, lane.dtype)
                flat = byte_view(res)
                starts, sizes = lane.starts, lane.sizes
                at = starts[me]
                flat[at : at + sizes[me]] = byte_view(arr)
                for r, _, _, d, _ in posts:
                    at = starts[r]
                    flat[at : at + sizes[r]] = d
                return res
        n = self.size
        resp = lane.resp
        data: list[Any] = [None] * n
        outs = [-1] * n
        for r, _, _, d, o in posts:
            data[r] = d
            outs[r] = o
        if op == ALLGATHER:
            outs[me] = outk
            res = self._gathered(resp, arr, np_alloc, data, [0] * n, outs)
            self._out_done(outs)
            return res
        stats["eager_responses"] += 1
        mine = arr.reshape(-1)
        parts = [mine if d is None else np.frombuffer(d, mine.dtype, mine.size) for d in data]
        np.copyto(out.reshape(-1), fold(parts, resp, n))
        return out  # type: ignore[no-any-return]

    def _express_plane(self, resp: Response, arr: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """An express op's plane round, decided: run it on the data plane (an allreduce or a
        broadcast into ``out``, an allgather into a new array) as ``_run_plane_round`` would
        run the op's entry (the same response, buffers and algorithm: the same bits), without
        one."""
        stats = self.stats
        stats["rounds_run"] += 1
        stats["responses"] += 1
        stats["responses_run_by_caller"] += 1
        stats["express_plane"] += 1
        ss = self.sets[0]
        assert ss.view is not None
        res = ops.execute(resp, [cast(Entry, BareEntry(arr, out))], ss.view, self.buffers)
        return res[0]  # type: ignore[return-value]
