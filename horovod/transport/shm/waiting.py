"""Waiting without burning a core, and waking a peer that waits.

A rank with nothing to do polls the counters for ``spin_us`` microseconds (cheap: a peer that
is already in the same collective answers within about a microsecond), then sleeps in
``poll()`` on its notify socket (a Unix datagram socket; abstract on Linux) and on the TCP
connections of the peers it waits for (whose EOF reveals a dead peer). Before sleeping it sets
its flag, fences, and looks once more; a peer that publishes a chunk or frees a slot checks the
flag after a fence and sends one datagram only if the owner sleeps. The poll also times out
every ``POLL_MS`` as a safety net. The engine thread sleeps the same way on a socket of its own
(``sleep``, ``nap``, ``kick``).

Must not touch: what moves through the channels (``exchange``) or the rings (``control``).
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from functools import partial

from horovod.common.exceptions import TransportError
from horovod.transport.memory_order import fence
from horovod.transport.shm.layout import POLL_MS
from horovod.transport.shm.segments import ShmSegments


class ShmWaiting(ShmSegments):
    """Spinning, sleeping and waking, for the data plane's waits and the engine thread."""

    def _wake(self, peer: int, ctrl: bool = False) -> None:
        """After publishing a counter: wake ``peer`` if it sleeps waiting for one (its data-
        plane wait, or with ``ctrl`` its engine thread)."""
        fence()
        if self._asleep[peer][8 if ctrl else 0]:
            try:
                self._sock.sendto(  # type: ignore[union-attr]
                    b"w", (self._eaddr if ctrl else self._addr)[peer]
                )
            except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                pass  # its queue is full (it will wake anyway) or it is gone (EOF tells)
            except OSError:
                pass

    def _wait(
        self,
        out,
        inc,
        r_out,
        r_inc,
        nbytes: int = 0,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Wait until ``_progress`` can move something. ``nbytes``: the largest chunk in
        flight; the poll covers the time a peer needs to copy it (at ~5 GB/s, so up to about
        200 us for 1 MiB) on top of the spin time, because a wake-up from sleep costs more.
        ``ready``: wait for that instead (the peers in ``inc`` are watched for EOF)."""
        tcp = self.inner
        if ready is None:
            ready = partial(self._ready, out, inc)
        deadline = time.perf_counter() + self.spin_s + min(nbytes, self.chunk) / 5e9
        while time.perf_counter() < deadline:
            if self._aborted is not None:
                raise TransportError(self._aborted)
            if self._yield:
                os.sched_yield()
            if self._backlog:
                self._flush_backlog()
            if ready() or (
                (r_out or r_inc) and tcp.progress(r_out, r_inc)  # type: ignore[attr-defined]
            ):
                return
        # Sleep until a peer wakes us: announce it, then look once more.
        self._enter_sleep()
        try:
            fence()
            if ready():
                return
            poller = select.poll()
            sock = self._sock
            assert sock is not None
            poller.register(sock.fileno(), select.POLLIN)
            watch: dict[int, int] = {}
            for peer in set(out) | set(inc):
                fd = tcp.data_fileno(peer)  # type: ignore[attr-defined]
                watch[fd] = peer
                poller.register(fd, select.POLLIN)
            if r_out or r_inc:
                for fd, m in tcp.poll_masks(r_out, r_inc).items():  # type: ignore[attr-defined]
                    if fd not in watch:
                        poller.register(fd, m)
            while True:
                if self._aborted is not None:
                    raise TransportError(self._aborted)
                if self._backlog:  # control frames wait for ring room: look again soon
                    self._flush_backlog()
                events = poller.poll(1 if self._backlog else POLL_MS)
                # A peer that finished and exited may have left all we need from it in its
                # slots: only a peer we still wait for with nothing ready is lost.
                if ready():
                    break
                for fd, _ in events:
                    if fd in watch:
                        self._check_alive(watch[fd])
                if events:
                    break
        finally:
            self._exit_sleep()
        self._drain()

    def _enter_sleep(self, engine: bool = False) -> None:
        with self._sleep_lock:
            if engine:
                self._engine_asleep = True
            else:
                self._sleepers += 1
            self._publish_asleep()

    def _exit_sleep(self, engine: bool = False) -> None:
        with self._sleep_lock:
            if engine:
                self._engine_asleep = False
            else:
                self._sleepers -= 1
            self._publish_asleep()

    def _publish_asleep(self) -> None:
        """Peers wake us (one datagram) only if the word they read is set: the data word
        while a data-plane wait sleeps, the engine word while the engine thread sleeps and no
        other thread runs the engine."""
        self._me_asleep[0] = int(self._sleepers > 0)
        self._me_asleep[8] = int(self._engine_asleep and not self._driving)

    def set_driving(self, on: bool) -> None:
        """While a thread runs the engine and polls actively, the engine thread's sleep needs
        no wake-ups from peers (that thread kicks it if it leaves work behind)."""
        if self._driving is on:
            return  # only the thread holding the engine's drive lock changes it
        with self._sleep_lock:
            self._driving = on
            self._publish_asleep()

    def _ready(self, out, inc) -> bool:
        """Would ``_progress`` move something now?"""
        n = self.nslots
        for peer in out:
            ch = self._out[peer]
            q = out[peer]  # None from the small-message paths (never direct)
            if q and q[0].ack:  # a posted direct send: read yet? (or room for what follows)
                if ch.rd[0] >= q[0].ack or (q[-1].ack == 0 and ch.count - ch.rd[0] < n):
                    return True
            elif ch.count - ch.rd[0] < n:
                return True
        for peer in inc:
            ch = self._in[peer]
            if ch.count < ch.wr[0]:
                return True
        return False

    def _check_alive(self, peer: int) -> None:
        """A readable TCP connection to a shared-memory peer means it closed (no data ever
        travels there): the peer exited, crashed or aborted."""
        if self._aborted is not None:
            raise TransportError(self._aborted)
        self.inner.check_peer(peer)  # type: ignore[attr-defined]

    def _lost(self, peer: int, err: OSError | None) -> TransportError:
        if self._aborted is not None:
            return TransportError(self._aborted)
        return self.inner.lost(peer, err)  # type: ignore[attr-defined]

    def _drain(self, sock: socket.socket | None = None) -> None:
        sock = sock or self._sock
        if sock is None:
            return
        while True:
            try:
                sock.recv(64)
            except (BlockingIOError, OSError):
                return

    def sleep(self, timeout: float | None, busy) -> None:
        """Block until a same-host rank sends a control message or frees ring space, ``kick``
        is called, or ``timeout`` seconds pass; returns at once if ``busy()`` is true or
        messages are already there."""
        sock = self._esock
        assert sock is not None
        self._enter_sleep(engine=True)
        try:
            fence()
            if busy() or self.fast_pending() or self._aborted is not None:
                return
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            if self._remote is not None:  # (and the other hosts' control connections)
                self._remote.watch(poller)
            poller.poll(-1 if timeout is None else max(0, int(timeout * 1000 + 0.999)))
        finally:
            self._exit_sleep(engine=True)
            self._drain(sock)
            if self._remote is not None:
                self._remote.settle()

    naps_on_alarm = True

    def nap(self, seconds: float, alarm: int | None = None) -> None:
        """Sleep ``seconds`` unless ``kick`` is called or ``alarm`` (a descriptor) becomes
        readable; peers are not asked to wake us."""
        sock = self._esock
        assert sock is not None
        fds = [sock.fileno()] if alarm is None else [sock.fileno(), alarm]
        if max(fds) < 1024:  # select() has microsecond resolution, poll() only milliseconds
            select.select(fds, [], [], max(0.0, seconds))
        else:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll(max(0, int(seconds * 1000 + 0.999)))
        self._drain(sock)

    def kick(self) -> None:
        """Wake this process's engine thread if it is blocked in ``sleep``."""
        sock = self._esock
        if sock is not None:
            try:
                sock.sendto(b"k", sock.getsockname())
            except OSError:
                pass

    def _flush_backlog(self) -> None:
        """Move queued control frames into their rings as far as they fit. Runs while the
        engine's thread waits in the data plane too: a response list larger than the room in a
        ring must still reach that peer, or a collective that follows the list waits on a peer
        that has not read the list yet."""
        left = False
        for peer, ring in self._rout.items():
            if ring.pending:
                if ring.flush():
                    self._wake(peer, ctrl=True)
                left = left or bool(ring.pending)
        self._backlog = left
