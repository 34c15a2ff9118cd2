"""Who runs the engine: the engine thread's loop on a polled transport, and a waiting thread
running the engine itself.

On a ``PolledTransport`` (shared memory) the thread that waits for a result takes the engine's
``drive`` lock and runs the loop until its handle completes or nothing arrives for the spin
time, then hands over to the engine thread, which sleeps in the transport until woken. Owns:
``drive``, the lease a returning thread keeps, waking (kicking) the sleeping engine thread,
and collecting events from the transport's rings and the inbox. See "Who runs the engine" and
"The engine lease" in docs/architecture.md.

Must not touch: what the events mean (``Engine._handle``), rounds' decisions."""

from __future__ import annotations

import os
import queue
import time
import traceback

from horovod.common.exceptions import TransportError, shutdown_message
from horovod.common.log import logger
from horovod.core.handles import Entry, Handle
from horovod.core.messages import (
    decode,
)
from horovod.core.peer_rounds import PeerRounds
from horovod.transport.memory_order import fence

MAX_SLEEP_S = 1.0  # longest sleep of the coordinator's engine thread on shared-memory jobs
# How long after a lease ends its alarm goes off (the engine thread takes over): a deadline
# this far ahead is not the CPU's next timer, so moving it costs no timer reprogramming
# (measured on the VM: 2.2 us a move, 4-14 us for one 0.5-2 ms ahead).
ALARM_SLACK_S = 0.004


class Driving(PeerRounds):
    """The layer that lets a waiting thread run the engine (see the module docstring)."""

    def wake(self) -> None:
        """Make sure a sleeping engine thread looks at the inbox."""
        if self.fast and self._sleeping:
            self._kick()

    def _kick(self) -> None:
        """Wake the sleeping engine thread: one datagram until it has woken (a thread that
        ends ops faster than the engine thread gets a core would otherwise send one per op)."""
        if not self._kicked:
            self._kicked = True
            self.polled.kick()

    def _post(self, ev: tuple) -> None:
        self.inbox.put(ev)
        if self.fast and self._sleeping:
            self._kick()

    def _collect(self) -> list[tuple]:
        """Events for the thread running the engine: control messages from same-host ranks
        (read from shared memory), then everything posted to the inbox."""
        batch: list[tuple] = []
        for peer, payload in self.polled.poll_fast():
            try:
                msg = decode(payload)
            except Exception as e:
                self._abort(f"rank {peer} sent a malformed control message ({e})")
                continue
            # (what a reader thread's handler answers at once: aborts, the hang doctor's
            # question, pings; over TCP alone the polling thread reads every message)
            if not self._answered(peer, msg):
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
        t = self.polled
        clock = time.perf_counter
        try:
            while not self._stop_now:
                lease = self._lease_until - clock()
                if lease > 0 and not self._busy():
                    # A waiting thread ran the engine a moment ago and will most likely be
                    # back: leave the work to it until its lease ends (a kick ends this early).
                    self._sleeping = True
                    try:
                        if not self._busy():
                            self._nap(lease)
                    finally:
                        self._sleeping = False
                        self._napping = False
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
                    t.set_driving(False)
                    if self.coordinator is not None:
                        # Wake at least every second: a thread that runs the engine need not
                        # kick this one for far timers (stall checks), only for near ones.
                        timeout = MAX_SLEEP_S if timeout is None else min(timeout, MAX_SLEEP_S)
                    self._sleep_until = None if timeout is None else time.monotonic() + timeout
                    self._sleeping = True
                try:
                    t.sleep(timeout, self._busy)
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

    def _nap(self, lease: float) -> None:
        """(The engine thread.) Sleep through the ``lease`` seconds left of a waiting thread's
        lease, or until kicked. On the alarm, the thread running the engine moves the end
        meanwhile without waking this one (``_stretch_lease``, ``_lease_alarm``), and it goes
        off up to ``ALARM_SLACK_S`` after the lease; the nap's timeout is only a safety net.
        With ops of this rank in flight (an asynchronous submission during the lease), whose
        peers' answers nobody would notice meanwhile, the nap ends with the lease, as without
        an alarm."""
        alarm = self.alarm
        if alarm is None or self.table:
            self._sleep_until = time.monotonic() + lease
            self.polled.nap(lease)
            return
        alarm.clear()
        end = time.perf_counter() + lease
        if alarm.at < end:
            alarm.set_at(end + ALARM_SLACK_S)
        self._sleep_until = alarm.at  # (perf_counter's clock is monotonic's: make_alarm)
        self._napping = True
        self.polled.nap(MAX_SLEEP_S, alarm.fileno())

    def _stretch_lease(self, seconds: float) -> None:
        """(``drive`` held, before an operation expected to take ``seconds``.) If the engine
        thread naps on an alarm that would go off before that, move the alarm past it: a nap
        ending in the middle of the operation woke the engine thread on the core the operation
        runs on (measured: 45 us more in a 16 MiB MPI broadcast)."""
        alarm = self.alarm
        if alarm is not None and self._napping:
            now = time.perf_counter()
            if alarm.at < now + seconds:
                alarm.set_at(now + seconds + ALARM_SLACK_S)

    def _lease_alarm(self, now: float) -> None:
        """(``_leave`` granting a lease that ends ``now`` + ``lease_s``, the engine thread
        napping on an alarm that would go off before the lease ends, or after a stretch more
        than twice the slack after.) The alarm goes off the slack after the lease ends."""
        alarm = self.alarm
        assert alarm is not None
        at = now + self.lease_s + ALARM_SLACK_S
        alarm.set_at(at)
        self._sleep_until = at

    def run_until(self, handle: Handle) -> None:
        """Run the engine on the calling thread until ``handle`` completes, as long as there is
        work or for up to the spin time without any; then leave it to the engine thread."""
        if self._stop_now or not self.drive.acquire(blocking=False):
            return
        self._drive(handle)

    def _drive(self, handle: Handle, quick: Entry | None = None) -> None:
        """``run_until`` with ``drive`` held; ``quick``: first run this entry's data round
        the quick way (``_quick``). The engine's arithmetic runs in the job's floating-point
        environment, whatever the calling thread's (``fpenv``)."""
        if self.fp_mode.differs():  # (this thread's mode is not the job's: the call in the job's)
            self.fp_mode.run(self._drive, handle, quick)
            return
        self.polled.set_driving(True)
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
        self.polled.set_driving(True)

    def _leave(self, done: bool) -> None:
        """Release ``drive`` after running the engine on a waiting thread (``done``: its
        handle completed)."""
        t = self.polled
        self._left_at = now = time.perf_counter()
        if done and self._back_soon and not self._stop_now:  # (never with no lease time)
            # Done, and this thread came back quickly the last time: it is probably back
            # soon again (a loop of synchronous calls). It keeps the engine for a short
            # lease: "driving" stays published, and the engine thread leaves new work to it
            # until the lease ends. (A thread that comes back only after a training step's
            # compute gets none: the engine thread would be kicked and woken for nothing.)
            self._lease_until = ends = now + self.lease_s
            if self._napping:
                at = self.alarm.at  # type: ignore[union-attr]
                if at < ends or at > ends + 2 * ALARM_SLACK_S:
                    self._lease_alarm(now)
            fence()
            self.drive.release()
            if self._sleeping:
                until = self._sleep_until
                if not self._napping and (
                    until is None or until > time.monotonic() + 2 * self.lease_s
                ):
                    # It sleeps past the lease's end and would not take over then (a nap on
                    # the alarm ends when the alarm goes off: ``_lease_alarm`` set it).
                    self._kick()
                elif self._busy():
                    self._kick()
        else:
            # Gave up waiting (or stopping): the engine thread takes over at once.
            self._lease_until = 0.0
            if self._napping:
                self._kick()  # (its alarm may be a slack away: it takes over now)
            t.set_driving(False)
            fence()
            self.drive.release()
            self._after_drive(force=not done)

    def _after_drive(self, force: bool = False) -> None:
        """The engine thread may be asleep with a deadline set before this thread ran the
        engine: wake it if there is work now or a timer it does not know about."""
        if not self._sleeping:
            return
        t = self.polled
        due = self._timeout(watch=False)
        wake = force or self._stop_now or self._busy() or t.fast_pending()
        if not wake and due is not None:
            until = self._sleep_until
            wake = until is None or time.monotonic() + due < until
        if wake:
            self._kick()
