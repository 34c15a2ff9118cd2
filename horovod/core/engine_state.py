"""What every part of the engine shares: configuration, the table of entries in flight, the
process sets, the peer-round state and the locks, built once in ``EngineState.__init__``.

The parts (``executor``, ``peer_rounds``, ``driving``, ``express``, ``engine``) are layers of
one object, each adding the methods of its concern; this module gives them their common
attributes, the few primitives all of them use (``_send``, ``_register``, ``_close_table``),
and declares the engine methods that lower layers call (``_handle``, ``_abort``, ...), so each
layer type-checks on its own. It holds no logic of any path: a new attribute is added here,
its use in the part that owns it (``round_allreduce_budget`` only derives the data rounds'
allreduce budget from the configuration and the job's layout, once).

Must not touch: a transport's private state, the coordinator's tables, framework tensors.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from horovod.collectives import algorithms as alg
from horovod.common.alarm import make_alarm
from horovod.common.fpenv import Mode
from horovod.core import ops
from horovod.core.autotune import Autotuner
from horovod.core.coordinator import Coordinator
from horovod.core.handles import Entry
from horovod.core.messages import (
    Response,
)
from horovod.core.set_state import SetState
from horovod.core.timeline import Timeline
from horovod.transport.base import PolledTransport, Transport

LEASE_MAX_S = 0.001  # longest that a waiting thread's engine lease outlives its wait
# Longest that a rank with nothing in flight leaves a peer's round unanswered (waiting to post
# the same ops itself: ranks of a training job reach their gradients at slightly different
# times). Capped at a tenth of the stall-check time, so stalls still reach rank 0 early.
ANSWER_WAIT_MAX_S = 0.5


def round_allreduce_budget(
    eager_bytes: int, size: int, board_bytes: int, large: bool = True
) -> int:
    """The most bytes per rank of allreduces that a peer round carries with their data. Every
    rank reads every other's post and folds them itself, so what it reads is bounded by one
    post's room on the board (``board_bytes``: 2 MiB in shared memory, 256 KiB where posts
    travel over TCP) over the other ranks; over more than 2 ranks no more than the data
    plane reduces in rank order (its direct exchange, then ``ORDERED_BYTES``; the ring above
    combines in another order, so an op gives the same bits either way). At least the eager
    budget (HOROVOD_EAGER_ALLREDUCE_BYTES), whose 0 turns data rounds for allreduces off as it
    turns the eager path off. Measured on 2 ranks, a data round beats the data plane's
    exchange up to the board's room (1.3-1.8x at 64 KiB-1 MiB and 1.2x at 1.5-2 MiB in
    shared memory, 1.2-1.6x at 64-256 KiB over TCP: benchmarks.md). Without ``large`` (ranks
    on several hosts: posts cross the hosts' link once per pair of ranks, far more often than
    a hierarchical allreduce's data does; or MPI's collectives asked for over more than two
    ranks), the eager budget alone."""
    if eager_bytes <= 0:
        return 0
    auto = board_bytes // max(1, size - 1) if large else 0
    if size > 2:
        auto = min(auto, max(alg.SMALL_BYTES, alg.ORDERED_BYTES))
    return min(max(eager_bytes, auto), board_bytes)


class EngineState:
    """The state of one rank's engine (see the module docstring); subclassed by the parts."""

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
        # The device data plane (``horovod.device``), made on the first device response by
        # ``device_factory`` (set by the context; None: no device tensors in this job).
        self.device_plane: Any = None
        self.device_factory: Callable[[], Any] | None = None
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
            "data_rounds": 0,  # peer rounds run whose results each rank built from the posts
            "slot_outputs": 0,  # allgather results built in this rank's output slots
        }
        self._register(0, range(size))
        for i, ranks in enumerate(process_sets, start=1):
            self._register(i, ranks)
        self.coordinator = (
            Coordinator(
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
        self.fast = isinstance(transport, PolledTransport)
        # The same transport, typed for the layers that run only when ``fast``.
        self.polled = cast(PolledTransport, transport)
        self.drive = threading.Lock()
        self.spin_s = self.polled.spin_s if self.fast else 0.0
        self._yield = self.fast and self.polled.oversubscribed
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
        # The end of the engine thread's nap through a lease, in a kernel timer where the
        # transport can sleep on one: the thread running the engine moves it past a long
        # operation without waking the engine thread (``Driving._stretch_lease``).
        self.alarm = make_alarm() if self.fast and self.polled.naps_on_alarm else None
        # The floating-point environment every reduction computes in, on whichever thread:
        # this one's (``hvd.init()``'s), as upstream's background thread inherits it (fpenv).
        self.fp_mode = Mode()
        self._napping = False  # the engine thread naps on the alarm
        # Seconds a byte the last plane round of the express way took (1 GB/s until then):
        # how far to move the alarm past the next one.
        self._plane_s_per_byte = 1e-9
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
        self.board = self.polled.board if self.fast else None
        self.board_data = self.board.data_bytes if self.board is not None else 0
        self.board_ids = self.board.max_ids if self.board is not None else 0
        self.peer_rounds = peer_rounds
        # Small allreduces, allgathers and broadcasts post their data and every rank computes
        # the results from the posts ("data" rounds; a barrier posts none: its post is its
        # arrival); other cached ops post only their ids and run on the data plane ("plane"
        # rounds).
        # (scaled on one host, and where the data plane is the project's own or there are
        # two ranks: with MPI's collectives asked for, HOROVOD_CPU_OPERATIONS=mpi, over more
        # ranks larger allreduces go to MPI, whose order of combining is its own, so that an
        # op gives the same bits whichever path it takes; two ranks' sum is the same bits in
        # either order)
        hosts = transport.hosts
        one_host = not hosts or len(set(hosts)) == 1
        own_order = transport.native is None or size == 2
        self.round_budget = round_allreduce_budget(
            eager_bytes, size, self.board_data, one_host and own_order
        )
        # Broadcasts up to the room, but not those the data plane splits between two ranks
        # (the shared-memory plane's single copy from 2 MiB: 1.2x a data round's time there).
        split = transport.split_pair_bytes if size == 2 and transport.native is None else 0
        self.round_broadcast = min(self.board_data, split - 1) if split else self.board_data
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
        # What the express way keeps about each op it ran, by name (``express.Lane``).
        self._lanes: dict[str, Any] = {}
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
        # Past this, a peer round that waits for some ranks stops the job, as the stall
        # inspector does for negotiated collectives (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).
        self.round_shutdown_s = (
            stall_shutdown_seconds if stall_shutdown_seconds > stall_check_seconds > 0 else 0.0
        )
        # Ranks this engine stopped waiting for (the stall shutdown): elastic mode reports
        # them to horovodrun, which stops them.
        self.unresponsive: list[int] = []
        self.round_warn_at = 0.0
        self.round_posted_at = 0.0
        # The coordinator watch (``Engine._watch_coordinator``, ranks other than 0): while this
        # rank waits for collectives and rank 0 has sent nothing for a while, it pings rank 0;
        # one that stays silent past the stall limits is reported (and stops the job).
        self.heard_from_0 = clock()  # when rank 0 last sent anything (a pong included)
        self.waiting_since: float | None = None  # since when the table has had entries
        self.watch_at = 0.0  # next look (0: the table was empty at the last one)
        self.watch_warned = 0.0  # the silence last warned about
        self.watch_lists = 0  # response lists processed at the last look
        self._thread = threading.Thread(
            target=self._run, name=f"horovod-engine-{rank}", daemon=True
        )

    def _send(self, peer: int, payload: bytes) -> None:
        """Engine-to-engine messages: through shared memory when the peer shares this host."""
        if self.fast:
            self.polled.send_fast(peer, payload)
        else:
            self.transport.send_ctrl(peer, payload)

    def unresponsive_peers(self) -> list[int]:
        """Ranks this engine gave up waiting for (see ``unresponsive``)."""
        return list(self.unresponsive)

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

    # ------------------------------------------------------------ provided by the Engine
    # (declared here for the parts that call them; ``Engine`` defines them)
    def _run(self) -> None:
        raise NotImplementedError

    def _abort(self, reason: str, broadcast: bool = True) -> None:
        raise NotImplementedError

    def _handle(self, batch: list[tuple]) -> bool:
        raise NotImplementedError

    def _answered(self, peer: int, msg: tuple) -> bool:
        raise NotImplementedError

    def _timeout(self, watch: bool = True) -> float | None:
        raise NotImplementedError

    def _send_requests(self, entries: list[Entry], rounds: bool = True) -> None:
        raise NotImplementedError

    def _quick(self, e: Entry, deadline: float) -> None:  # (``ExpressPaths``)
        raise NotImplementedError
