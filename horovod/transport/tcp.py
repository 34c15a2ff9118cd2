"""TCP transport: a full mesh of data connections plus a control star to rank 0 (and, when
the polled transport asks, a full mesh of board connections for peer rounds: ``tcp_board``).

Set-up: each rank listens on an ephemeral port, publishes ``host:port`` in the rendezvous
store, then connects to every lower rank (data) and, unless it is rank 0, to rank 0 (control).
Every connection starts with a mutual HMAC challenge-response under the job secret, bound to the
init round; a connection that fails it (wrong secret, garbage, silence) is closed after at most
``HANDSHAKE_TIMEOUT`` seconds and never reaches the job. The listener stays open for the life of
the transport, rejecting every further connection.

Data: non-blocking sockets, ``send``/``recv_into`` straight from and into array buffers
(memoryviews, no copies), all messages of one step progressed together under ``poll`` so that
simultaneous sends in both directions never deadlock. The GIL is released inside every syscall.

Must not touch: the engine, negotiation, the shared-memory plane.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence

from horovod.common.exceptions import TransportError
from horovod.common.net import address_towards, ipv4_addresses
from horovod.common.secret import MAC_SIZE, derive, mac, verify
from horovod.rendezvous.store import Store
from horovod.transport.base import CtrlHandler, Message, Transport

MAGIC = b"PYHVD\x01\x00\x00"
HELLO = struct.Struct("<8scII16s")  # magic, kind, rank, size, client nonce
KIND_DATA, KIND_CTRL, KIND_BOARD = b"D", b"C", b"B"
HANDSHAKE_TIMEOUT = 5.0
FRAME = struct.Struct("<Q")
MAX_FRAME = 1 << 30
SOCK_BUF = 4 * 1024 * 1024
SEND_PIECE = 256 * 1024  # the most one send call is given while receives are pending too
ONE_WAY_PIECE = 1024 * 1024  # ... and with nothing to receive (a broadcast's root, say)
COPY_PIECE = 256 * 1024  # local copies of ``exchange_copy`` go in pieces of this size
_POLL_MS = 500


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    if TCP_CONGESTION is not None and same_machine(sock):
        # Nothing to control between two ends on one machine, and a pacing congestion
        # control (BBR, a common default) paced it down to half after full-duplex traffic:
        # 16 MiB allreduces 5.9-6.1 ms instead of 3.8-3.9, broadcasts 4.3 ms instead of 2.3,
        # for tens of calls at a time (docs/benchmarks.md). Reno is always allowed to set.
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, SAME_MACHINE_CONGESTION)
        except OSError:
            pass


TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", None)  # (Linux)
SAME_MACHINE_CONGESTION = b"reno"


def same_machine(sock: socket.socket) -> bool:
    """Are both ends of connected ``sock`` on this machine (loopback, or the same address)?"""
    try:
        mine, theirs = sock.getsockname()[0], sock.getpeername()[0]
        addr = ipaddress.ip_address(theirs.split("%")[0])
    except (OSError, IndexError, TypeError, ValueError):
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return mine == theirs or addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def local_address_towards(addr: str) -> str:
    """The local address towards ``addr``; loopback when there is no route."""
    try:
        return address_towards(addr)
    except OSError:
        return "127.0.0.1"


def interface_address(iface: str) -> str:
    """The IPv4 address of the first interface of the comma-separated ``iface`` list that has
    one on this host (horovodrun's ``--network-interfaces eth0,ib0``)."""
    have = ipv4_addresses()
    for name in (n.strip() for n in iface.split(",")):
        if name in have:
            return have[name]
    raise TransportError(
        f"HOROVOD_GLOO_IFACE={iface!r}: no such interface with an IPv4 address on this host; "
        f"interfaces here: {', '.join(sorted(have))}"
    )


class TcpTransport(Transport):
    kind = "TCP"
    spin_s = 0.0  # how long ``exchange`` polls the sockets before it sleeps (set by the owner)
    spin_yield = False  # ... yielding the CPU between polls (more ranks than cores)

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        store: Store,
        scope: str,
        secret: bytes,
        advertise: str,
        timeout: float,
    ) -> None:
        self.rank, self.size = rank, size
        self._key = derive(secret, f"transport/{scope}")
        self._data: dict[int, socket.socket] = {}
        self._ctrl: dict[int, socket.socket] = {}
        self._board: dict[int, socket.socket] = {}  # (``connect_board``)
        self._peers: list[list[str]] = []  # every rank's [host, port]
        self._ctrl_locks: dict[int, threading.Lock] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._aborted: str | None = None
        self._readers: list[threading.Thread] = []
        self.rejected = 0
        self._listener = socket.create_server(
            ("0.0.0.0" if advertise != "127.0.0.1" else "127.0.0.1", 0), backlog=max(16, 2 * size)
        )
        port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"horovod-accept-{rank}"
        )
        self._acceptor.start()
        try:
            store.set(scope, f"tcp.{rank}", f"{advertise}:{port}".encode())
            addrs = store.wait(scope, [f"tcp.{r}" for r in range(size)], timeout)
            peers = self._peers = [a.decode().rsplit(":", 1) for a in addrs]
            for r in range(rank):
                self._connect(r, peers[r][0], int(peers[r][1]), KIND_DATA, timeout)
            if rank != 0:
                self._connect(0, peers[0][0], int(peers[0][1]), KIND_CTRL, timeout)
            self._wait_for_peers(timeout)
        except BaseException:
            self.close()
            raise
        for s in self._data.values():
            s.setblocking(False)

    # ---------------------------------------------------------------- set-up
    def _hello_parts(self, kind: bytes, rank: int, nonce_c: bytes, nonce_s: bytes) -> list[bytes]:
        return [kind, str(rank).encode(), str(self.size).encode(), nonce_c, nonce_s]

    def _connect(self, peer: int, host: str, port: int, kind: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"rank {self.rank} cannot connect to rank {peer} at {host}:{port}: {e}",
                        peer,
                    ) from None
                time.sleep(0.05)
        try:
            _tune(sock)
            nonce_c = os.urandom(16)
            sock.sendall(HELLO.pack(MAGIC, kind, self.rank, self.size, nonce_c))
            reply = _recv_exact(sock, 16 + MAC_SIZE)
            nonce_s, tag = reply[:16], reply[16:]
            parts = self._hello_parts(kind, self.rank, nonce_c, nonce_s)
            if not verify(self._key, tag, b"server", *parts):
                raise TransportError(
                    f"rank {peer} at {host}:{port} failed authentication: it "
                    "does not hold this job's secret",
                    peer,
                )
            sock.sendall(mac(self._key, b"client", *parts))
            if _recv_exact(sock, 2) != b"OK":
                raise TransportError(f"rank {peer} refused the connection", peer)
            sock.settimeout(None)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise TransportError(
                f"handshake with rank {peer} at {host}:{port} failed: {e}", peer
            ) from None
        except BaseException:
            sock.close()
            raise
        with self._cond:
            self._table(kind)[peer] = sock
            self._cond.notify_all()

    def _table(self, kind: bytes) -> dict[int, socket.socket]:
        return {KIND_DATA: self._data, KIND_CTRL: self._ctrl}.get(kind, self._board)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            threading.Thread(
                target=self._handshake, args=(sock,), daemon=True, name="horovod-handshake"
            ).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            magic, kind, rank, size, nonce_c = HELLO.unpack(_recv_exact(sock, HELLO.size))
            ok = (
                magic == MAGIC
                and kind in (KIND_DATA, KIND_CTRL, KIND_BOARD)
                and size == self.size
                and 0 <= rank < self.size
                and rank != self.rank
            )
            if not ok:
                raise ConnectionError("bad hello")
            nonce_s = os.urandom(16)
            parts = self._hello_parts(kind, rank, nonce_c, nonce_s)
            sock.sendall(nonce_s + mac(self._key, b"server", *parts))
            if not verify(self._key, _recv_exact(sock, MAC_SIZE), b"client", *parts):
                raise ConnectionError("bad client proof")
            with self._cond:
                table = self._table(kind)
                expected = (rank > self.rank) if kind != KIND_CTRL else (self.rank == 0)
                if self._closing or not expected or rank in table:
                    raise ConnectionError("unexpected connection")
                sock.sendall(b"OK")
                sock.settimeout(None)
                _tune(sock)
                table[rank] = sock
                self._cond.notify_all()
        except (OSError, ConnectionError, struct.error):
            self.rejected += 1
            try:
                sock.close()
            except OSError:
                pass

    def _wait_for_peers(self, timeout: float, board: bool = False) -> None:
        others = set(range(self.size)) - {self.rank}
        want_ctrl = set(range(1, self.size)) if self.rank == 0 else {0}
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if board:
                    missing = sorted(others - set(self._board))
                else:
                    missing = sorted((others - set(self._data)) | (want_ctrl - set(self._ctrl)))
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    what = (
                        "opened no board connection (do HOROVOD_TCP_POLLED_CONTROL and "
                        "HOROVOD_SHARED_MEMORY agree on every rank?)"
                        if board
                        else "did not connect"
                    )
                    raise TransportError(
                        f"rank {self.rank}: ranks {missing} {what} within {timeout:g} s "
                        "(HOROVOD_GLOO_TIMEOUT_SECONDS)",
                        missing[0],
                    )
                self._cond.wait(min(left, 0.5))

    def connect_board(self, timeout: float) -> dict[int, socket.socket]:
        """A full mesh of board connections (for peer rounds over TCP: ``tcp_board``),
        authenticated like the others; every rank of the job must call this. Returns them
        by peer, non-blocking."""
        for r in range(self.rank):
            self._connect(r, self._peers[r][0], int(self._peers[r][1]), KIND_BOARD, timeout)
        self._wait_for_peers(timeout, board=True)
        for s in self._board.values():
            s.setblocking(False)
        return dict(self._board)

    # ---------------------------------------------------------------- data plane
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        self.exchange_copy(sends, recvs, ())

    def exchange_copy(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        copies: Sequence[tuple[memoryview, memoryview]],
    ) -> None:
        """``exchange`` whose local copies are made piece by piece whenever the sockets can
        take or give nothing (an allgather's own block, while the peers' bytes travel)."""
        out, inc = self.queue(sends, recvs)
        todo = [(memoryview(d).cast("B"), memoryview(s).cast("B")) for d, s in copies if d.nbytes]
        spin = self.spin_s
        idle_since = 0.0  # when the sockets last stopped taking or giving bytes (0: moving)
        while out or inc:
            if self.progress(out, inc):
                idle_since = 0.0
                continue
            if todo:
                dst, src = todo[-1]
                dst[:COPY_PIECE] = src[:COPY_PIECE]
                if dst.nbytes > COPY_PIECE:
                    todo[-1] = (dst[COPY_PIECE:], src[COPY_PIECE:])
                else:
                    todo.pop()
                continue
            if spin > 0.0:
                # Poll for up to ``spin_s`` before sleeping in ``poll``: on one host, a
                # sleeping receiver wakes once per burst of the sender's writes (a 1 MiB
                # message took twice as long as with both sides polling).
                now = time.perf_counter()
                if not idle_since:
                    idle_since = now
                if now - idle_since < spin:
                    if self.spin_yield:
                        os.sched_yield()  # more ranks than cores: let the peer run
                    continue
            self._wait(out, inc)
            idle_since = 0.0
        for dst, src in todo:
            dst[:] = src

    def queue(
        self, sends: Sequence[Message], recvs: Sequence[Message]
    ) -> tuple[dict[int, list[memoryview]], dict[int, list[memoryview]]]:
        """Per-peer queues of pending sends and receives (for ``progress``)."""
        if self._aborted is not None:
            raise TransportError(self._aborted)
        out: dict[int, list[memoryview]] = {}
        inc: dict[int, list[memoryview]] = {}
        for peer, mv in sends:
            if mv.nbytes:
                out.setdefault(peer, []).append(mv)
        for peer, mv in recvs:
            if mv.nbytes:
                inc.setdefault(peer, []).append(mv)
        return out, inc

    def progress(self, out: dict[int, list[memoryview]], inc: dict[int, list[memoryview]]) -> bool:
        """Move what the sockets accept now without blocking; True if anything moved.
        Finished messages are removed from the queues."""
        data = self._data
        progressed = False
        # (a piece at a time: a send of everything at once lets nothing be read meanwhile, and
        # on one host the kernel moves it to the peer inside the call; with nothing to read,
        # larger pieces mean fewer calls: a raw 16 MiB one-way transfer 2.38 -> 2.19 ms)
        piece = SEND_PIECE if inc else ONE_WAY_PIECE
        for peer in list(out):
            q = out[peer]
            mv = q[0]
            try:
                n = data[peer].send(mv[:piece])
            except BlockingIOError:
                continue
            except OSError as e:
                raise self.lost(peer, e) from None
            progressed = True
            if n == mv.nbytes:
                q.pop(0)
                if not q:
                    del out[peer]
            else:
                q[0] = mv[n:]
        for peer in list(inc):
            q = inc[peer]
            mv = q[0]
            try:
                n = data[peer].recv_into(mv)
            except BlockingIOError:
                continue
            except OSError as e:
                raise self.lost(peer, e) from None
            if n == 0:
                raise self.lost(peer, None)
            progressed = True
            if n == mv.nbytes:
                q.pop(0)
                if not q:
                    del inc[peer]
            else:
                q[0] = mv[n:]
        return progressed

    def poll_masks(
        self, out: dict[int, list[memoryview]], inc: dict[int, list[memoryview]]
    ) -> dict[int, int]:
        """File descriptor -> poll events that would let ``progress`` move on."""
        masks: dict[int, int] = {}
        for peer in out:
            masks[self._data[peer].fileno()] = select.POLLOUT
        for peer in inc:
            fd = self._data[peer].fileno()
            masks[fd] = masks.get(fd, 0) | select.POLLIN
        return masks

    def data_fileno(self, peer: int) -> int:
        return self._data[peer].fileno()

    def check_peer(self, peer: int) -> None:
        """Raise if the data connection to ``peer`` was closed (used for peers whose data
        travels elsewhere, so anything readable here is an EOF or a reset)."""
        try:
            got = self._data[peer].recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError as e:
            raise self.lost(peer, e) from None
        if not got:
            raise self.lost(peer, None)

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def _wait(self, out: dict[int, list[memoryview]], inc: dict[int, list[memoryview]]) -> None:
        poller = select.poll()
        for fd, m in self.poll_masks(out, inc).items():
            poller.register(fd, m)
        while True:
            if self._aborted is not None:
                raise TransportError(self._aborted)
            if poller.poll(_POLL_MS):
                return

    def lost(self, peer: int, err: OSError | None) -> TransportError:
        if self._aborted is not None:
            return TransportError(self._aborted)
        why = (
            "it closed the connection"
            if err is None
            else (errno.errorcode.get(err.errno or 0, str(err)) if err.errno else str(err))
        )
        return TransportError(
            f"connection to rank {peer} was lost ({why}); rank {peer} exited, crashed or aborted",
            peer,
        )

    # ---------------------------------------------------------------- control plane
    def send_ctrl(self, peer: int, payload: bytes) -> None:
        sock = self._ctrl.get(peer)
        if sock is None:
            raise TransportError(f"no control connection to rank {peer}", peer)
        lock = self._ctrl_locks.setdefault(peer, threading.Lock())
        with lock:
            try:
                sock.sendall(
                    FRAME.pack(len(payload)) + payload
                    if len(payload) < 65536
                    else FRAME.pack(len(payload))
                )
                if len(payload) >= 65536:
                    sock.sendall(payload)
            except OSError as e:
                raise self.lost(peer, e) from None

    def start_ctrl(self, handler: CtrlHandler) -> None:
        for peer, sock in self._ctrl.items():
            t = threading.Thread(
                target=self._read_ctrl,
                args=(peer, sock, handler),
                daemon=True,
                name=f"horovod-ctrl-{self.rank}<-{peer}",
            )
            t.start()
            self._readers.append(t)

    def _read_ctrl(self, peer: int, sock: socket.socket, handler: CtrlHandler) -> None:
        try:
            while True:
                (n,) = FRAME.unpack(_recv_exact(sock, FRAME.size))
                if n > MAX_FRAME:
                    raise ConnectionError(f"control frame of {n} bytes")
                handler(peer, _recv_exact(sock, n))
        except (OSError, ConnectionError):
            pass
        if not self._closing:
            handler(peer, None)

    # ---------------------------------------------------------------- teardown
    def abort(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self._shutdown_sockets()

    def _shutdown_sockets(self) -> None:
        for s in self._sockets():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _sockets(self) -> list[socket.socket]:
        with self._cond:
            return [*self._data.values(), *self._ctrl.values(), *self._board.values()]

    def close(self) -> None:
        with self._cond:
            self._closing = True
        try:
            # Closing a listening socket does not wake a thread blocked in accept() on Linux;
            # shutting it down does (accept fails), so the acceptor ends with the transport.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=2)
        for s in list(self._ctrl.values()) + list(self._board.values()):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for s in self._sockets():
            try:
                s.close()
            except OSError:
                pass
        me = threading.current_thread()
        for t in self._readers:
            if t is not me:
                t.join(timeout=2)
