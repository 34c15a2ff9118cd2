"""The engine: one background thread per rank that turns named requests into collectives.

Flow (upstream's design, event-driven instead of polled):

1. ``submit()`` (framework thread) checks the name is not in flight, records the entry and wakes
   the engine.
2. The engine sends the request to the coordinator (global rank 0) over the control channel —
   as a cache id when this rank's request equals the cached one — or, on rank 0, hands it over
   directly.
3. The coordinator collects requests per (process set, name). When every non-joined member has
   submitted a name, it validates that they agree (op, dtype, shape, reduce op, scale factors,
   root, device), builds a response (an error response naming the ranks and values if they do
   not), fuses compatible responses up to the fusion threshold, and sends the ordered list to
   every rank. A round starts at once unless other tensors are partially submitted (more work
   is on its way): then ready responses wait up to ``HOROVOD_CYCLE_TIME`` ms for them, so
   bursts of gradients are fused while a lone or sequential op never waits for a tick.
4. Every rank executes the list in order (``ops.execute``) and completes the handles. Because
   one coordinator orders the responses of every process set, any two ranks run their common
   collectives in the same order: no cross-set deadlock, no interleaved streams.

Failures never hang: a rank whose connection drops, a data-plane error, or a stall past the
shutdown limit makes the coordinator broadcast an abort naming the rank at fault; every rank then
fails its pending and later collectives with that message. A rank calling ``shutdown()`` makes
every rank stop after the responses already decided.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from horovod.common.dtypes import CODE_OF, DTYPE_OF_CODE, NAME_OF_CODE
from horovod.common.exceptions import HorovodInternalError, TransportError, shutdown_message
from horovod.common.log import logger
from horovod.core import ops, pool
from horovod.core.autotune import Autotuner
from horovod.core.cache import ResponseCache
from horovod.core.diagnose import (
    WaitStats,
    capture_stacks,
    format_stacks,
    main_stack,
    where,
)
from horovod.core.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    AVERAGE,
    BARRIER,
    BROADCAST,
    CACHEABLE,
    CPU_DEVICE,
    ERROR,
    FUSIBLE,
    JOIN,
    OP_NAMES,
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
    REDUCE_NAMES,
    REDUCESCATTER,
    Request,
    Response,
    decode,
    display_name,
    encode,
)
from horovod.core.timeline import Timeline
from horovod.transport.base import SubTransport, Transport
from horovod.transport.shm import BOARD_DATA, BOARD_IDS, OUT_MIN, _fence

DUPLICATE_NAME = (
    "{what} is already in flight on this rank under the name '{name}'; a name may be used by only "
    "one pending collective at a time. Wait for the first one (synchronize its handle) or pass a "
    "different name=."
)


# ``Engine.express``: the op did not take the express way (the caller submits it as usual).
NOT_EXPRESS: Any = object()

MAX_SLEEP_S = 1.0  # longest sleep of the coordinator's engine thread on shared-memory jobs
LEASE_MAX_S = 0.001  # longest that a waiting thread's engine lease outlives its wait
# Longest that a rank with nothing in flight leaves a peer's round unanswered (waiting to post
# the same ops itself: ranks of a training job reach their gradients at slightly different
# times). Capped at a tenth of the stall-check time, so stalls still reach rank 0 early.
ANSWER_WAIT_MAX_S = 0.5


class Handle:
    """Completion of one submitted op (several entries for a grouped op). The event that a
    blocked waiter sleeps on is created only when somebody has to block (a thread that runs
    the engine itself usually finds the handle done)."""

    __slots__ = (
        "_event",
        "_left",
        "_done",
        "results",
        "error",
        "callsite",
        "_lock",
        "finish",
        "driver",
    )

    def __init__(
        self, n: int, callsite: str = "", finish: Callable[[list[Any]], Any] | None = None
    ) -> None:
        self._event: threading.Event | None = None
        self._left = n
        self._done = n == 0
        self._lock = threading.Lock()
        self.results: list[Any] = [None] * n
        self.error: str | None = None
        self.callsite = callsite
        self.finish = finish
        self.driver: Callable[[Handle], None] | None = None  # runs the engine until done

    def done(self) -> bool:
        return self._done

    def _complete(self, index: int, result: Any = None, error: str | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            else:
                self.results[index] = result
            self._left -= 1
            if self._left == 0:
                self._done = True
                if self._event is not None:
                    self._event.set()

    def wait(self) -> list[Any]:
        if not self._done:
            if self.driver is not None:
                self.driver(self)
            if not self._done:
                with self._lock:
                    if self._event is None:
                        self._event = threading.Event()
                    if self._done:
                        self._event.set()
                while not self._event.wait(0.5):
                    pass
        if self.error is not None:
            where = f"\n  (this rank submitted it at {self.callsite})" if self.callsite else ""
            raise HorovodInternalError(self.error + where)
        return self.results


class Entry:
    """One tensor of one submitted op, as the engine tracks it."""

    __slots__ = ("request", "array", "output", "splits", "handle", "index", "alloc", "cid")

    def __init__(
        self,
        request: Request,
        array: np.ndarray | None,
        output: np.ndarray | None,
        handle: Handle,
        index: int = 0,
        splits: list[int] | None = None,
        alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
    ) -> None:
        self.request = request
        self.array: Any = array  # None only for barrier, join and process-set requests
        self.output: Any = output
        self.splits: list[int] = splits or []
        self.handle = handle
        self.index = index
        self.alloc = alloc or _np_alloc
        self.cid: int | None = None

    @property
    def key(self) -> tuple[int, str]:
        return (self.request.ps_id, self.request.name)


class _Bare:
    """What ``ops.execute`` reads of an allreduce's entry: its array and its output."""

    __slots__ = ("array", "output")

    def __init__(self, array: np.ndarray, output: np.ndarray) -> None:
        self.array = array
        self.output = output


def _np_alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return pool.POOL.empty(shape, dtype)


class SetState:
    """A process set as the engine sees it."""

    def __init__(
        self,
        ps_id: int,
        ranks: Sequence[int],
        transport: Transport,
        cache_capacity: int,
        coordinator: bool,
    ) -> None:
        self.id = ps_id
        self.ranks = list(ranks)
        self.member = transport.rank in self.ranks
        view: Transport | SubTransport | None = None
        if self.member:
            # The set of all ranks needs no translation of ranks: run on the transport itself.
            identity = self.ranks == list(range(transport.size))
            view = transport if identity else SubTransport(transport, self.ranks)
        self.view = view
        self.set_rank = self.ranks.index(transport.rank) if self.member else -1
        self.cache = ResponseCache(
            cache_capacity, keep_evicted=4 * cache_capacity if coordinator else 0
        )


class Engine:
    def __init__(
        self,
        rank: int,
        size: int,
        transport: Transport,
        *,
        fusion_threshold: int,
        cycle_time_ms: float,
        cache_capacity: int,
        disable_group_fusion: bool = False,
        stall_check_seconds: float = 60.0,
        stall_shutdown_seconds: float = 0.0,
        process_sets: Sequence[Sequence[int]] = (),
        clock: Callable[[], float] = time.monotonic,
        main_ident: int | None = None,
        other_threads: bool = False,
        stack_signal_pids: dict[int, int] | None = None,
        wait_summary_seconds: float = 0.0,
        on_fatal_report: Callable[[str], None] | None = None,
        timeline: Timeline | None = None,
        autotuner: Autotuner | None = None,
        eager_bytes: int = 0,
        peer_rounds: bool = True,
    ) -> None:
        self.rank, self.size, self.transport = rank, size, transport
        # Cache-hit allreduces of at most this many bytes per rank travel with their requests
        # and come back reduced in the response list (see "Eager allreduce" in the docs).
        self.eager_bytes = eager_bytes
        self.fusion_threshold = fusion_threshold
        self.cycle_s = cycle_time_ms / 1000.0
        self.cache_capacity = cache_capacity
        self.disable_group_fusion = disable_group_fusion
        self.clock = clock
        self.main_ident = main_ident  # the thread that called hvd.init() (for stacks)
        self.other_threads = other_threads  # report the application's other threads too
        self.stack_signal_pids = stack_signal_pids or {}
        self.on_fatal_report = on_fatal_report or (lambda text: None)
        self.timeline = timeline  # only ever set on rank 0
        self.autotuner = autotuner  # only ever set on rank 0
        self.inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.table: dict[tuple[int, str], Entry] = {}
        self.unsent = 0  # entries in the table that the engine has not picked up yet
        self.running: list[Entry | None] = []  # entries of the response being executed
        self.lock = threading.Lock()
        self.closed: str | None = None  # set once: why no more work is accepted
        self.closing = False  # a clean shutdown is under way
        self.buffers = ops.Buffers()
        self.sets: dict[int, SetState] = {}
        self.stats = {
            "cycles": 0,
            "responses": 0,
            "fused_responses": 0,
            "cache_hits_sent": 0,
            "requests_sent": 0,
            "responses_run_by_caller": 0,  # executed by a waiting application thread
            "eager_sent": 0,  # cache hits sent with their data
            "eager_responses": 0,  # responses that arrived reduced (no data-plane round)
            "rounds_posted": 0,  # peer rounds this rank posted ops to
            "rounds_run": 0,  # ... that every rank posted the same to (run without rank 0)
            "quick_rounds": 0,  # ... posted by a waiting thread for a lone op (``_quick``)
            "express": 0,  # ... of those, synchronous calls that were never submitted
            "express_plane": 0,  # ... of those, allreduces run on the data plane
            "slot_outputs": 0,  # allgather results built in this rank's output slots
        }
        self._register(0, range(size))
        for i, ranks in enumerate(process_sets, start=1):
            self._register(i, ranks)
        self.coordinator = (
            _Coordinator(
                self,
                stall_check_seconds,
                stall_shutdown_seconds,
                first_free=len(process_sets) + 1,
                wait_summary_seconds=wait_summary_seconds,
            )
            if rank == 0
            else None
        )
        self._shutdown_asked = False
        # Shared-memory transports let the thread that waits for a result run the engine
        # itself (no hand-off to the engine thread and back); ``drive`` is held by whichever
        # thread runs it. See docs/architecture.md, "Who runs the engine".
        self.fast = callable(getattr(transport, "poll_fast", None))
        self.drive = threading.Lock()
        self.spin_s = float(getattr(transport, "spin_s", 0.0))
        self._yield = bool(getattr(transport, "oversubscribed", False))
        self._sleeping = False  # the engine thread is blocked in transport.sleep()
        self._kicked = False  # ... and has been kicked since it last woke
        self._sleep_until: float | None = None
        self._stop_now = False
        # A thread that has just run the engine to completion is likely back in a moment (a loop
        # of synchronous calls). Until ``_lease_until`` the engine thread leaves the work to it,
        # and this rank keeps telling its same-host peers that a thread polls actively, so they
        # do not pay a wake-up datagram (a system call on their critical path, and a thread
        # woken here for nothing). When the lease runs out the engine thread takes over.
        self.lease_s = min(10 * self.spin_s, LEASE_MAX_S)
        self._lease_until = 0.0
        # Only a thread that came back within a lease of the last one leaving gets a lease
        # (a loop of calls): granting one costs a kick of the sleeping engine thread, which
        # then wakes twice for nothing, in the middle of a training step's compute.
        self._left_at = float("-inf")
        self._back_soon = False
        # Peer rounds (every rank on this host, see "Peer rounds" in docs/architecture.md):
        # a lone small cache-hit allreduce is posted to every peer instead of rank 0, and run
        # by every rank itself once all of them posted the same.
        # Every rank with a board answers its peers' rounds, even one that posts none itself
        # (HOROVOD_PEER_ROUNDS and the eager budget need not agree between ranks).
        self.board = getattr(transport, "board", None)
        self.peer_rounds = peer_rounds
        # Small allreduces, allgathers and broadcasts post their data and every rank computes
        # the results from the posts ("data" rounds); other cached ops post only their ids
        # and run on the data plane ("plane" rounds).
        self.round_budget = min(eager_bytes, BOARD_DATA)
        # A lone small cached op that its thread waits for at once runs its data round on
        # that thread without the engine's event handling (``_quick``).
        self.quick = True
        # ... and the frontends' synchronous calls of such ops skip submission altogether
        # (``express``); ``express_key`` is the table key of the one in progress, if any.
        self.express_on = True
        self.express_key: tuple[int, str] | None = None
        self.round_items: list[tuple[Entry, Response]] = []  # this rank's post, if open
        self.round_cids: list[int] = []
        self.round_tag = 0
        self.round_totals: list[int] = []  # bytes each rank posts in this rank's data round
        self.round_out = -1  # the output slot that holds this rank's block of its round, if any
        # Bytes each rank posts for a cached op in a data round, by cache id (ids are never
        # reused, so entries never go stale; cleared now and then to bound the memory).
        self._posted_by_cid: dict[int, tuple[int, ...]] = {}
        # Response lists processed so far (every rank processes the same lists in the same
        # order). A plane round runs only where every rank posted at the same count, and a
        # rank holds back the lists that arrive after its plane post until the round is
        # decided, so every pair of ranks meets the round at the same place in its channels.
        self.lists_done = 0
        self.held: list[tuple] = []
        if stall_check_seconds > 0:
            self.answer_wait_s = min(ANSWER_WAIT_MAX_S, stall_check_seconds / 10)
        else:
            self.answer_wait_s = ANSWER_WAIT_MAX_S
        self.answer_by = 0.0
        self.round_warn_s = stall_check_seconds
        self.round_warn_at = 0.0
        self.round_posted_at = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"horovod-engine-{rank}", daemon=True
        )

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        self.transport.start_ctrl(self._on_ctrl)
        self._thread.start()

    def submit(self, entries: Sequence[Entry], wake: bool = True) -> None:
        """Queue ``entries``. ``wake=False``: the calling thread is about to wait for them,
        so a sleeping engine thread is not woken (the waiting thread runs the engine)."""
        with self.lock:
            if self.closed is not None:
                raise HorovodInternalError(self.closed)
            table = self.table
            keys = [e.key for e in entries]
            seen: set[tuple[int, str]] = set()
            for e, k in zip(entries, keys, strict=True):
                if k in table or k in seen or k == self.express_key:
                    raise ValueError(
                        DUPLICATE_NAME.format(
                            what=display_name(e.request.op, e.request.name).split(" ")[0],
                            name=e.request.name,
                        )
                    )
                seen.add(k)
            driver = self.run_until if self.fast else None
            quick = not wake and self.quick and len(entries) == 1 and self._alone(entries[0])
            for e, k in zip(entries, keys, strict=True):
                table[k] = e
                e.handle.driver = driver
            if not quick:
                self.unsent += len(entries)
        if quick:
            self._drive(entries[0].handle, entries[0])
        elif wake:
            self._post(("sub", entries))
        else:  # the caller waits at once and runs the engine itself (Handle.wait)
            self.inbox.put(("sub", entries))

    def wake(self) -> None:
        """Make sure a sleeping engine thread looks at the inbox."""
        if self.fast and self._sleeping:
            self._kick()

    def _kick(self) -> None:
        """Wake the sleeping engine thread: one datagram until it has woken (a thread that
        ends ops faster than the engine thread gets a core would otherwise send one per op)."""
        if not self._kicked:
            self._kicked = True
            self.transport.kick()  # type: ignore[attr-defined]

    def _post(self, ev: tuple) -> None:
        self.inbox.put(ev)
        if self.fast and self._sleeping:
            self._kick()

    def stop(self, why: str, timeout: float) -> None:
        """Clean shutdown of this rank (propagates to every rank)."""
        if self._thread.is_alive():
            self._post(("shutdown", f"rank {self.rank} {why}"))
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._abort(f"rank {self.rank} could not shut down cleanly within {timeout:g} s")
                self._thread.join(5)
        self._close_table(shutdown_message(f"rank {self.rank} {why}"))
        self.transport.close()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def register_local(self, ps_id: int, ranks: Sequence[int]) -> None:
        self._register(ps_id, ranks)

    def process_set_ids(self) -> list[int]:
        return sorted(self.sets)

    # ------------------------------------------------------------------ control channel
    def _on_ctrl(self, peer: int, payload: bytes | None) -> None:
        """Runs on a transport thread; must not block."""
        if payload is None:
            if self.closing or self.closed is not None:
                return
            if self.fast and self.transport.is_fast(peer):  # type: ignore[attr-defined]
                # Its last messages (e.g. a shutdown) may still sit in shared memory: judge
                # the loss after reading them, on the thread that runs the engine.
                self._post(("lost", peer))
                return
            self._lost(peer)
            return
        self._on_msg(peer, payload)

    def _lost(self, peer: int) -> None:
        if self.closing or self.closed is not None:
            return
        if self.rank == 0:
            reason = (
                f"rank {peer} exited or lost its connection to the coordinator before "
                "calling shutdown(); it crashed, was killed, or its host went away"
            )
        else:
            reason = (
                "rank 0 (the coordinator) exited or lost its connection before calling "
                "shutdown(); it crashed, was killed, or its host went away"
            )
        self._abort(reason)

    def _on_msg(self, peer: int, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except Exception as e:  # a peer that proved the secret but sent nonsense
            self._abort(f"rank {peer} sent a malformed control message ({e})")
            return
        if msg[0] == "X":  # abort broadcast by the coordinator
            self._abort(str(msg[1]), broadcast=False)
            return
        if msg[0] == "STACK?":  # the hang doctor asks where this rank is: answer at once
            stacks = capture_stacks(self.main_ident, self.other_threads)
            try:
                self.transport.send_ctrl(0, encode(("STACK", msg[1], stacks)))
            except Exception:
                pass
            return
        if msg[0] == "P" and msg[2] is not None:
            self.closing = True  # a clean shutdown follows; the connection will drop
        self._post(("ctl", peer, msg))

    def _abort(self, reason: str, broadcast: bool = True) -> None:
        """Stop this rank's collectives with ``reason``; on the coordinator, tell every rank."""
        with self.lock:
            first = self.closed is None
            if first:
                self.closed = reason
        if not first:
            return
        if broadcast:
            if self.rank == 0:
                wire = encode(("X", reason))
                for p in range(1, self.size):
                    try:
                        self.transport.send_ctrl(p, wire)
                    except Exception:
                        pass
            else:
                try:
                    self.transport.send_ctrl(0, encode(("A", reason)))
                except Exception:
                    pass
        self.transport.abort(reason)
        self._post(("abort", reason))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self.fast:
            self._run_fast()
            return
        try:
            while True:
                timeout = self._timeout()
                try:
                    batch = [
                        self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
                    ]
                except queue.Empty:
                    batch = []
                while True:
                    try:
                        batch.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle(batch):
                    break
        except TransportError as e:
            self._abort(str(e))
        except Exception as e:  # a bug must not hang the job: fail loudly on every rank
            logger.error("engine failure on rank %d:\n%s", self.rank, traceback.format_exc())
            self._abort(f"internal error on rank {self.rank}: {type(e).__name__}: {e}")
        finally:
            self._close_table(self.closed or shutdown_message())

    # ---------------------------------------------------------- shared-memory mode
    def _collect(self) -> list[tuple]:
        """Events for the thread running the engine: control messages from same-host ranks
        (read from shared memory), then everything posted to the inbox."""
        batch: list[tuple] = []
        for peer, payload in self.transport.poll_fast():  # type: ignore[attr-defined]
            try:
                msg = decode(payload)
            except Exception as e:
                self._abort(f"rank {peer} sent a malformed control message ({e})")
                continue
            if msg[0] == "P" and msg[2] is not None:
                self.closing = True
            batch.append(("ctl", peer, msg))
        if self.board is not None and self.board.due():
            batch.append(("round",))
        inbox = self.inbox
        while not inbox.empty():
            try:
                batch.append(inbox.get_nowait())
            except queue.Empty:
                break
        return batch

    def _busy(self) -> bool:
        return not self.inbox.empty() or self._stop_now

    def _run_fast(self) -> None:
        t = self.transport
        clock = time.perf_counter
        try:
            while not self._stop_now:
                lease = self._lease_until - clock()
                if lease > 0 and not self._busy():
                    # A waiting thread ran the engine a moment ago and will most likely be
                    # back: leave the work to it until its lease ends (a kick ends this early).
                    self._sleep_until = time.monotonic() + lease
                    self._sleeping = True
                    try:
                        if not self._busy():
                            t.nap(lease)  # type: ignore[attr-defined]
                    finally:
                        self._sleeping = False
                        self._kicked = False
                    continue
                with self.drive:
                    if self._stop_now:
                        break
                    if not self._handle(self._collect()):
                        break
                    timeout = self._timeout()
                    if timeout == 0 or self._busy():
                        continue
                    if self._lease_until > clock():
                        continue  # a thread ran the engine meanwhile: its lease starts again
                    # No lease: peers must wake this thread from now on (set before the
                    # sleep's last look at the rings, so no message slips in between).
                    t.set_driving(False)  # type: ignore[attr-defined]
                    if self.coordinator is not None:
                        # Wake at least every second: a thread that runs the engine need not
                        # kick this one for far timers (stall checks), only for near ones.
                        timeout = MAX_SLEEP_S if timeout is None else min(timeout, MAX_SLEEP_S)
                    self._sleep_until = None if timeout is None else time.monotonic() + timeout
                    self._sleeping = True
                try:
                    t.sleep(timeout, self._busy)  # type: ignore[attr-defined]
                finally:
                    self._sleeping = False
                    self._kicked = False
        except TransportError as e:
            self._abort(str(e))
        except Exception as e:
            logger.error("engine failure on rank %d:\n%s", self.rank, traceback.format_exc())
            self._abort(f"internal error on rank {self.rank}: {type(e).__name__}: {e}")
        finally:
            self._stop_now = True
            self._close_table(self.closed or shutdown_message())

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
        if req.ps_id != 0 or not (
            op == ALLGATHER or op == BROADCAST or (op == ALLREDUCE and req.reduce_op in ops.UFUNCS)
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
                if max(sizes) <= BOARD_DATA:
                    e.cid = cid
                    return True
        except BaseException:
            self.drive.release()
            raise
        self.drive.release()
        return False

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
            and self.transport.ctrl_idle()  # type: ignore[attr-defined]
            and self.sets[0].cache.enabled
            and (plane or op != ALLREDUCE or nbytes <= self.round_budget)
            and (self.coordinator is None or not self.coordinator.paused)
            and (not board.opened() or max(board.tags()) >> 1 <= self.lists_done)
        )

    def _post_lone(
        self, cid: int, resp: Response, array: np.ndarray, alloc: Any, plane: bool = False
    ) -> tuple:
        """Post a lone op's data round (``drive`` held): its data, or an allgather's block in
        an output slot; with ``plane``, a plane round (its id only, as ``_post_round`` posts
        it). Returns (tag, output slot or -1)."""
        out = self._out_post(array, alloc, resp, cid) if resp.op == ALLGATHER else -1
        if plane or out >= 0 or (resp.op == BROADCAST and resp.root != self.rank):
            parts = []
        else:
            raw: Any = array.reshape(-1).view(np.uint8)
            parts = [memoryview(raw)]
        tag = self.lists_done << 1 | plane
        self.transport.board_post((cid,), parts, tag, out)  # type: ignore[attr-defined]
        stats = self.stats
        stats["rounds_posted"] += 1
        stats["quick_rounds"] += 1
        return tag, out

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
        t = self.transport
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
                or not t.ctrl_idle()  # type: ignore[attr-defined]
                or t.aborted is not None  # type: ignore[attr-defined]
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
        sizes = memo[cid] = tuple(_posted(resp, r) for r in range(self.size))
        return sizes

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
        goes on from there."""
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
        code = CODE_OF.get(arr.dtype)
        if code is None:
            return NOT_EXPRESS
        ss = self.sets[0]
        cache = ss.cache
        sig = (op, code, arr.shape, reduce_op, root, 1.0, 1.0, CPU_DEVICE, None)
        cid = cache.lookup(name, sig, ss.set_rank)
        if cid is None:
            return NOT_EXPRESS
        self.express_key = (0, name)  # from here a submission under this name is refused
        if self.table or not self.drive.acquire(blocking=False):
            self.express_key = None
            return NOT_EXPRESS
        resp: Response | None = None
        plane = False  # an allreduce too large for a data round: a plane round
        try:
            if self._may_post(op, arr.nbytes, plane=op == ALLREDUCE):
                live = cache.live[cid]
                sizes = self._posted_by_cid.get(cid) or self._posted_sizes(cid, live)
                data = max(sizes) <= BOARD_DATA and (
                    op != ALLREDUCE or arr.nbytes <= self.round_budget
                )
                if data or op == ALLREDUCE:
                    plane = not data
                    resp = live  # (set last: nothing after it can raise)
        finally:
            if resp is None:  # it does not qualify after all (or a check raised)
                self.express_key = None
                self.drive.release()
        if resp is None:
            return NOT_EXPRESS
        if out is None and op != ALLGATHER:
            out = pool.POOL.empty(arr.shape, arr.dtype)
        e: Entry | None = None
        board = self.board
        try:
            self._enter()
            deadline = time.perf_counter() + self.spin_s
            tag, outk = self._post_lone(cid, resp, arr, _np_alloc, plane)
            self.stats["express"] += 1
            ready = self._await_posts(deadline)
            if ready:
                posts = board.read()
                if _decide([(None, resp)], [cid], tag, posts, sizes) == (
                    "plane" if plane else "data"
                ):
                    board.open = False
                    if plane:
                        assert out is not None  # (made above for an allreduce)
                        result = self._express_plane(resp, arr, out)
                    else:
                        result = self._express_result(op, resp, arr, out, posts, outk)
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
        self, op: int, resp: Response, arr: np.ndarray, out: Any, posts: list[tuple], outk: int
    ) -> np.ndarray:
        """An express call's result from its data round's ``posts`` (``outk``: this rank's
        output slot holding its block of an allgather, or -1), as ``_run_round`` computes it
        (the same bits)."""
        me, n = self.rank, self.size
        stats = self.stats
        stats["rounds_run"] += 1
        stats["responses"] += 1
        stats["responses_run_by_caller"] += 1
        data: list[Any] = [None] * n
        outs = [-1] * n
        for r, _, _, d, o in posts:
            data[r] = d
            outs[r] = o
        if op == ALLGATHER:
            outs[me] = outk
            res = self._gathered(resp, arr, _np_alloc, data, [0] * n, outs)
            self._out_done(outs)
            return res
        if op == BROADCAST:
            return self._broadcasted(resp, arr, out, data, [0] * n)
        stats["eager_responses"] += 1
        mine = arr.reshape(-1)
        parts = [mine if d is None else np.frombuffer(d, mine.dtype, mine.size) for d in data]
        flat = out.reshape(-1)
        if _one_fold(resp, n):
            ops.UFUNCS[resp.reduce_op](parts[0], parts[1], out=flat)
        else:
            np.copyto(flat, _fold(parts, resp, n))
        return out  # type: ignore[no-any-return]

    def _express_plane(self, resp: Response, arr: np.ndarray, out: np.ndarray) -> np.ndarray:
        """An express allreduce's plane round, decided: run it on the data plane into
        ``out`` as ``_run_plane_round`` would run the op's entry (the same response, buffers
        and algorithm: the same bits), without one."""
        stats = self.stats
        stats["rounds_run"] += 1
        stats["responses"] += 1
        stats["responses_run_by_caller"] += 1
        stats["express_plane"] += 1
        ss = self.sets[0]
        assert ss.view is not None
        ops.execute(resp, [cast(Entry, _Bare(arr, out))], ss.view, self.buffers)
        return out

    def run_until(self, handle: Handle) -> None:
        """Run the engine on the calling thread until ``handle`` completes, as long as there is
        work or for up to the spin time without any; then leave it to the engine thread."""
        if self._stop_now or not self.drive.acquire(blocking=False):
            return
        self._drive(handle)

    def _drive(self, handle: Handle, quick: Entry | None = None) -> None:
        """``run_until`` with ``drive`` held; ``quick``: first run this entry's data round
        the quick way (``_quick``)."""
        self.transport.set_driving(True)  # type: ignore[attr-defined]
        clock = time.perf_counter
        try:
            deadline = clock() + self.spin_s
            if quick is not None:
                self._quick(quick, deadline)
                if handle.done():
                    return
            due = self._timeout()
            timer = clock() + due if due is not None else float("inf")
            while not handle.done() and not self._stop_now:
                batch = self._collect()
                now = clock()
                if batch or now >= timer:
                    if not self._handle(batch):
                        self._stop_now = True
                        break
                    if handle.done():
                        break
                    due = self._timeout()
                    now = clock()
                    timer = now + due if due is not None else float("inf")
                    deadline = now + self.spin_s
                elif now > deadline:
                    break
                elif self._yield:
                    os.sched_yield()  # more ranks than cores: let the one we wait for run
        except BaseException as e:
            self._driving_failed(e)
            if not isinstance(e, Exception):
                raise
        finally:
            self._leave(handle.done())

    def _driving_failed(self, err: BaseException) -> None:
        """``err`` escaped while a waiting thread ran the engine: abort the job with its
        reason (a transport error's, an internal error logged with its traceback, or an
        interrupt: KeyboardInterrupt, SystemExit, possibly mid-collective)."""
        if isinstance(err, TransportError):
            self._abort(str(err))
        elif isinstance(err, Exception):
            logger.error("engine failure on rank %d:\n%s", self.rank, traceback.format_exc())
            self._abort(f"internal error on rank {self.rank}: {type(err).__name__}: {err}")
        else:
            self._abort(
                f"rank {self.rank} was interrupted ({type(err).__name__}) while running a "
                "collective; its collectives cannot continue"
            )

    def _enter(self) -> None:
        """(``drive`` held.) A waiting thread starts running the engine: peers need not wake
        the engine thread meanwhile. Did it come back within a lease of the last one leaving?"""
        self._back_soon = time.perf_counter() - self._left_at < self.lease_s
        self.transport.set_driving(True)  # type: ignore[attr-defined]

    def _leave(self, done: bool) -> None:
        """Release ``drive`` after running the engine on a waiting thread (``done``: its
        handle completed)."""
        t = self.transport
        self._left_at = now = time.perf_counter()
        if done and self._back_soon and not self._stop_now:  # (never with no lease time)
            # Done, and this thread came back quickly the last time: it is probably back
            # soon again (a loop of synchronous calls). It keeps the engine for a short
            # lease: "driving" stays published, and the engine thread leaves new work to it
            # until the lease ends. (A thread that comes back only after a training step's
            # compute gets none: the engine thread would be kicked and woken for nothing.)
            self._lease_until = now + self.lease_s
            _fence()
            self.drive.release()
            if self._sleeping:
                until = self._sleep_until
                if until is None or until > time.monotonic() + 2 * self.lease_s:
                    # It sleeps past the lease's end and would not take over then.
                    self._kick()
                elif self._busy():
                    self._kick()
        else:
            # Gave up waiting (or stopping): the engine thread takes over at once.
            self._lease_until = 0.0
            t.set_driving(False)  # type: ignore[attr-defined]
            _fence()
            self.drive.release()
            self._after_drive(force=not done)

    def _after_drive(self, force: bool = False) -> None:
        """The engine thread may be asleep with a deadline set before this thread ran the
        engine: wake it if there is work now or a timer it does not know about."""
        if not self._sleeping:
            return
        t = self.transport
        due = self._timeout()
        wake = force or self._stop_now or self._busy() or t.fast_pending()  # type: ignore[attr-defined]
        if not wake and due is not None:
            until = self._sleep_until
            wake = until is None or time.monotonic() + due < until
        if wake:
            self._kick()

    def _send(self, peer: int, payload: bytes) -> None:
        """Engine-to-engine messages: through shared memory when the peer shares this host."""
        if self.fast:
            self.transport.send_fast(peer, payload)  # type: ignore[attr-defined]
        else:
            self.transport.send_ctrl(peer, payload)

    def _timeout(self) -> float | None:
        if self.closed is not None:
            return 0
        due = self.coordinator.timeout() if self.coordinator is not None else None
        if self._shutdown_asked:
            due = 1.0 if due is None else min(due, 1.0)
        if self.round_items and self.round_warn_s > 0:
            left = max(0.0, self.round_warn_at - self.clock())
            due = left if due is None else min(due, left)
        board = self.board
        if board is not None and board.deferred:
            left = max(0.0, self.answer_by - self.clock())
            due = left if due is None else min(due, left)
        return due

    def _handle(self, batch: list[tuple]) -> bool:
        """Process one batch of events; False when the engine must stop."""
        lists: list[tuple] = []
        submitted: list[Entry] = []
        for ev in batch:
            kind = ev[0]
            if kind == "sub":
                submitted.extend(ev[1])
                with self.lock:
                    self.unsent -= len(ev[1])
            elif kind == "ctl":
                peer, msg = ev[1], ev[2]
                if self.coordinator is not None:
                    self.coordinator.on_message(peer, msg)
                elif msg[0] == "P":
                    lists.append(msg)
                elif msg[0] == "RESEND":
                    self._resend(msg[1])
            elif kind == "shutdown":
                self.closing = True
                if self.coordinator is not None:
                    if self.coordinator.shutdown_why is None:
                        self.coordinator.shutdown_why = ev[1]
                elif not self._shutdown_asked:
                    self._shutdown_asked = True
                    self._send(0, encode(("S", ev[1])))
            elif kind == "lost":
                self._lost(ev[1])
            elif kind == "abort":
                return False
        if self.closed is not None:
            return False
        if submitted:
            self._send_requests(submitted)
        board = self.board
        if board is not None:
            if board.due() or self.round_items or board.deferred:
                self._round_step()
            if self.round_tag & 1 and self.round_items:
                # A plane round of this rank is open: lists wait until it is decided (rank
                # 0 emits none meanwhile), so the round runs at the same place everywhere.
                if self.coordinator is not None:
                    self.coordinator.paused = True
                self.held.extend(lists)
                lists = []
            elif self.held or (self.coordinator is not None and self.coordinator.paused):
                lists = self.held + lists
                self.held = []
                if self.coordinator is not None:
                    self.coordinator.paused = False
        if self.coordinator is not None:
            lst = self.coordinator.maybe_emit()
            if lst is not None:
                lists.append(lst)
        for msg in lists:
            if not self._process_list(msg[1], msg[2], msg[3]):
                return False
        if self.timeline is not None:
            self.timeline.flush()
        return True

    def _send_requests(self, entries: list[Entry], rounds: bool = True) -> None:
        if (
            rounds
            and self.peer_rounds
            and self.board is not None
            and not self.board.open
            and len(self.table) <= len(entries)
            and self._post_round(entries)
        ):
            return
        items: list[tuple] = []
        # Data travels with the hits only for a few small ops alone in flight (the latency
        # case): a burst of gradients would copy into control messages what the coordinator
        # leaves to the data plane anyway (it reduces at most this budget per list too).
        eager = self.eager_bytes if len(self.table) <= len(entries) else 0
        for e in entries:
            req = e.request
            ss = self.sets.get(req.ps_id)
            cid = None
            if ss is not None and ss.cache.enabled and req.op in CACHEABLE:
                cid = ss.cache.lookup(req.name, req.signature(), ss.set_rank)
            e.cid = cid
            data = None
            if (
                cid is not None
                and req.op == ALLREDUCE
                and req.reduce_op in ops.UFUNCS
                and e.array.nbytes <= eager
            ):
                data = e.array
                eager -= data.nbytes
            if self.coordinator is not None:
                self.coordinator.add(self.rank, req, cid, data)
            elif data is not None:
                items.append(("D", req.ps_id, cid, data.tobytes()))
                self.stats["cache_hits_sent"] += 1
                self.stats["eager_sent"] += 1
            elif cid is not None:
                items.append(("H", req.ps_id, cid))
                self.stats["cache_hits_sent"] += 1
            else:
                items.append(("R", req.wire()))
                self.stats["requests_sent"] += 1
        if items:
            self._send(0, encode(("Q", items)))

    # ------------------------------------------------------------------ peer rounds
    def _post_round(self, entries: list[Entry]) -> bool:
        """Post ``entries`` to the next peer round if all of them are cached ops of the global
        set (the ops alone in flight on this rank, nothing of it waits at rank 0). Small
        ops post their data ("data" round), anything else only the ids ("plane")."""
        ss = self.sets[0]
        cache = ss.cache
        if not cache.enabled or self.closing or len(entries) > BOARD_IDS:
            return False
        budget = self.round_budget  # allreduces (folded by every rank: a bit of compute)
        room = BOARD_DATA  # everything posted, by the rank that posts the most
        data = True
        cids: list[int] = []
        items: list[tuple[Entry, Response]] = []
        totals = [0] * self.size
        memo = self._posted_by_cid
        for e in entries:
            req = e.request
            if req.ps_id != 0 or req.op not in CACHEABLE:
                return False
            cid = cache.lookup(req.name, req.signature(), ss.set_rank)
            if cid is None:
                return False
            resp = cache.live[cid]
            if data:
                if req.op == ALLREDUCE:
                    budget -= e.array.nbytes
                    data = req.reduce_op in ops.UFUNCS and budget >= 0
                else:
                    data = req.op == ALLGATHER or req.op == BROADCAST
                if data:
                    sizes = memo.get(cid) or self._posted_sizes(cid, resp)
                    room -= max(sizes)
                    data = room >= 0
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
                if (resp.op != BROADCAST or resp.root == me) and out < 0
            ]
            tag = self.lists_done << 1
        else:
            parts = []
            tag = self.lists_done << 1 | 1
        self.transport.board_post(cids, parts, tag, out)  # type: ignore[attr-defined]
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
        t = self.transport
        if alloc is not _np_alloc or not getattr(t, "outputs", False):
            return -1
        sizes = self._posted_by_cid.get(cid) or self._posted_sizes(cid, resp)
        me = self.rank
        nb = sizes[me]
        if nb < OUT_MIN:
            return -1
        k: int = t.out_slot(sum(sizes))  # type: ignore[attr-defined]
        if k >= 0:
            at = sum(sizes[:me])
            owner = t.out_owners[k]  # type: ignore[attr-defined]
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
                self.transport.board_post((), (), self.lists_done << 1)  # type: ignore[attr-defined]
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
                logger.warning(
                    "rank %d: %s%s has waited %.1f s in a peer round for %s to post too: not "
                    "submitted there yet, and that engine has not answered (busy or blocked "
                    "outside Horovod?)",
                    self.rank,
                    display_name(e.request.op, e.request.name),
                    f" (submitted at {e.handle.callsite})" if e.handle.callsite else "",
                    now - self.round_posted_at,
                    _ranks(board.waiting()),
                )

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
        how = _decide(items, cids, self.round_tag, posts, self.round_totals)
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
                and _fusible(group[0], resp, self)
                and acc + nb <= threshold
            ):
                group.append(resp)
                acc += nb
                continue
            if group:
                self._execute(_merge(group))
            group, acc = [resp], nb
        if group:
            self._execute(_merge(group))

    def _run_round(
        self, items: list[tuple[Entry, Response]], posts: list[tuple], out: int = -1
    ) -> None:
        """Every rank posted these ops with its data (a "data" round): each rank computes
        every result from the posts alone. Allreduces reduce all parts in rank order with the
        data plane's numerics, so every rank computes the same bits; allgathers concatenate
        the parts; broadcasts take the root's. ``out``: this rank's output slot that holds
        its block of a lone allgather (which is then the result)."""
        self.stats["rounds_run"] += 1
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
                if self.timeline is None and self.autotuner is None and _one_fold(resp, n):
                    # The common latency case, without the general path's temporaries: the
                    # one fold straight into the output (the same bits as ``_fold``).
                    entries = self._claim(resp, running=False)
                    self.stats["eager_responses"] += 1
                    one = entries[0]
                    if one is not None:
                        ops.UFUNCS[resp.reduce_op](parts[0], parts[1], out=one.output.reshape(-1))
                        one.handle._complete(one.index, one.output)
                    continue
                self._execute_eager(resp, _fold(parts, resp, n), "PEER_ALLREDUCE")
                continue
            got = self._claim(resp, running=False)[0]
            if got is None:  # failed meanwhile (the table closed): only skip its bytes
                for r in range(n):
                    offs[r] += _posted(resp, r)
                self._out_done(outs)
                continue
            tl = self.timeline
            if tl is not None:
                rows = _rows(resp)
                tl.ops_start(rows, OP_NAMES[op])
                tl.activity(rows, "PEER_" + OP_NAMES[op].upper())
            if op == ALLGATHER:
                res = self._gathered(resp, got.array, got.alloc, data, offs, outs)
                self._out_done(outs)
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
        t = self.transport
        if outs[me] >= 0:  # this rank's block is in place already
            self.stats["slot_outputs"] += 1
            owner = t.out_owners[outs[me]]  # type: ignore[attr-defined]
            res = owner[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
        else:
            res = alloc(shape, dtype)
        flat = res.reshape(-1).view(np.uint8)
        at = 0
        for r in range(n):
            nb = _posted(resp, r)
            if outs[r] >= 0:
                if r != me:  # the peer's block, at the same place of its result
                    src = t.peer_out(r, outs[r])  # type: ignore[attr-defined]
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
        self, resp: Response, array: np.ndarray, output: Any, data: list[Any], offs: list[int]
    ) -> np.ndarray:
        """A data round's broadcast result in ``output``: the root's post (``data[root]`` at
        ``offs[root]``, advanced past it), or on the root its own ``array``."""
        root = resp.root
        nb = _posted(resp, root)
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
            self.transport.board_ack(readers_of)  # type: ignore[attr-defined]
        if outs[me] >= 0:
            self.transport.board_wait_acked()  # type: ignore[attr-defined]

    def _resend(self, wanted: list[tuple[int, int]]) -> None:
        want = set(wanted)
        with self.lock:
            entries = [e for e in self.table.values() if (e.request.ps_id, e.cid) in want]
        items = [("R", e.request.wire()) for e in entries]
        for e in entries:
            e.cid = None
        if items:
            self._send(0, encode(("Q", items)))

    # ------------------------------------------------------------------ executing responses
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
            return _merge(parts)
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
                rows = _rows(resp)
                tl.ops_start(rows, "ERROR")
                tl.ops_end(rows, None, [()] * len(rows))
            for e in entries:
                if e is not None:
                    e.handle._complete(e.index, error=resp.error)
            return
        if op == JOIN:
            for e in entries:
                if e is not None:
                    e.handle._complete(e.index, resp.last_joined)
            return
        assert ss.view is not None
        if op == BROADCAST:
            resp = _with_root(resp, ss.ranks.index(resp.root))
        if tl is None:
            results = ops.execute(resp, entries, ss.view, self.buffers)
        else:
            rows = _rows(resp)
            tl.ops_start(rows, OP_NAMES[op])
            results = ops.execute(
                resp, entries, ss.view, self.buffers, lambda act: tl.activity(rows, act)
            )
            tl.ops_end(rows, NAME_OF_CODE.get(resp.dtype, "?"), resp.shapes)
        with self.lock:
            self.running = []
        for e, r in zip(entries, results, strict=False):
            if e is not None:
                e.handle._complete(e.index, r)
        if self.autotuner is not None and op == ALLREDUCE and resp.ps_id == 0:
            self._autotune(resp)

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
            rows = _rows(resp)
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
                    e.handle._complete(e.index, error=resp.error)
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
            self._close_table(f"process set {ps_id} was removed", only_set=ps_id)
            result = True
        for e in entries:
            if e is not None:
                e.handle._complete(e.index, result)

    def _register(self, ps_id: int, ranks: Sequence[int]) -> None:
        self.sets[ps_id] = SetState(
            ps_id, ranks, self.transport, self.cache_capacity, coordinator=self.rank == 0
        )

    def _close_table(self, reason: str, only_set: int | None = None) -> None:
        with self.lock:
            if only_set is None and self.closed is None:
                self.closed = reason
            doomed = [k for k in self.table if only_set is None or k[0] == only_set]
            entries = [self.table.pop(k) for k in doomed]
            if only_set is None:
                entries += [e for e in self.running if e is not None]
                self.running = []
        for e in entries:
            e.handle._complete(e.index, error=reason)


def _row(ps_id: int, name: str) -> str:
    """A tensor's row in the timeline (names are unique per process set)."""
    return name if ps_id == 0 else f"{name} [process set {ps_id}]"


def _rows(resp: Response) -> list[str]:
    return [_row(resp.ps_id, n) for n in resp.names]


def _with_root(resp: Response, set_root: int) -> Response:
    r = Response.from_wire(resp.wire())
    r.root = set_root
    return r


def _merge(parts: list[Response]) -> Response:
    if len(parts) == 1:
        return parts[0]
    head = parts[0]
    merged = Response.from_wire(head.wire())
    merged.names = [n for p in parts for n in p.names]
    merged.shapes = [s for p in parts for s in p.shapes]
    if head.dim0s is not None:
        merged.dim0s = [d for p in parts for d in (p.dim0s or [])]
    return merged


# ====================================================================================== coordinator
# A response the coordinator decided on: the response, its cache id (all ranks hit it), and for
# an eager allreduce every member's data (global rank -> bytes), else None.
_Built = tuple[Response, int | None, dict[int, Any] | None]


def _fold(parts: list[np.ndarray], resp: Response, nranks: int) -> np.ndarray:
    """An allreduce of ``parts`` (one per rank, in rank order, left untouched) with the data
    plane's numerics: prescale each part, fold them in order, postscale (Average divides by
    ``nranks``), integers truncated. A new array."""
    reducer = ops.UFUNCS[resp.reduce_op]
    pre = resp.prescale
    post = resp.postscale / nranks if resp.reduce_op == AVERAGE else resp.postscale
    if pre != 1.0:
        parts = [p.copy() for p in parts]
        for p in parts:
            ops.scale(p, pre)
    if len(parts) == 1:
        acc = parts[0].copy()
    else:
        acc = reducer(parts[0], parts[1])
        for p in parts[2:]:
            reducer(acc, p, out=acc)
    ops.scale(acc, post)
    return acc


def _one_fold(resp: Response, nranks: int) -> bool:
    """Can an allreduce of two ranks' data be one ufunc straight into the output (no scale
    factors, no Average; the same bits as ``_fold``)?"""
    return (
        nranks == 2 and resp.prescale == 1.0 and resp.postscale == 1.0 and resp.reduce_op != AVERAGE
    )


def _decide(
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
            d.nbytes == (totals[r] if totals else sum(_posted(resp, r) for _, resp in items))
            or (out >= 0 and lone_gather and d.nbytes == 0)
        )
        for r, t, c, d, out in posts
    )
    return "data" if ok else "fallback"


def _posted(resp: Response, r: int) -> int:
    """Bytes that rank ``r`` posts for cached op ``resp`` (one tensor) in a data round."""
    shape = resp.shapes[0]
    item = DTYPE_OF_CODE[resp.dtype].itemsize
    if resp.op == ALLGATHER:
        assert resp.dim0s is not None
        return resp.dim0s[0][r] * math.prod(shape[1:]) * item
    size = math.prod(shape) * item
    if resp.op == BROADCAST:
        return size if r == resp.root else 0
    return size


def _fusible(head: Response, r: Response, e: Engine) -> bool:
    """Whether ``r`` may share a fused buffer with ``head``."""
    return (
        r.op == head.op
        and r.ps_id == head.ps_id
        and r.dtype == head.dtype
        and r.reduce_op == head.reduce_op
        and r.prescale == head.prescale
        and r.postscale == head.postscale
        and r.joined == head.joined
        and r.device == head.device
        and not r.error
        and (not e.disable_group_fusion or r.group == head.group)
    )


class _Pending:
    __slots__ = ("reqs", "cids", "times", "t0", "ready", "warned", "data")

    def __init__(self, t0: float) -> None:
        self.reqs: dict[int, Request] = {}
        self.cids: dict[int, int | None] = {}
        self.data: dict[int, Any] | None = None  # eager allreduce: each rank's bytes
        self.times: dict[int, float] = {}  # when each rank's request reached the coordinator
        self.t0 = t0
        self.ready = False
        self.warned = False


STACK_WAIT_SECONDS = 2.0  # how long the hang doctor waits for ranks to send their stacks


class _Stalled:
    """One collective the stall inspector found waiting for some ranks."""

    __slots__ = ("ps_id", "name", "p", "missing", "waited")

    def __init__(self, ps_id: int, name: str, p: _Pending, missing: list[int], waited: float):
        self.ps_id, self.name, self.p, self.missing, self.waited = ps_id, name, p, missing, waited

    @property
    def what(self) -> str:
        first = next(iter(self.p.reqs.values()))
        on = f" on process set {self.ps_id}" if self.ps_id else ""
        return display_name(first.op, self.name) + on


class _Diagnosis:
    """A stall report being assembled: the stacks asked of the ranks involved."""

    def __init__(
        self, token: int, stalled: list[_Stalled], fatal: bool, asked: set[int], deadline: float
    ) -> None:
        self.token, self.stalled, self.fatal = token, stalled, fatal
        self.asked, self.deadline = asked, deadline
        self.stacks: dict[int, list] = {}


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class _Coordinator:
    """Negotiation on global rank 0 for every process set."""

    def __init__(
        self,
        engine: Engine,
        stall_check: float,
        stall_shutdown: float,
        first_free: int,
        wait_summary_seconds: float = 0.0,
    ) -> None:
        self.e = engine
        self.tables: dict[int, dict[str, _Pending]] = {}
        self.ready: list[tuple[int, str]] = []
        self.joined: dict[int, None] = {}  # global ranks joined, in join order
        self.shutdown_why: str | None = None
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
        self.diagnosis: _Diagnosis | None = None
        self.tokens = 0
        self.pending_params: tuple | None = None  # autotune's next parameters, for every rank
        self.hit_requests: dict[tuple[int, int, int], tuple[Response, Request]] = {}
        self.arrivals: list[dict[int, float]] = []  # for self.waits, not yet recorded
        self.eager_left = 0  # bytes of eager results the list being built may still carry
        self.paused = False  # rank 0 has a plane round open: no list is emitted meanwhile

    # ----------------------------------------------------------- inputs
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
            pend = table[name] = _Pending(now)
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
            tl.negotiate_ready(_row(ps_id, name), OP_NAMES.get(req.op, "?"), rank, now)
        self._check_ready(ps_id, name, pend, now)

    def _check_ready(self, ps_id: int, name: str, p: _Pending, now: float | None = None) -> None:
        if p.ready:
            return
        ss = self.e.sets.get(ps_id)
        if ss is None:
            need = 0
        else:
            need = len(ss.ranks)
            if ps_id == 0:
                need -= len(self.joined)
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
                    tl.negotiate_end(_row(ps_id, name), now)
                else:
                    tl.negotiate_end(
                        _row(ps_id, name),
                        now,
                        last_rank=slowest[0],
                        waited_ms=round(slowest[1] * 1e3, 3),
                    )

    def forget_set(self, ps_id: int) -> None:
        self.partial -= sum(1 for p in self.tables.get(ps_id, {}).values() if not p.ready)
        self.tables.pop(ps_id, None)
        self.ready = [(p, n) for p, n in self.ready if p != ps_id]

    # ----------------------------------------------------------- scheduling
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
        if self.resend or (not self.paused and (self.ready or self.shutdown_why is not None)):
            waits.append(max(0.0, self._hold_until() - now))
        if self.next_stall != float("inf") and any(self.tables.values()):
            waits.append(max(0.0, self.next_stall - now))
        if self.diagnosis is not None:
            waits.append(max(0.0, self.diagnosis.deadline - now))
        return min(waits) if waits else None

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
        if self.paused or (not self.ready and self.shutdown_why is None):
            return None
        if now < self._hold_until():
            return None
        self.eager_left = e.eager_bytes  # what this list may carry reduced (small messages)
        built = [self._build(ps_id, name) for ps_id, name in self.ready]
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

    # ----------------------------------------------------------- building responses
    def _build(self, ps_id: int, name: str) -> _Built:
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
        return _validate(ss, name, p, joined, self), None, None

    def _eager_data(self, ss: SetState, resp: Response, p: _Pending) -> dict[int, Any] | None:
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

    def _reduce_eager(self, group: list[_Built]) -> tuple:
        """The "V" item of responses whose data every rank sent: reduced here, in rank order,
        with the data plane's numerics (``_fold``)."""
        head = group[0][0]
        ss = self.e.sets[head.ps_id]
        dtype = DTYPE_OF_CODE[head.dtype]
        parts = []
        for r in ss.ranks:
            mine = [np.frombuffer(d[r], dtype) for _, _, d in group]  # type: ignore[index]
            parts.append(np.concatenate(mine) if len(mine) > 1 else mine[0])
        acc = _fold(parts, head, len(ss.ranks))
        return ("V", head.ps_id, [c for _, c, _ in group], acc.tobytes())

    def _fuse(self, built: list[_Built]) -> list[tuple]:
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
                    if cand[2] is not None and _fusible(head, r, e) and acc + nb <= threshold:
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
                    if _fusible(head, r, e) and acc + nb <= threshold:
                        group.append(cand)
                        acc += nb
                    else:
                        keep.append(cand)
                        skipped += nb
                rest = keep
            if all(c is not None for _, c, _ in group) and group[0][1] is not None:
                out.append(("K", head.ps_id, [c for _, c, _ in group]))
            else:
                out.append(_merge([r for r, _, _ in group]).wire())
        return out

    # ----------------------------------------------------------- wait attribution
    def report_waits(self, now: float) -> None:
        self.record_arrivals()
        text = self.waits.summary(now)
        if text is not None:
            logger.info(text)
            tl = self.e.timeline
            if tl is not None:
                tl.counter(
                    "WAITED_FOR_SLOWEST_RANK_S",
                    {f"rank {r}": round(w, 6) for r, w in enumerate(self.waits.waited)},
                )
        self.waits.reset(now)

    def _orphans(self) -> list[_Built]:
        """At shutdown, collectives that only some ranks submitted can never run: fail them
        with a message that says so, rather than with a bare shutdown notice."""
        out: list[_Built] = []
        for ps_id, table in self.tables.items():
            for name, p in list(table.items()):
                if p.ready or not p.reqs:
                    continue
                del table[name]
                self.partial -= 1
                st = _Stalled(ps_id, name, p, [], 0.0)
                out.append(
                    (
                        Response(
                            ERROR,
                            ps_id,
                            [name],
                            error=(
                                f"{st.what} was submitted by {_ranks(list(p.reqs))}"
                                f"{self._sites(p, {})} but {self.shutdown_why} without "
                                "submitting it, so it can never complete. Only some ranks "
                                "called this collective (for example inside `if hvd.rank() "
                                "== 0:`), or ranks called different numbers of collectives: "
                                "every rank of the process set must call it."
                            ),
                        ),
                        None,
                        None,
                    )
                )
        return out

    # ----------------------------------------------------------- stall inspector / hang doctor
    def _unfinished(self, now: float) -> list[_Stalled]:
        """Every collective some ranks submitted and others have not, oldest first."""
        out = []
        for ps_id, table in self.tables.items():
            ss = self.e.sets.get(ps_id)
            if ss is None:
                continue
            for name, p in table.items():
                if p.ready:
                    continue
                missing = [r for r in ss.ranks if r not in p.reqs and r not in self.joined]
                if missing:
                    out.append(_Stalled(ps_id, name, p, missing, now - p.t0))
        out.sort(key=lambda st: st.p.t0)
        return out

    def _stalled(self, now: float) -> list[_Stalled]:
        return [st for st in self._unfinished(now) if st.waited >= self.stall_check]

    def _stall_check(self, now: float) -> None:
        self.next_stall = now + self.stall_check
        if self.diagnosis is not None:
            return
        stalled = self._stalled(now)
        fatal = bool(self.stall_shutdown) and any(
            st.waited >= self.stall_shutdown for st in stalled
        )
        if not fatal and all(st.p.warned for st in stalled):
            return  # nothing new to say
        for st in stalled:
            st.p.warned = True
        # Ask every rank involved where it is; the report is written when they have answered.
        ranks = {r for st in stalled for r in (*st.p.reqs, *st.missing)}
        self.tokens += 1
        d = _Diagnosis(self.tokens, stalled, fatal, ranks - {0}, now + STACK_WAIT_SECONDS)
        if 0 in ranks:
            d.stacks[0] = capture_stacks(self.e.main_ident, self.e.other_threads)
        wire = encode(("STACK?", d.token))
        for r in d.asked:
            try:
                self.e.transport.send_ctrl(r, wire)
            except Exception:
                pass
        self.diagnosis = d
        self._finish_diagnosis(now)

    def _finish_diagnosis(self, now: float) -> None:
        d = self.diagnosis
        assert d is not None
        if now < d.deadline and not d.asked <= set(d.stacks):
            return
        self.diagnosis = None
        silent = sorted(d.asked - set(d.stacks))
        dumped = []
        for r in silent:
            pid = self.e.stack_signal_pids.get(r)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    dumped.append(r)
                except OSError:
                    pass
        text = self._report_text(d, silent, dumped)
        if d.fatal:
            text += (
                f"\nStopping the job: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
                f"{self.stall_shutdown:g} was exceeded."
            )
            logger.error(text)
            try:
                self.e.on_fatal_report(text)
            finally:
                self.e._abort(text)
        else:
            logger.warning(text)

    def _sites(self, p: _Pending, stacks: dict[int, list]) -> str:
        """`` (at train.py:12 in step)``: where the submitting ranks called the collective."""
        sites: dict[str, list[int]] = {}
        for r, q in sorted(p.reqs.items()):
            site = q.site or (where(main_stack(stacks[r])) if r in stacks else "")
            if site:
                sites.setdefault(site, []).append(r)
        if not sites:
            return ""
        if len(sites) == 1:
            return f" at {next(iter(sites))}"
        return " at " + ", ".join(f"{s} ({_ranks(rs)})" for s, rs in sites.items())

    def _waiting_in(self, rank: int) -> list[_Stalled]:
        """Collectives ``rank`` submitted that still wait for other ranks."""
        return [st for st in self._unfinished(self.e.clock()) if rank in st.p.reqs]

    def _report_text(self, d: _Diagnosis, silent: list[int], dumped: list[int]) -> str:
        n = len(d.stalled)
        lines = [
            f"Stall: {n} collective{'s' if n != 1 else ''} waited more than "
            f"{self.stall_check:g} s (HOROVOD_STALL_CHECK_TIME_SECONDS) for ranks that have "
            "not submitted them."
        ]
        deadlocks: dict[frozenset[str], tuple[_Stalled, _Stalled]] = {}
        shown: set[int] = set()
        for st in d.stalled:
            subs = sorted(st.p.reqs)
            lines.append(
                f"  {st.what}: submitted by {_ranks(subs)}{self._sites(st.p, d.stacks)}, "
                f"waiting {st.waited:.1f} s for {_ranks(st.missing)}."
            )
            for m in st.missing:
                elsewhere = self._waiting_in(m)
                if elsewhere:
                    other = elsewhere[0]
                    lines.append(
                        f"    rank {m} has not submitted it: it is waiting in {other.what}"
                        f"{self._sites(other.p, d.stacks)} for {_ranks(other.missing)}."
                    )
                    if set(other.missing) & set(subs):
                        deadlocks.setdefault(frozenset((st.name, other.name)), (st, other))
                    continue
                if m in d.stacks and d.stacks[m]:
                    stack = d.stacks[m]
                    lines.append(
                        f"    rank {m} never submitted {st.what}; it is in "
                        f"{where(main_stack(stack))}"
                        + (":" if m not in shown else " (stack above).")
                    )
                    if m not in shown:
                        lines.append(format_stacks(stack))
                        shown.add(m)
                elif m in silent:
                    how = (
                        f"; its stacks were dumped to its stderr by faulthandler (lines "
                        f"prefixed [{m}]<stderr>)"
                        if m in dumped
                        else ""
                    )
                    lines.append(
                        f"    rank {m} never submitted {st.what}, and did not answer within "
                        f"{STACK_WAIT_SECONDS:g} s when asked where it is: its interpreter is "
                        "busy (most likely in C code that holds the GIL) or the process is "
                        f"stopped{how}."
                    )
                else:
                    lines.append(f"    rank {m} never submitted {st.what}.")
        for pair in deadlocks.values():
            # the collective with fewer callers first: the likelier one to be called by a subset
            a, b = sorted(pair, key=lambda st: (len(st.p.reqs), st.p.t0))
            sa, sb = sorted(a.p.reqs), sorted(b.p.reqs)
            if len(sa) != len(sb):
                few = a if len(sa) < len(sb) else b
                culprit = (
                    f"Most likely {few.what} is called by only {_ranks(sorted(few.p.reqs))} "
                    "(for example inside `if hvd.rank() == 0:`)"
                )
            else:
                culprit = (
                    "One of them is called by only some ranks (for example inside "
                    "`if hvd.rank() == 0:`)"
                )
            lines.append(
                f"Deadlock: {_ranks(sa)} wait{'s' if len(sa) == 1 else ''} in {a.what}"
                f"{self._sites(a.p, d.stacks)} for {_ranks(a.missing)}, while {_ranks(sb)} "
                f"wait{'s' if len(sb) == 1 else ''} in {b.what}{self._sites(b.p, d.stacks)} "
                f"for {_ranks(b.missing)}: neither can ever complete. {culprit}, or the ranks "
                "call collectives in different orders. Every rank of the process set must call "
                "every collective, in the same order (or with matching names)."
            )
        return "\n".join(lines)


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape)).replace(",)", ")")


def _validate(
    ss: SetState, name: str, p: _Pending, joined: tuple[int, ...], coord: _Coordinator
) -> Response:
    reqs = sorted(p.reqs.items())
    r0, q0 = reqs[0]
    what = display_name(q0.op, name)

    def err(text: str) -> Response:
        return Response(ERROR, ss.id, [name], error=text)

    def at(q: Request) -> str:
        return f" ({q.site})" if q.site else ""

    def mismatch(field: str, a: object, r: int, b: object, fix: str) -> Response:
        q = p.reqs[r]
        return err(f"{what}: {field} {a} on rank {r0}{at(q0)} but {b} on rank {r}{at(q)}; {fix}")

    for r, q in reqs[1:]:
        if q.op != q0.op:
            return err(
                f"tensor '{name}': rank {r0} called {OP_NAMES.get(q0.op)}{at(q0)} but rank {r} "
                f"called {OP_NAMES.get(q.op)}{at(q)}; every rank must call the same collective "
                "for the same name"
            )
    op = q0.op
    for r, q in reqs[1:]:
        if q.dtype != q0.dtype:
            return mismatch(
                "dtype",
                NAME_OF_CODE[q0.dtype],
                r,
                NAME_OF_CODE[q.dtype],
                "every rank must submit the same dtype",
            )
        if op in (ALLREDUCE, BROADCAST, REDUCESCATTER) and q.shape != q0.shape:
            return mismatch(
                "shape",
                _fmt_shape(q0.shape),
                r,
                _fmt_shape(q.shape),
                "every rank must submit the same shape",
            )
        if op in (ALLGATHER, ALLTOALL):
            if len(q.shape) != len(q0.shape):
                return mismatch(
                    "number of dimensions",
                    len(q0.shape),
                    r,
                    len(q.shape),
                    "every rank must submit tensors of the same rank",
                )
            if q.shape[1:] != q0.shape[1:]:
                return mismatch(
                    "shape",
                    _fmt_shape(q0.shape),
                    r,
                    _fmt_shape(q.shape),
                    "only the first dimension may differ between ranks",
                )
        if q.reduce_op != q0.reduce_op and op in (ALLREDUCE, REDUCESCATTER):
            return mismatch(
                "reduce op",
                REDUCE_NAMES.get(q0.reduce_op),
                r,
                REDUCE_NAMES.get(q.reduce_op),
                "every rank must pass the same op=",
            )
        if (q.prescale, q.postscale) != (q0.prescale, q0.postscale):
            return mismatch(
                "(prescale_factor, postscale_factor)",
                (q0.prescale, q0.postscale),
                r,
                (q.prescale, q.postscale),
                "every rank must pass the same factors",
            )
        if op == BROADCAST and q.root != q0.root:
            return mismatch(
                "root_rank", q0.root, r, q.root, "every rank must pass the same root_rank"
            )
        if q.device != q0.device:
            dev = {-1: "CPU"}
            return mismatch(
                "device",
                dev.get(q0.device, f"GPU {q0.device}"),
                r,
                dev.get(q.device, f"GPU {q.device}"),
                "every rank must keep this tensor on the same kind of device",
            )
        if q.extra != q0.extra:
            return mismatch(
                "argument",
                q0.extra,
                r,
                q.extra,
                "every rank must pass the same arguments, in the same order",
            )
    if joined and op in (ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER):
        return err(
            f"{what}: not possible while ranks {list(joined)} have called join(); only "
            "allreduce and barrier run with joined ranks"
        )
    if op in (ALLGATHER, ALLTOALL, REDUCESCATTER) and len(q0.shape) == 0:
        return err(f"{what}: needs a tensor with at least one dimension, got a scalar")
    if op == PROCESS_SET_ADD:
        ranks = tuple(cast(Sequence[int], q0.extra))
        for other in ss_all(coord):
            if tuple(other.ranks) == ranks:
                return err(
                    f"add_process_set: a process set with ranks {list(ranks)} already "
                    f"exists (id {other.id})"
                )
        if coord.free_ids:
            new_id = coord.free_ids.pop(0)
        else:
            new_id = coord.next_ps_id
            coord.next_ps_id += 1
        return Response(PROCESS_SET_ADD, 0, [name], extra=(new_id, list(ranks)))
    if op == PROCESS_SET_REMOVE:
        ps_id = cast(int, q0.extra)
        if ps_id == 0 or ps_id not in coord.e.sets:
            return err(f"remove_process_set: process set {ps_id} does not exist")
        coord.free_ids.append(ps_id)
        return Response(PROCESS_SET_REMOVE, 0, [name], extra=ps_id)
    resp = Response(
        op,
        ss.id,
        [name],
        q0.dtype,
        [q0.shape],
        q0.reduce_op,
        q0.root,
        q0.prescale,
        q0.postscale,
        joined=joined,
        group=q0.group,
        device=q0.device,
    )
    if op == ALLGATHER:
        by_rank = dict(reqs)
        resp.dim0s = [[by_rank[r].shape[0] for r in ss.ranks]]
    if op == BARRIER:
        resp.shapes = [()]
    return resp


def ss_all(coord: _Coordinator) -> list[SetState]:
    return list(coord.e.sets.values())
