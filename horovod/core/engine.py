"""The engine: one per rank, turning named requests into collectives (the request path).

It owns the life of a request: ``submit()`` (a framework thread) refuses a name already in
flight, records the entry and wakes the engine; the event loop (``_run`` on the engine thread,
or ``Driving`` on a waiting thread) collects submissions and control messages, sends requests
to the coordinator (as cache ids when the response cache knows them, or to a peer round), hands
the coordinator's ordered response lists to the executor, and stops cleanly or aborts the job.
Failures never hang: a lost connection, a data-plane error or a stall past the shutdown limit
becomes an abort that reaches every rank with its reason.

The engine is assembled from parts, each a module of its own (read them bottom up):
``engine_state`` (the state they share), ``executor`` (running response lists), ``peer_rounds``
(one-host rounds on the board), ``driving`` (who runs the loop), ``express`` (synchronous calls
without submission), and this module (submission, control messages, the loop, lifecycle). The
coordinator (``coordinator``, rank 0 only) negotiates. See docs/architecture.md.

Must not touch: a transport's private state (it uses ``Transport``/``PolledTransport``), the
coordinator's tables (it hands it messages), framework tensors (frontends give it arrays)."""

from __future__ import annotations

import queue
import traceback
from collections.abc import Sequence

from horovod.common.exceptions import HorovodInternalError, TransportError, shutdown_message
from horovod.common.log import logger
from horovod.core import ops
from horovod.core.diagnose import (
    capture_stacks,
)
from horovod.core.express import ExpressPaths
from horovod.core.handles import Entry
from horovod.core.messages import (
    ALLREDUCE,
    CACHEABLE,
    CPU_DEVICE,
    decode,
    display_name,
    encode,
)

DUPLICATE_NAME = (
    "{what} is already in flight on this rank under the name '{name}'; a name may be used by only "
    "one pending collective at a time. Wait for the first one (synchronize its handle) or pass a "
    "different name=."
)


class Engine(ExpressPaths):
    """The engine of one rank: submission, control messages, the event loop, stop and abort."""

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

    def stop(self, why: str, timeout: float) -> None:
        """Clean shutdown of this rank (propagates to every rank)."""
        if self._thread.is_alive():
            self._post(("shutdown", f"rank {self.rank} {why}"))
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._abort(f"rank {self.rank} could not shut down cleanly within {timeout:g} s")
                self._thread.join(5)
        self._close_table(shutdown_message(f"rank {self.rank} {why}"))
        if self.alarm is not None and not self._thread.is_alive():
            self.alarm.close()
        if self.device_plane is not None:
            self.device_plane.close()
        self.transport.close()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def register_local(self, ps_id: int, ranks: Sequence[int]) -> None:
        self._register(ps_id, ranks)

    def process_set_ids(self) -> list[int]:
        return sorted(self.sets)

    def _on_ctrl(self, peer: int, payload: bytes | None) -> None:
        """Runs on a transport thread; must not block."""
        if payload is None:
            if self.closing or self.closed is not None:
                return
            if self.fast and self.polled.is_fast(peer):
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
        if not self._answered(peer, msg):
            self._post(("ctl", peer, msg))

    def _answered(self, peer: int, msg: tuple) -> bool:
        """Handle at once what a control message asks of this rank itself, whatever its
        engine is doing: an abort, the hang doctor's question, a ping and its answer. True:
        nothing is left for the engine (else it gets the message as an event). Called where
        control messages arrive: on a reader thread, or on the thread that polls them."""
        if msg[0] == "X":  # abort broadcast by the coordinator
            self._abort(str(msg[1]), broadcast=False)
            return True
        if msg[0] == "STACK?":  # the hang doctor asks where this rank is: answer at once
            stacks = capture_stacks(self.main_ident, self.other_threads)
            try:
                self.transport.send_ctrl(0, encode(("STACK", msg[1], stacks)))
            except Exception:
                pass
            return True
        if msg[0] == "PING":  # a rank checks that the coordinator is alive: answer at once
            try:
                self.transport.send_ctrl(peer, encode(("PONG",)))
            except Exception:
                pass
            return True
        if msg[0] == "PONG":
            self.heard_from_0 = self.clock()
            return True
        if msg[0] == "P" and msg[2] is not None:
            self.closing = True  # a clean shutdown follows; the connection will drop
        return False

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
        if self.device_plane is not None:
            self.device_plane.abort()
        self._post(("abort", reason))

    def _run(self) -> None:
        self.fp_mode.adopt()  # (a thread starts in its starter's floating-point mode: fpenv)
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

    def _timeout(self, watch: bool = True) -> float | None:
        """Seconds until the next timer of the loop (0: work now; None: none). ``watch``: count
        the coordinator watch (``_after_drive`` does not: a thread leaving the engine must not
        kick the sleeping engine thread for it after every call; the watch matters while a
        thread waits, and a thread that gives up waiting kicks the engine thread anyway)."""
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
        if self.watch_at and watch:
            left = max(0.0, self.watch_at - self.clock())
            due = left if due is None else min(due, left)
        return due

    def _watch_coordinator(self) -> None:
        """(Ranks other than 0.) The stall inspector runs on rank 0: if rank 0 itself is stopped
        or stuck in C code holding the GIL, nobody would report the collectives that wait for
        it. Armed when this rank has collectives in flight, the watch looks again after
        ``watch_s``: if some are still waiting, not in a peer round (which has its own watch),
        and rank 0 has sent nothing since, it pings rank 0, whose control thread answers at
        once while its interpreter runs. Silent past HOROVOD_STALL_CHECK_TIME_SECONDS, warn;
        past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, stop the job. (A look per ``watch_s``, not
        per op: nothing is added to the path of a collective.)"""
        now = self.clock()
        watch_s = min(1.0, self.round_warn_s / 4)
        if not self.watch_at:  # arm: collectives are in flight from about now
            self.watch_at, self.waiting_since = now + watch_s, now
            return
        if now < self.watch_at:
            return
        if not self.table or self.round_items:
            self.waiting_since, self.watch_at, self.watch_warned = None, 0.0, 0.0
            return
        self.watch_at = now + watch_s
        if self.lists_done != self.watch_lists:  # rank 0 sent response lists meanwhile
            self.watch_lists, self.heard_from_0 = self.lists_done, now
        assert self.waiting_since is not None
        silent = now - max(self.heard_from_0, self.waiting_since)
        if silent >= watch_s:
            try:
                self.transport.send_ctrl(0, encode(("PING",)))
            except Exception:
                pass
        fatal = bool(self.round_shutdown_s) and silent >= self.round_shutdown_s
        if silent < self.round_warn_s or (
            not fatal and silent < self.watch_warned + self.round_warn_s
        ):
            return
        self.watch_warned = silent
        with self.lock:
            e = next(iter(self.table.values()), None)  # the oldest
        if e is None:
            return
        text = (
            f"rank {self.rank}: {display_name(e.request.op, e.request.name)}"
            + (f" (submitted at {e.handle.callsite})" if e.handle.callsite else "")
            + f" is waiting, and rank 0 (the coordinator, which runs the stall inspector) has "
            f"sent nothing for {silent:.1f} s nor answered when asked: its process is stopped, "
            "or busy in C code that holds the GIL"
        )
        if not fatal:
            logger.warning(text)
            return
        self.unresponsive = [0]
        text += (
            f"\nStopping the job: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
            f"{self.round_shutdown_s:g} was exceeded."
        )
        logger.error(text)
        self.on_fatal_report(text)
        self._abort(text)

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
        elif self.round_warn_s > 0 and (self.watch_at or self.table):
            self._watch_coordinator()
            if self.closed is not None:
                return False
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
                and req.device == CPU_DEVICE
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

    def _resend(self, wanted: list[tuple[int, int]]) -> None:
        want = set(wanted)
        with self.lock:
            entries = [e for e in self.table.values() if (e.request.ps_id, e.cid) in want]
        items = [("R", e.request.wire()) for e in entries]
        for e in entries:
            e.cid = None
        if items:
            self._send(0, encode(("Q", items)))
