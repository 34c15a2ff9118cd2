"""TCP with polled control: the thread that waits for a result reads the control
connections itself.

A plain ``TcpTransport`` reads each control connection on a thread of its own and hands every
message to the engine thread, which hands results to the waiting thread: three thread
hand-offs on each rank for one small operation, and on a busy machine each costs tens of
microseconds (a thread that wakes must get a core and the GIL). ``PolledTcpTransport`` is a
``PolledTransport`` over the same connections: whichever thread runs the engine (the waiting
thread while it spins, else the engine thread) reads the control sockets without blocking, so
a small operation's messages go from socket to socket with no hand-off at all. The engine
thread, when it runs the engine, sleeps in ``poll`` on the sockets and a wake-up pipe.

It wraps a connected ``TcpTransport`` (its data plane, handshakes, authentication and abort
stay the inner transport's) and never starts the inner transport's control readers. A lost
peer is seen when its connection reads EOF or fails, by the thread polling, and reported to the
engine as the reader threads report it (``handler(peer, None)``), after the messages that
arrived before it.

Must not touch: the engine, the shared-memory plane (which wraps TCP the same way for the
ranks on other hosts and keeps reader threads for those).
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from horovod.common.exceptions import TransportError
from horovod.transport.base import CtrlHandler, Message, PolledTransport, Reduce, spin_seconds
from horovod.transport.tcp import FRAME, MAX_FRAME, TcpTransport
from horovod.transport.tcp_board import TcpBoard, room

_CHUNK = 1 << 16


class PolledTcpTransport(PolledTransport):
    """``inner``'s data plane; its control connections read by the polling thread."""

    kind = "TCP"
    board: TcpBoard | None = None  # peer rounds over board connections (``board_timeout``)

    def __init__(
        self,
        inner: TcpTransport,
        spin_us: float,
        oversubscribed: bool,
        board_timeout: float | None = None,
        one_host: bool = False,
    ) -> None:
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.spin_s = spin_seconds(spin_us, oversubscribed)
        self.oversubscribed = oversubscribed
        inner.spin_s, inner.spin_yield = self.spin_s, oversubscribed  # (its data plane too)
        self._socks: dict[int, socket.socket] = dict(inner._ctrl)
        self._bufs: dict[int, bytearray] = {p: bytearray() for p in self._socks}
        self._dead: set[int] = set()
        self._handler: CtrlHandler | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = select.poll()
        self._fds = {s.fileno(): p for p, s in self._socks.items()}
        for fd in self._fds:
            self._poller.register(fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        self._idle_poller = select.poll()  # the control connections, for ``ctrl_idle``
        for fd in self._fds:
            self._idle_poller.register(fd, select.POLLIN)
        if board_timeout is not None:  # peer rounds over board connections (every rank)
            self.board = TcpBoard(
                inner.connect_board(board_timeout),
                inner.lost,
                self._stop_polling,
                self._board_room(one_host),
            )
            for sock in self.board.live():
                self._poller.register(sock.fileno(), select.POLLIN)
        self._closed = False
        self._close_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, list[memoryview]] = {}  # control frames waiting for room

    # ---------------------------------------------------------------- data plane: inner's
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        self.inner.exchange(sends, recvs)

    def exchange_reduce(
        self, sends: Sequence[Message], recvs: Sequence[Message], reduces: Sequence[Reduce]
    ) -> None:
        self.inner.exchange_reduce(sends, recvs, reduces)

    def exchange_copy(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        copies: Sequence[tuple[memoryview, memoryview]],
    ) -> None:
        self.inner.exchange_copy(sends, recvs, copies)

    def exchange_oneway(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        self.inner.exchange_oneway(sends, recvs)

    def exchange_pair(self, peer: int, mv: memoryview, send: bool) -> None:
        self.inner.exchange_pair(peer, mv, send)

    def __getattr__(self, name: str) -> Any:  # the rest of TcpTransport's surface
        return getattr(self.inner, name)

    @property
    def aborted(self) -> str | None:
        return self.inner.aborted

    # ---------------------------------------------------------------- control plane
    def send_ctrl(self, peer: int, payload: bytes) -> None:
        """Send without blocking: what the socket does not take now waits in this peer's
        backlog, flushed by the polling thread (two ranks sending to each other at once
        while neither reads would otherwise block both for good)."""
        sock = self._socks.get(peer)
        if sock is None:
            raise TransportError(f"no control connection to rank {peer}", peer)
        frame = memoryview(FRAME.pack(len(payload)) + payload)
        board = self.board
        if board is not None and board.holds(peer):
            board.flush()
        with self._send_lock:
            queue = self._pending.get(peer)
            if queue or (board is not None and board.holds(peer)):
                # (behind a post still waiting for room: a response list must not overtake it)
                self._pending.setdefault(peer, []).append(frame)
                n = 0
            else:
                try:
                    n = sock.send(frame, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as e:
                    raise self.inner.lost(peer, e) from None
                if n < frame.nbytes:
                    self._pending[peer] = [frame[n:]]
        if n < frame.nbytes:
            self.kick()  # a sleeping engine thread must start waiting for room too

    send_fast = send_ctrl

    def _flush(self) -> None:
        """Send what the backlogs hold, as far as the sockets take it now."""
        board = self.board
        with self._send_lock:
            for peer in list(self._pending):
                if board is not None and board.holds(peer):
                    continue  # (behind a post: ``board.flush`` first)
                queue = self._pending[peer]
                sock = self._socks[peer]
                while queue:
                    frame = queue[0]
                    try:
                        n = sock.send(frame, socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as e:
                        raise self.inner.lost(peer, e) from None
                    if n < frame.nbytes:
                        queue[0] = frame[n:]
                        break
                    queue.pop(0)
                if not queue:
                    del self._pending[peer]

    def start_ctrl(self, handler: CtrlHandler) -> None:
        self._handler = handler  # no reader threads: the polling thread reads

    def is_fast(self, peer: int) -> bool:
        return True

    def poll_fast(self) -> list[tuple[int, bytes]]:
        if self._pending:
            self._flush()
        got: list[tuple[int, bytes]] = []
        lost: list[int] = []
        for peer, sock in self._socks.items():
            if peer in self._dead:
                continue
            buf = self._bufs[peer]
            while True:
                try:
                    chunk = sock.recv(_CHUNK, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    lost.append(peer)
                    break
                buf += chunk
                if len(chunk) < _CHUNK:
                    break
            while len(buf) >= FRAME.size:
                (n,) = FRAME.unpack_from(buf)
                if n > MAX_FRAME:  # not our protocol: treat the peer as lost
                    lost.append(peer)
                    buf.clear()
                    break
                end = FRAME.size + n
                if len(buf) < end:
                    break
                got.append((peer, bytes(buf[FRAME.size : end])))
                del buf[:end]
        for peer in lost:
            if peer not in self._dead:
                self._dead.add(peer)
                fd = self._socks[peer].fileno()
                for poller in (self._poller, self._idle_poller):
                    try:  # (the engine thread's sleep must not wake for it again)
                        poller.unregister(fd)
                    except (KeyError, OSError, ValueError):
                        pass
                if self._handler is not None:
                    self._handler(peer, None)  # (after this batch's messages: via the inbox)
        return got

    def _readable(self, timeout_ms: float) -> list[int]:
        """Control peers with data (or EOF) within ``timeout_ms``; drains the wake pipe."""
        ready = []
        for fd, _ in self._poller.poll(timeout_ms):
            if fd == self._wake_r:
                self._drain_wake()
            elif fd in self._fds:  # (else a board connection: its reader is the board)
                ready.append(self._fds[fd])
        return ready

    def _stop_polling(self, sock: socket.socket) -> None:
        """A board connection ended: the sleeping engine thread must not wake for it again."""
        try:
            self._poller.unregister(sock.fileno())
        except (KeyError, OSError, ValueError):
            pass

    # ---------------------------------------------------------------- peer rounds
    def _board_room(self, one_host: bool) -> int:
        """A post's room (``tcp_board.room``): larger in a job of two ranks, the most where
        both are on one host (``one_host``: from the job's host names, alike on every rank)."""
        return room(self.size, one_host)

    def narrow_board(self, same_host: Sequence[int]) -> TcpBoard:
        """The board over the other hosts' ranks only: the ranks of ``same_host`` post to
        this one on a shared-memory board (``MixedBoard``), so their board connections are
        closed. Called at set-up, before any post."""
        board = self.board
        assert board is not None
        keep = {}
        for p in board.peers:
            if p.rank not in same_host:
                keep[p.rank] = p.sock
            elif p.lost is None:
                self._stop_polling(p.sock)
                p.sock.close()
        self.board = TcpBoard(keep, self.inner.lost, self._stop_polling, board.data_bytes)
        return self.board

    def board_post(
        self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0, out: int = -1
    ) -> None:
        assert self.board is not None and out < 0  # (no output slots over TCP)
        self.board.post(cids, parts, tag)

    def fast_pending(self) -> bool:
        """A control message to read or to send, or a post to read or send."""
        if any(len(b) >= FRAME.size for b in self._bufs.values()):
            return True
        # (a poll object of its own: the engine thread may be sleeping in ``_poller``, and
        # one poll object cannot be polled by two threads at once)
        check = self._poll_object()
        try:
            return bool(check.poll(0))
        except (OSError, ValueError):
            return False

    def _poll_object(self, wake: bool = False) -> Any:
        """A poll object for what ``_register`` names."""
        p = select.poll()
        self._register(p, wake)
        return p

    def watch(self, poller: Any) -> None:
        """Register in ``poller`` what wakes a thread sleeping for this transport (for a
        transport that sleeps on its own socket too: shared memory between the ranks of a
        host, this for the others); ``settle`` after the poll."""
        self._register(poller, wake=True)

    def _register(self, p: Any, wake: bool) -> None:
        """The live control sockets (and the board connections, if any) in poll
        object ``p``: readable, or writable where a backlog waits for room; and the wake-up
        pipe if ``wake``."""
        pending = self._pending
        tb = self.board
        for peer, sock in self._socks.items():
            if peer not in self._dead:
                # (a frame held behind a post waits for the board's room, not this socket's)
                out = peer in pending and not (tb is not None and tb.holds(peer))
                p.register(sock, select.POLLIN | (select.POLLOUT if out else 0))
        if tb is not None:
            full = tb.backlogged()
            for sock in tb.live():
                p.register(sock, select.POLLIN | (select.POLLOUT if sock in full else 0))
        if wake:
            p.register(self._wake_r, select.POLLIN)

    def settle(self) -> None:
        """After a poll that ``watch`` set up: empty the wake-up pipe."""
        self._drain_wake()

    def ctrl_idle(self) -> bool:
        # (a poll object kept for this: the thread holding ``drive`` asks before every
        # express call, and building one each time cost a quarter of a 4-byte allreduce)
        if self._pending:
            return False
        for b in self._bufs.values():
            if len(b) >= FRAME.size:
                return False
        try:
            return not self._idle_poller.poll(0)
        except (OSError, ValueError):
            return True

    def set_driving(self, on: bool) -> None:
        """Nothing to publish: a peer's message wakes whoever polls the socket."""

    def kick(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending) or closed

    def sleep(self, timeout: float | None, busy: Callable[[], bool]) -> None:
        if busy() or self.fast_pending():
            return
        # (milliseconds as a float: poll rounds up, so a wait under 1 ms is not a busy loop)
        ms = -1.0 if timeout is None else max(0.0, timeout * 1000)
        try:
            if self._pending or (self.board is not None and self.board.backlogged()):
                # wait for room too (a poll object of the moment)
                self._poll_object(wake=True).poll(ms)
                self._drain_wake()
            else:
                self._readable(ms)
        except (OSError, ValueError):
            pass  # closed meanwhile

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    naps_on_alarm = True

    def nap(self, seconds: float, alarm: int | None = None) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if alarm is not None:
            poller.register(alarm, select.POLLIN)
        try:
            woken = poller.poll(max(0.0, seconds * 1000))  # (rounded up, as in ``sleep``)
        except (OSError, ValueError):
            return  # closed meanwhile
        if woken:
            self._drain_wake()

    # ---------------------------------------------------------------- teardown
    def abort(self, reason: str) -> None:
        self.inner.abort(reason)
        self.kick()

    def close(self) -> None:
        self.inner.close()
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
