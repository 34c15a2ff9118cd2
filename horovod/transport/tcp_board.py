"""The engine's board for peer rounds over TCP (the ``PeerBoard`` of ``PolledTcpTransport``).

On one host the board is shared memory every rank reads. Between ranks that talk over TCP
alone, a post travels to every peer on a board connection of its own (a full mesh, opened and
authenticated by ``TcpTransport.connect_board``): a header (round, number of cache ids, data
bytes, tag), the ids, then the data. A small cache-hit allreduce then costs one message each
way between every pair instead of a request to rank 0 and its response (two round trips), and
a larger cached op skips negotiation before it runs on the data plane.

Each peer's posts are read, without blocking, into two buffers by round parity: a rank posts
round n+1 only after reading every post of round n, so a peer is at most one round ahead (as
on the shared-memory board). Only the thread holding the engine's ``drive`` lock reads
(``due``, ``opened``, ``tags``, ``read``) and posts. Posting never blocks: what a socket does
not take now waits, copied, in that peer's backlog, which every later read flushes.

A board connection that ends (EOF, reset, a malformed post) marks its peer lost; that is an
error only where this rank waits for the peer's post (``due`` raises the transport's
"connection lost" error), since a clean shutdown closes board connections too.

Must not touch: the control connections, the data plane, the engine's decisions.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from array import array
from collections.abc import Callable, Sequence

from horovod.common.exceptions import TransportError
from horovod.transport.base import PeerBoard

HEADER = struct.Struct("<qqqq")  # round, cache ids, data bytes, tag
HEADER_ONE = struct.Struct("<qqqqq")  # ... and the one cache id of a lone op's post
ID = struct.Struct("<q")
MAX_RANKS = 8  # peer rounds over TCP in jobs of at most this many ranks (each posts to all)
DATA_BYTES = 256 * 1024  # data of one post (the board's room), in jobs of more than two ranks
# ... and in jobs of two: a data round then moves what the data plane would (each rank's whole
# buffer to the other), less the plane round's trip before it. Timed in one job (benchmarks.md,
# stop 60): over loopback (TCP alone on one machine), data rounds were 1.26-1.58x the speed of
# plane rounds for 384 KiB-1 MiB allreduces, allgathers and broadcasts and 1.03-1.19x at 2
# MiB; between two test hosts on a 10 Gbit/s link, 1.05-1.52x for posts up to 512 KiB but
# 0.79-0.90x for broadcasts of 1-2 MiB (and even on a 1 Gbit/s link, where the wire sets the
# time). Over more ranks every rank posts to every other: an allreduce's data round then
# moves far more than the plane's ring, a broadcast's root sends its data once per peer, so
# the room stays small there.
PAIR_DATA_BYTES = 512 * 1024  # two ranks on two hosts
LOCAL_PAIR_DATA_BYTES = 2 * 1024 * 1024  # two ranks on one host

MAX_IDS = 504  # cache ids of one post
STAGE = 16 * 1024  # bytes read at once ahead of a post's body (a smaller post: in one read)


def room(size: int, one_host: bool) -> int:
    """A post's room in a job of ``size`` ranks (``one_host``: every rank on one host). It is
    part of the post format (a larger post is malformed to its reader), so every rank must
    get the same: both come from what every rank knows alike, the job's size and hosts."""
    if size != 2:
        return DATA_BYTES
    return LOCAL_PAIR_DATA_BYTES if one_host else PAIR_DATA_BYTES


class _Peer:
    """What this rank knows of one peer's posts."""

    __slots__ = (
        "rank",
        "sock",
        "latest",
        "posts",
        "bufs",
        "stage",
        "have",
        "body",
        "bgot",
        "meta",
        "backlog",
        "lost",
    )

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank, self.sock = rank, sock
        self.latest = 0  # the last round this peer posted (read completely)
        self.posts: list[tuple | None] = [None, None]  # by parity: (round, tag, ids, data)
        self.bufs = [bytearray(4096), bytearray(4096)]  # the posts' bodies, by parity
        # Bytes read ahead of any post body: a header, and a small post whole with it (one
        # read for a small post); ``have`` of them are there.
        self.stage = memoryview(bytearray(STAGE))
        self.have = 0
        self.body: memoryview | None = None  # the rest of a larger body, read straight in
        self.bgot = 0
        self.meta = (0, 0, 0)  # its round, ids, tag
        self.backlog: list[memoryview] = []  # this rank's posts the socket has not taken yet
        self.lost: TransportError | None = None


class TcpBoard(PeerBoard):
    """Peer rounds over board connections (see the module docstring). ``data_bytes``: the
    room of a post, which every rank of the job must agree on (a larger post is malformed to
    its reader): ``room()``."""

    data_bytes = DATA_BYTES
    max_ids = MAX_IDS

    def __init__(
        self,
        socks: dict[int, socket.socket],
        lost: Callable[[int, OSError | None], TransportError],
        on_lost: Callable[[socket.socket], None],
        data_bytes: int = DATA_BYTES,
    ) -> None:
        self.data_bytes = data_bytes  # type: ignore[misc]
        self.peers = [_Peer(r, s) for r, s in sorted(socks.items())]
        # The live connections, polled before reading: one ``poll`` finds the peers with
        # something to read (0.3 us), where a read of a silent socket raises (1.4 us per
        # peer), and every express call and every turn of its wait reads the board.
        self._readable = select.poll()
        self._by_fd = {p.sock.fileno(): p for p in self.peers}
        for fd in self._by_fd:
            self._readable.register(fd, select.POLLIN)
        # Posts go to rank 0 last, and only once every other peer has taken its copy whole:
        # rank 0 may finish a round as soon as it has every post and then send a response
        # list (a shutdown) on a control connection, which must not overtake a post still on
        # its way to another rank (on shared memory a post reaches every peer at once).
        self._send_order = sorted(self.peers, key=lambda p: (p.rank == 0, p.rank))
        self._lost_error = lost  # (peer, error) -> the transport's "connection lost" error
        self._on_lost = on_lost  # stop polling a lost peer's socket
        # Posting and flushing: the thread holding ``drive``, and ``flush`` from a thread
        # that sends a control message to a peer whose post waits in its backlog.
        self._send_lock = threading.Lock()
        self.n = 0  # the last round this rank posted
        self.open = False  # ... and not every peer has posted it yet
        self.deferred = False  # a peer's round is seen and this rank answers it later

    # ---------------------------------------------------------------- reading
    def pump(self) -> None:
        """Read whatever the peers sent (without blocking), and flush the backlogs."""
        self.flush()
        by_fd = self._by_fd
        for fd, _ in self._readable.poll(0):  # (data, EOF or an error: ``_read`` tells)
            p = by_fd[fd]
            if p.lost is None:
                self._read(p)

    def _read(self, p: _Peer) -> None:
        """Read what ``p`` sent, until the socket has nothing more or a post is complete (the
        rest, if any, is for the next call: the engine needs one post per peer at a time)."""
        sock = p.sock
        while True:
            body = p.body
            if body is None and p.have >= STAGE:  # (a read of no room would look like EOF)
                self._mark_lost(
                    p,
                    TransportError(
                        f"the board's reader of rank {p.rank}'s posts lost its place (two "
                        "threads read it at once?); this is a bug in horovod",
                        p.rank,
                    ),
                )
                return
            try:
                if body is None:
                    k = sock.recv_into(p.stage[p.have :], 0, socket.MSG_DONTWAIT)
                else:
                    k = sock.recv_into(body[p.bgot :], 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._mark_lost(p, self._lost_error(p.rank, e))
                return
            if k == 0:
                self._mark_lost(p, self._lost_error(p.rank, None))
                return
            if body is None:
                p.have += k
                if self._parse(p):
                    return
            else:
                p.bgot += k
                if p.bgot == body.nbytes:
                    self._complete(p)
                    if not p.have:
                        return

    def _parse(self, p: _Peer) -> bool:
        """Take the posts (and the start of a larger one's body) out of ``p``'s stage; True
        if a post was completed."""
        stage = p.stage
        done = False
        while p.body is None and p.have >= HEADER.size:
            n, nids, nbytes, tag = HEADER.unpack_from(stage)
            if n != p.latest + 1 or not 0 <= nids <= MAX_IDS or not 0 <= nbytes <= self.data_bytes:
                self._mark_lost(
                    p,
                    TransportError(
                        f"rank {p.rank} sent a malformed peer-round post (round {n} after "
                        f"{p.latest}, {nids} ids, {nbytes} bytes)",
                        p.rank,
                    ),
                )
                return done
            need = 8 * nids + nbytes
            buf = p.bufs[n & 1]
            if len(buf) < need:  # (a new buffer: a view of the old one may be alive)
                buf = p.bufs[n & 1] = bytearray(max(need, 2 * len(buf)))
            if nids == 1 and p.have == HEADER.size + need:
                # A lone op's post, whole and alone in the stage (every small express call's):
                # taken in one step.
                buf[:nbytes] = stage[HEADER_ONE.size : p.have]
                p.posts[n & 1] = (
                    n,
                    tag,
                    [ID.unpack_from(stage, HEADER.size)[0]],
                    memoryview(buf)[:nbytes],
                )
                p.latest = n
                p.have = 0
                return True
            take = min(need, p.have - HEADER.size)
            end = HEADER.size + take
            buf[:take] = stage[HEADER.size : end]
            rest = p.have - end
            if rest:
                stage[:rest] = stage[end : p.have]
            p.have = rest
            p.meta = (n, nids, tag)
            p.body = memoryview(buf)[:need]
            p.bgot = take
            if take == need:
                self._complete(p)
                done = True
        return done

    def _complete(self, p: _Peer) -> None:
        """``p``'s post being read is whole."""
        body = p.body
        assert body is not None
        n, nids, tag = p.meta
        ids = body[: 8 * nids].cast("q").tolist() if nids else []
        p.posts[n & 1] = (n, tag, ids, body[8 * nids :])
        p.latest = n
        p.body = None

    def _mark_lost(self, p: _Peer, err: TransportError) -> None:
        p.lost = err
        p.backlog.clear()
        self._on_lost(p.sock)
        try:
            self._readable.unregister(p.sock.fileno())
        except (KeyError, OSError, ValueError):
            pass

    def due(self) -> bool:
        self.pump()
        if self.open:
            n = self.n
            for p in self.peers:
                if p.latest < n:
                    if p.lost is not None:
                        raise p.lost
                    return False
            return True
        return not self.deferred and self.opened_now()

    def opened(self) -> bool:
        self.pump()
        return self.opened_now()

    def opened_now(self) -> bool:
        """``opened`` without reading the sockets first (the caller just did: ``pump``)."""
        n = self.n
        return any(p.latest > n for p in self.peers)

    def due_now(self) -> bool:
        """``due`` from the posts read so far, without reading the sockets: a thread that
        does not hold ``drive`` may ask (True where a lost peer's post is missing: the thread
        that reads must raise it)."""
        if self.open:
            n = self.n
            return all(p.latest >= n or p.lost is not None for p in self.peers)
        return not self.deferred and self.opened_now()

    def tags(self) -> list[int]:
        n = self.n + 1
        return [p.posts[n & 1][1] for p in self.peers if p.latest >= n]  # type: ignore[index]

    def waiting(self) -> list[int]:
        return [p.rank for p in self.peers if p.latest < self.n]

    def read(self) -> list[tuple[int, int, list[int], memoryview, int]]:
        n = self.n
        out = []
        for p in self.peers:
            post = p.posts[n & 1]
            if post is None or post[0] != n:
                raise TransportError(f"rank {p.rank}'s post of engine round {n} is missing")
            out.append((p.rank, post[1], post[2], post[3], -1))
        return out

    # ---------------------------------------------------------------- posting
    def post(self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0) -> None:
        """Post round ``n + 1`` to every peer: ``cids`` (empty: nothing to run), their data
        ``parts`` in order, and ``tag``."""
        n = self.n + 1
        nbytes = 0
        for mv in parts:
            nbytes += mv.nbytes
        k = len(cids)
        if k == 1:  # (a lone op: every small express call)
            head = HEADER_ONE.pack(n, 1, nbytes, tag, cids[0])
        else:
            head = HEADER.pack(n, k, nbytes, tag)
            if k:
                head += array("q", cids).tobytes()
        msg: list[bytes | memoryview] = [head, *parts]
        total = len(head) + nbytes
        with self._send_lock:
            held = False  # a peer before rank 0 has not taken its copy whole
            for p in self._send_order:
                if p.lost is not None:
                    continue  # (an error where this rank waits for its post)
                if p.backlog or (held and p.rank == 0):
                    p.backlog.extend(memoryview(bytes(m)) for m in msg)
                    continue
                try:
                    sent = p.sock.sendmsg(msg, (), socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as e:
                    self._mark_lost(p, self._lost_error(p.rank, e))
                    continue
                if sent < total:  # the rest waits, copied (the caller may change its data)
                    p.backlog.append(memoryview(b"".join(bytes(m) for m in msg))[sent:])
                    held = True
        self.n = n
        self.open = True
        self.deferred = False

    def flush(self) -> None:
        """Send what the backlogs hold, as far as the sockets take it now (rank 0's only once
        the others are empty); any thread may call this."""
        for p in self.peers:
            if p.backlog:
                break
        else:
            return
        with self._send_lock:
            held = False
            for p in self._send_order:
                if p.backlog and not (held and p.rank == 0):
                    self._flush(p)
                held = held or bool(p.backlog)

    def holds(self, peer: int) -> bool:
        """Does a post to ``peer`` wait in its backlog? (Control messages to ``peer`` wait
        behind it: a response list must not overtake a post.)"""
        for p in self.peers:
            if p.rank == peer:
                return bool(p.backlog)
        return False

    def _flush(self, p: _Peer) -> None:
        """(``_send_lock`` held.)"""
        q = p.backlog
        while q:
            try:
                sent = p.sock.send(q[0], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._mark_lost(p, self._lost_error(p.rank, e))
                return
            if sent < q[0].nbytes:
                q[0] = q[0][sent:]
                return
            q.pop(0)

    def backlogged(self) -> list[socket.socket]:
        """Sockets with posts waiting for room (a sleeping thread waits for it too)."""
        return [p.sock for p in self.peers if p.backlog and p.lost is None]

    def live(self) -> list[socket.socket]:
        return [p.sock for p in self.peers if p.lost is None]
