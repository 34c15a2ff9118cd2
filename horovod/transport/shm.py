"""Shared-memory data plane for ranks on the same host; TCP (the inner transport) for the rest.

Layout. Every rank owns one segment (a file in ``/dev/shm``, mapped by every rank on its host):
a page whose first words say whether the owner is asleep (data plane, engine), then one *channel* per local peer
that sends to it. A channel is a page of counters (chunks written by the sender, chunks read by
the receiver, each on its own cache line) and ``slots`` slots of ``chunk`` bytes. A message
moves as consecutive chunks, one per slot, so the sender fills the next slot while the receiver
empties (or reduces straight out of) the previous one: copy-in, copy-out and the reduction of
large messages overlap. Both sides cut messages into the same chunks because lengths agree (the
Transport contract), so no framing is stored. After the channels: a control-message ring per
peer, the engine's board for peer rounds (``_Board``), and two output slots, where a rank may
build an allgather result that its peers read its block from (``out_slot``).

Waiting. A rank with nothing to do polls the counters for ``spin_us`` microseconds (cheap: a
peer that is already in the same collective answers within about a microsecond), then sleeps in
``poll()`` on its notify socket (a Unix datagram socket; abstract on Linux) and on the TCP
connections of the peers it waits for (whose EOF reveals a dead peer). Before sleeping it sets
its flag, fences, and looks once more; a peer that publishes a chunk or frees a slot checks the
flag after a fence and sends one datagram only if the owner sleeps. The poll also times out
every ``_POLL_MS`` as a safety net. No thread busy-waits while the other rank computes.

Lifetime. Segments are unlinked as soon as every local rank has mapped them, so nothing is left
in ``/dev/shm`` even when a rank is killed later; names carry the job's id (derived from its
secret), so horovodrun can remove the segments of ranks that died during set-up, and a random
part, so two jobs on one host never collide. If any local rank cannot create or map its segment
(no ``/dev/shm``, not enough space), every rank of that host agrees to stay on TCP.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import socket
import struct
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from horovod.common import log
from horovod.common.exceptions import TransportError
from horovod.common.shm_names import PREFIX, job_id, shm_dir
from horovod.rendezvous.store import Store
from horovod.transport import cma
from horovod.transport.base import (
    CtrlHandler,
    Message,
    PeerBoard,
    PolledTransport,
    Reduce,
    Reducer,
    Scratch,
    Transport,
    as_bytes,
)
from horovod.transport.memory_order import fence, order

PAGE = 4096
RING = 256 * 1024  # control-message ring per pair and direction
FRAME = 8  # little-endian length before each control message
_DESC = struct.Struct("<QQ")  # a direct send's slot: sender's address, length
_FAILED = (1 << 64) - 1  # length written over a split broadcast's post its reader gave up on
_POLL_MS = 200
BOARD_DATA = 1024 * 1024  # data of one peer-round post (small allreduces, allgathers, broadcasts)
BOARD_IDS = PAGE // 8 - 8  # cache ids per post
# Output slots: a rank's result of an allgather data round can live in its own segment, where
# the peers read its block from (instead of from a copy in the board): one copy less per rank.
OUT_SLOTS = 2
OUT_BYTES = 2 * BOARD_DATA
OUT_MIN = 128 * 1024  # a rank's own block from this size on (below, the copy costs no more)
# Own-block copies interleaved with single-copy reads (``exchange_copy``): this much of the
# peer's message is read, then as large a share of the copies, so both ranks' blocks pass
# through the shared cache once for the two readers (the owner's copy, the peer's read).
COPY_PIECE = 1 << 20


class _Chan:
    """One direction between two local ranks: counters and slots in the receiver's segment."""

    __slots__ = ("wr", "rd", "slots", "count")

    def __init__(self, mem: mmap.mmap, base: int, nslots: int, chunk: int) -> None:
        mv = memoryview(mem)
        self.wr = mv[base : base + 8].cast("q")  # chunks written (sender)
        self.rd = mv[base + 64 : base + 72].cast("q")  # chunks read (receiver)
        first = base + PAGE
        self.slots = [mv[first + i * chunk : first + (i + 1) * chunk] for i in range(nslots)]
        self.count = 0  # this side's own counter (written or read so far)

    def put(self, mv: memoryview) -> bool:
        """Sender: copy ``mv`` (at most one slot) into the next slot if one is free."""
        n = len(self.slots)
        if self.count - self.rd[0] >= n:
            return False
        self.slots[self.count % n][: mv.nbytes] = mv.cast("B")
        self.count += 1
        order()
        self.wr[0] = self.count
        return True

    def get(self, mv: memoryview) -> bool:
        """Receiver: copy the next slot into ``mv`` if the sender has filled it."""
        if self.count >= self.wr[0]:
            return False
        order()
        mv.cast("B")[:] = self.slots[self.count % len(self.slots)][: mv.nbytes]
        self.count += 1
        order()
        self.rd[0] = self.count
        return True


def _reached(counter: memoryview, value: int) -> bool:
    return counter[0] >= value


def _advance(items: list, move, touched: set[int]) -> list:
    """One pass of ``move(chan, message)`` (``_Chan.put`` or ``get``) over ``items`` in order;
    a message that cannot move blocks the later ones of its peer. Adds the peers that moved
    something to ``touched``; returns what is left."""
    left = []
    blocked: set[int] = set()
    for item in items:
        peer, ch, mv = item
        if peer not in blocked and move(ch, mv):
            touched.add(peer)
        else:
            blocked.add(peer)
            left.append(item)
    return left


class _Ring:
    """A byte stream of framed control messages from one rank to another."""

    __slots__ = ("wr", "rd", "data", "count", "pending", "acc")

    def __init__(self, mem: mmap.mmap, base: int) -> None:
        mv = memoryview(mem)
        self.wr = mv[base : base + 8].cast("q")  # bytes written (sender)
        self.rd = mv[base + 64 : base + 72].cast("q")  # bytes read (receiver)
        self.data = mv[base + PAGE : base + PAGE + RING]
        self.count = 0  # this side's own counter
        self.pending: list[memoryview] = []  # sender: frames waiting for room
        self.acc = bytearray()  # receiver: bytes of incomplete frames

    def room(self) -> int:
        return RING - (self.count - self.rd[0])

    def put(self, frame: bytes) -> bool:
        """Sender: write ``frame`` at once if nothing is queued before it and it fits without
        wrapping around (the common case); False: queue it for ``flush``."""
        n = len(frame)
        pos = self.count % RING
        if self.pending or pos + n > RING or self.room() < n:
            return False
        self.data[pos : pos + n] = frame
        self.count += n
        order()
        self.wr[0] = self.count
        return True

    def flush(self) -> bool:
        """Sender: copy queued frames in as far as they fit; True if anything was written."""
        wrote = False
        while self.pending:
            free = self.room()
            if free <= 0:
                break
            mv = self.pending[0]
            n = min(free, mv.nbytes)
            pos = self.count % RING
            first = min(n, RING - pos)
            self.data[pos : pos + first] = mv[:first]
            if first < n:
                self.data[: n - first] = mv[first:n]
            self.count += n
            wrote = True
            if n == mv.nbytes:
                self.pending.pop(0)
            else:
                self.pending[0] = mv[n:]
        if wrote:
            order()
            self.wr[0] = self.count
        return wrote

    def take(self) -> int:
        """Receiver: move everything written so far into ``acc``; returns how many bytes."""
        end = self.wr[0]
        n = end - self.count
        if n <= 0:
            return 0
        order()
        pos = self.count % RING
        first = min(n, RING - pos)
        self.acc += self.data[pos : pos + first]
        if first < n:
            self.acc += self.data[: n - first]
        self.count = end
        order()
        self.rd[0] = end
        return n

    def frames(self) -> list[bytes]:
        out = []
        acc = self.acc
        off = 0
        while len(acc) - off >= FRAME:
            n = int.from_bytes(acc[off : off + FRAME], "little")
            if len(acc) - off - FRAME < n:
                break
            out.append(bytes(acc[off + FRAME : off + FRAME + n]))
            off += FRAME + n
        if off:
            del acc[:off]
        return out

    def release(self) -> None:
        for v in (self.wr, self.rd, self.data):
            v.release()


class _Board(PeerBoard):
    """Peer rounds of the engine (see "Peer rounds" in docs/architecture.md): each rank posts
    what it is about to run (cache ids and their data) for round ``n`` into its own segment;
    every rank reads every peer's post once all have posted, so all of them decide the same.

    A rank posts round n+1 only after reading every post of round n, so a peer is at most one
    round ahead: two slots (by parity) per rank suffice. ``latest`` is published after the
    slot's contents (like a channel's counter)."""

    __slots__ = (
        "latest",
        "acked",
        "acks",
        "slots",
        "peers",
        "n",
        "open",
        "deferred",
        "_mine",
        "_peer_slots",
    )
    data_bytes = BOARD_DATA
    max_ids = BOARD_IDS

    def __init__(self, mine: mmap.mmap, peers: dict[int, mmap.mmap], base: int) -> None:
        def views(mem: mmap.mmap) -> tuple[memoryview, list[tuple[memoryview, memoryview]]]:
            mv = memoryview(mem)
            latest = mv[base : base + 8].cast("q")
            slots = []
            for k in range(2):
                at = base + PAGE + k * (PAGE + BOARD_DATA)
                slots.append((mv[at : at + PAGE].cast("q"), mv[at + PAGE : at + PAGE + BOARD_DATA]))
            return latest, slots

        self.latest, self._mine = views(mine)
        self.peers = [(r, *views(m)) for r, m in sorted(peers.items())]
        # The last round whose posts this rank has read out of the peers' output slots (its
        # own cache line): a rank whose result lives in its output slot returns it only once
        # every peer has read its block from there.
        self.acked = memoryview(mine)[base + 64 : base + 72].cast("q")
        self.acks = [
            memoryview(peers[r])[base + 64 : base + 72].cast("q") for r, _, _ in self.peers
        ]
        self.n = 0  # the last round this rank posted
        self.open = False  # ... and not everybody has posted it yet
        # The engine has seen a peer's next round and leaves its answer for later (it has
        # nothing in flight): ``due`` does not report that round until this rank posts.
        self.deferred = False

    def due(self) -> bool:
        """Can this rank's open round be decided, or does a peer wait for this rank's post?"""
        if self.open:
            n = self.n
            for _, latest, _ in self.peers:
                if latest[0] < n:
                    return False
            return True
        return not self.deferred and self.opened()

    def opened(self) -> bool:
        """Has a peer posted a round this rank has not?"""
        n = self.n
        for _, latest, _ in self.peers:
            if latest[0] > n:
                return True
        return False

    def tags(self) -> list[int]:
        """The tags of the peers' posts of this rank's next round that are there already."""
        n = self.n + 1
        out = []
        for _, latest, slots in self.peers:
            if latest[0] >= n:
                order()
                out.append(slots[n % 2][0][3])
        return out

    def waiting(self) -> list[int]:
        """Peers that have not posted this rank's open round yet."""
        return [r for r, latest, _ in self.peers if latest[0] < self.n]

    def post(
        self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0, out: int = -1
    ) -> None:
        """Post round ``n + 1``: ``cids`` (empty: nothing to run), their data in order, and a
        ``tag`` the engine compares (what kind of round, and where in its list sequence).
        ``out``: this rank's data is in its output slot ``out`` instead (``parts`` empty)."""
        n = self.n + 1
        head, data = self._mine[n % 2]
        off = 0
        for mv in parts:
            end = off + mv.nbytes
            data[off:end] = mv
            off = end
        k = len(cids)
        head[1] = k
        head[2] = off
        head[3] = tag
        head[4] = out + 1
        head[8 : 8 + k] = memoryview(array("q", cids))
        head[0] = n
        order()
        self.latest[0] = n
        self.n = n
        self.open = True
        self.deferred = False

    def read(self) -> list[tuple[int, int, list[int], memoryview, int]]:
        """Every peer's post of round ``n`` (rank, tag, cache ids, data, output slot or -1);
        call once ``due()``."""
        n = self.n
        order()
        out = []
        for r, _, slots in self.peers:
            head, data = slots[n % 2]
            if head[0] != n:
                raise TransportError(f"rank {r}'s post of engine round {n} is missing")
            k = head[1]
            out.append((r, head[3], head[8 : 8 + k].tolist(), data[: head[2]], head[4] - 1))
        return out

    def ack(self) -> None:
        """This rank has read its peers' output slots for round ``n``."""
        order()
        self.acked[0] = self.n

    def all_acked(self) -> bool:
        n = self.n
        for a in self.acks:
            if a[0] < n:
                return False
        return True

    def unacked(self) -> list[int]:
        """Peers that have not read this rank's output slot for round ``n`` yet."""
        n = self.n
        return [r for (r, _, _), a in zip(self.peers, self.acks, strict=True) if a[0] < n]

    def release(self) -> None:
        for v in (self.latest, self.acked, *self.acks, *(x for pair in self._mine for x in pair)):
            v.release()
        for _, latest, slots in self.peers:
            for v in (latest, *(x for pair in slots for x in pair)):
                v.release()


class _Copier:
    """Local copies ``(dst, src)`` done piece by piece between a step's transfers."""

    def __init__(self, copies: Sequence[tuple[memoryview, memoryview]]) -> None:
        self.items = [(d, src) for d, src in copies if src.nbytes]
        self.left = sum(src.nbytes for _, src in self.items)
        self.i = self.off = 0

    def some(self, nbytes: int) -> None:
        while nbytes > 0 and self.i < len(self.items):
            d, src = self.items[self.i]
            off = self.off
            n = min(nbytes, src.nbytes - off)
            d[off : off + n] = src[off : off + n]
            nbytes -= n
            self.left -= n
            if off + n == src.nbytes:
                self.i, self.off = self.i + 1, 0
            else:
                self.off = off + n


class _Pending:
    """A message in progress over a channel: bytes (copy) or an array to reduce into.
    ``direct``: it moves by single copy (the sender posts its address in one slot, the receiver
    reads it from the sender's memory); ``ack``: the channel count at which the receiver is done
    with a posted direct send (0 before it is posted)."""

    __slots__ = ("mv", "dst", "op", "off", "direct", "ack")

    def __init__(
        self, mv: memoryview, dst: np.ndarray | None = None, op=None, direct: bool = False
    ) -> None:
        self.mv, self.dst, self.op, self.off = mv, dst, op, 0
        self.direct, self.ack = direct, 0


class ShmTransport(PolledTransport):
    kind = "SHM"

    def __init__(
        self,
        inner: Transport,
        local: Sequence[int],
        *,
        store: Store,
        scope: str,
        secret: bytes,
        chunk: int,
        slots: int,
        spin_us: float,
        timeout: float,
        single_copy: int = 0,
        outputs: bool = True,
    ) -> None:
        """``local``: the global ranks on this host (this one included). Raises
        ``TransportError`` if this host's ranks cannot all use shared memory (every one of
        them raises, so they agree); use ``create`` to fall back to ``inner`` instead.
        ``single_copy``: messages of more than one chunk and at least this many bytes are read
        straight from the sender's memory where every local rank can (0: never).
        ``outputs``: results of allgather peer rounds may live in this rank's output slots
        (every rank reads the others' either way); only where reference counts tell that no
        view of a result is alive any more (``horovod.core.pool``)."""
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.local = sorted(local)
        self.peers = [r for r in self.local if r != self.rank]
        self.chunk = (chunk + 63) // 64 * 64
        self.nslots = slots
        self.spin_s = spin_us / 1e6
        self._yield = len(self.local) > (os.cpu_count() or 1)
        self.oversubscribed = self._yield  # waiting loops yield the CPU between polls
        self._aborted: str | None = None
        self._closed = False
        self._scratch = Scratch()
        self._maps: dict[int, mmap.mmap] = {}
        self._out: dict[int, _Chan] = {}
        self._in: dict[int, _Chan] = {}
        self._asleep: dict[int, memoryview] = {}
        self._rin: dict[int, _Ring] = {}
        self._rout: dict[int, _Ring] = {}
        self._backlog = False  # some control frame waits for room in its ring
        self._sleepers = 0  # threads in a data-plane wait's sleep
        self._engine_asleep = False  # the engine thread in sleep()
        self._driving = False
        self._sleep_lock = threading.Lock()
        self._addr: dict[int, str | bytes] = {}  # peers' data-plane sockets
        self._eaddr: dict[int, str | bytes] = {}  # peers' engine sockets
        self._sock: socket.socket | None = None  # wakes this rank's data-plane waits
        self._esock: socket.socket | None = None  # wakes its engine thread
        self._path: str | None = None
        self._sock_paths: list[str] = []
        self.board: _Board | None = None  # the engine's peer rounds (all ranks on this host)
        # Output slots (``out_slot``): every local rank's, and the arrays that hand out this
        # rank's (when ``outputs``: a result may then live in shared memory).
        self.outputs = outputs
        self.out_min = OUT_MIN
        self._out_views: dict[int, list[memoryview]] = {}
        self.out_owners: list[np.ndarray] = []
        # Single copy (cross-memory attach): messages of at least this many bytes (0: off).
        self.single_copy = 0
        self.split_copy = False  # large two-rank broadcasts: root writes half, receiver reads half
        self._pids: dict[int, int] = {}
        self._ptracer_set = False
        try:
            self._setup(store, scope, secret, timeout)
            if single_copy > 0:
                self._setup_single_copy(store, scope, timeout, max(single_copy, self.chunk + 1))
        except BaseException:
            self._release()
            raise

    @classmethod
    def create(cls, inner: Transport, hostnames: Sequence[str], **kw) -> Transport:
        """A ShmTransport over ``inner`` for the ranks sharing this rank's host name, or
        ``inner`` itself when there are none or they agreed that shared memory is unusable."""
        me = hostnames[inner.rank]
        local = [r for r, h in enumerate(hostnames) if h == me]
        if len(local) < 2:
            return inner
        try:
            return cls(inner, local, **kw)
        except _Unusable as e:
            log.logger.warning(
                "rank %d: shared memory unavailable on host %s (%s); ranks there use TCP",
                inner.rank,
                me,
                e,
            )
            return inner

    # ---------------------------------------------------------------- set-up
    def _chan_bytes(self) -> int:
        return PAGE + self.nslots * self.chunk

    def _seg_bytes(self) -> int:
        return self._out_base() + OUT_SLOTS * OUT_BYTES

    def _out_base(self) -> int:
        return self._board_base() + PAGE + 2 * (PAGE + BOARD_DATA)

    def _board_base(self) -> int:
        return PAGE + (len(self.local) - 1) * (self._chan_bytes() + PAGE + RING)

    def _setup(self, store: Store, scope: str, secret: bytes, timeout: float) -> None:
        me = self.rank
        name = f"{PREFIX}{job_id(secret)}-{me}-{os.urandom(6).hex()}"
        err = ""
        try:
            self._path = self._create_segment(name)
            self._sock = self._bind(name)
            self._esock = self._bind(name + "e")
        except OSError as e:
            err = f"rank {me}: {e}"
        store.set(scope, f"shm.{me}", (name if not err else "!" + err).encode())
        names = [b.decode() for b in store.wait(scope, [f"shm.{r}" for r in self.local], timeout)]
        bad = [n[1:] for n in names if n.startswith("!")]
        if not bad:
            try:
                for r, n in zip(self.local, names, strict=True):
                    if r != me:
                        self._map_peer(r, n)
            except OSError as e:
                bad.append(f"rank {me} cannot map rank {r}'s segment: {e}")
        store.set(scope, f"shm.mapped.{me}", ("!" + bad[0] if bad else "ok").encode())
        done = [
            b.decode() for b in store.wait(scope, [f"shm.mapped.{r}" for r in self.local], timeout)
        ]
        # Every rank has mapped every segment (or given up): the names can go.
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None
        why = next((d[1:] for d in done if d != "ok"), None)
        if why is not None:
            raise _Unusable(why)
        self._build_channels()

    def _create_segment(self, name: str) -> str:
        d = shm_dir()
        need = self._seg_bytes()
        st = os.statvfs(d)
        # Leave room for the other ranks of this host too: each needs about as much.
        if st.f_bavail * st.f_frsize < need * len(self.local):
            raise OSError(
                f"{d} has {st.f_bavail * st.f_frsize >> 20} MiB free, shared memory for "
                f"{len(self.local)} ranks needs {need * len(self.local) >> 20} MiB (lower "
                "HOROVOD_SHM_CHUNK_BYTES / HOROVOD_SHM_SLOTS or enlarge /dev/shm, e.g. "
                "docker run --shm-size=1g)"
            )
        path = os.path.join(d, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, need)  # reserve now: tmpfs full later = SIGBUS
            else:
                os.ftruncate(fd, need)
            self._maps[self.rank] = mmap.mmap(fd, need)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path

    def _bind(self, name: str) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if sys.platform.startswith("linux"):
            s.bind("\0" + name)  # abstract: vanishes with the process
        else:
            path = os.path.join(tempfile.gettempdir(), name + ".sock")
            self._sock_paths.append(path)
            s.bind(path)
        s.setblocking(False)
        return s

    def _map_peer(self, r: int, name: str) -> None:
        d = shm_dir()
        fd = os.open(os.path.join(d, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != self._seg_bytes():
                raise OSError(
                    f"segment of rank {r} has {size} bytes, expected {self._seg_bytes()}: "
                    "HOROVOD_SHM_CHUNK_BYTES / HOROVOD_SHM_SLOTS differ between ranks"
                )
            self._maps[r] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._addr[r] = _address(name)
        self._eaddr[r] = _address(name + "e")

    def _build_channels(self) -> None:
        me = self.rank
        cb = self._chan_bytes()
        mine = self._maps[me]
        for r in self.peers:
            theirs = self._maps[r]
            # The channel r -> me lives in my segment at r's index among my peers, and
            # me -> r in r's segment at my index among r's peers.
            self._in[r] = _Chan(mine, PAGE + self._index(me, r) * cb, self.nslots, self.chunk)
            self._out[r] = _Chan(theirs, PAGE + self._index(r, me) * cb, self.nslots, self.chunk)
            self._asleep[r] = memoryview(theirs)[0:72].cast("q")  # [0] data, [8] engine
            rings = PAGE + (len(self.local) - 1) * cb
            self._rin[r] = _Ring(mine, rings + self._index(me, r) * (PAGE + RING))
            self._rout[r] = _Ring(theirs, rings + self._index(r, me) * (PAGE + RING))
        self._me_asleep = memoryview(mine)[0:72].cast("q")
        if len(self.local) == self.size:  # peer rounds need every rank on this host
            self.board = _Board(mine, {r: self._maps[r] for r in self.peers}, self._board_base())
            ob = self._out_base()
            for r in self.local:
                mv = memoryview(self._maps[r])
                self._out_views[r] = [
                    mv[ob + k * OUT_BYTES : ob + (k + 1) * OUT_BYTES] for k in range(OUT_SLOTS)
                ]
                mv.release()
            if self.outputs:
                self.out_owners = [np.frombuffer(v, np.uint8) for v in self._out_views[me]]

    def _setup_single_copy(self, store: Store, scope: str, timeout: float, threshold: int) -> None:
        """Use single-copy transfers if every local rank can read every other one's memory:
        each publishes a random probe, names its peers as allowed readers (Yama mode 1), and
        reads its peers' probes; all of them see all the verdicts, so they agree. Each also
        writes into a box of every peer: split broadcasts (which write) need every write to
        succeed too."""
        me = self.rank
        writes = True
        if not cma.available():
            verdict = "!no process_vm_readv on this platform"
        else:
            probe = ctypes.create_string_buffer(os.urandom(16), 16)  # alive until the verdicts
            box = ctypes.create_string_buffer(16)  # peers write here
            mine = (
                f"{os.getpid()}:{ctypes.addressof(probe)}:{probe.raw.hex()}:{threshold}"
                f":{ctypes.addressof(box)}"
            )
            store.set(scope, f"cma.{me}", mine.encode())
            peers = dict(
                zip(
                    self.local,
                    (
                        b.decode()
                        for b in store.wait(scope, [f"cma.{r}" for r in self.local], timeout)
                    ),
                    strict=True,
                )
            )
            pids = {r: int(v.split(":")[0]) for r, v in peers.items() if r != me}
            self._ptracer_set = cma.allow_readers(sorted(set(pids.values()) - {os.getpid()}))
            store.set(scope, f"cma.allowed.{me}", b"1")
            store.wait(scope, [f"cma.allowed.{r}" for r in self.local], timeout)
            verdict = "ok"
            for r, v in peers.items():
                pid, addr, want, limit, their_box = v.split(":")
                if int(limit) != threshold:
                    verdict = f"!single-copy thresholds differ ({limit} on rank {r})"
                    break
                if r == me:
                    continue
                got = ctypes.create_string_buffer(16)
                try:
                    cma.read(int(pid), int(addr), ctypes.addressof(got), 16)
                except OSError as e:
                    verdict = f"!rank {me} cannot read rank {r}'s memory: {e.strerror}"
                    break
                if got.raw.hex() != want:
                    verdict = f"!rank {me} read something else than rank {r}'s probe"
                    break
                try:
                    cma.write(int(pid), ctypes.addressof(probe), int(their_box), 16)
                except OSError as e:
                    writes = False
                    log.logger.info(
                        "rank %d cannot write rank %d's memory (%s): large broadcasts between "
                        "two ranks are read by the receiver alone",
                        me,
                        r,
                        e.strerror,
                    )
            if verdict == "ok" and not writes:
                verdict = "ok-read"
        store.set(scope, f"cma.ok.{me}", verdict.encode())
        done = [b.decode() for b in store.wait(scope, [f"cma.ok.{r}" for r in self.local], timeout)]
        why = next((d[1:] for d in done if not d.startswith("ok")), None)
        if why is not None:
            log.logger.info(
                "rank %d: single-copy transfers off on this host (%s); large messages use two "
                "copies through shared memory",
                me,
                why,
            )
            if self._ptracer_set:
                cma.forbid_readers()
                self._ptracer_set = False
            return
        self._pids = pids
        self.single_copy = threshold
        self.split_copy = all(d == "ok" for d in done)

    def _index(self, owner: int, sender: int) -> int:
        return [r for r in self.local if r != owner].index(sender)

    # ---------------------------------------------------------------- data plane
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        chunk, out, inc = self.chunk, self._out, self._in
        if len(sends) == 1 and len(recvs) == 1:
            (peer, smv), (rpeer, rmv) = sends[0], recvs[0]
            if (
                peer == rpeer
                and peer in out
                and 0 < smv.nbytes <= chunk
                and 0 < rmv.nbytes <= chunk
            ):
                self._swap_small(peer, smv, rmv)
                return
        for peer, mv in sends:
            if mv.nbytes > chunk or peer not in out:
                break
        else:
            for peer, mv in recvs:
                if mv.nbytes > chunk or peer not in inc:
                    break
            else:
                self._exchange_small(sends, recvs)
                return
        self.exchange_reduce(sends, recvs, ())

    def _swap_small(self, peer: int, smv: memoryview, rmv: memoryview) -> None:
        """One slot-sized message each way with one same-host peer (2-rank small collectives,
        the latency path): ``_exchange_small`` without its lists and sets."""
        if self._aborted is not None:
            raise TransportError(self._aborted)
        ch_out, ch_in = self._out[peer], self._in[peer]
        sent = recvd = False
        while True:
            moved = False
            if not sent and ch_out.put(smv):
                sent = moved = True
            if not recvd and ch_in.get(rmv):
                recvd = moved = True
            if moved:
                self._wake(peer)
                if sent and recvd:
                    return
            else:
                self._wait(
                    {} if sent else {peer: None},
                    {} if recvd else {peer: None},
                    {},
                    {},
                    max(smv.nbytes, rmv.nbytes),
                )

    def _exchange_small(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        """Every message fits one slot and every peer shares this host (small collectives):
        the same protocol as ``exchange_reduce`` without its per-message bookkeeping."""
        if self._aborted is not None:
            raise TransportError(self._aborted)
        outs = [(p, self._out[p], mv) for p, mv in sends if mv.nbytes]
        ins = [(p, self._in[p], mv) for p, mv in recvs if mv.nbytes]
        while outs or ins:
            touched: set[int] = set()
            if outs:
                outs = _advance(outs, _Chan.put, touched)
            if ins:
                ins = _advance(ins, _Chan.get, touched)
            for peer in touched:
                self._wake(peer)
            if not touched and (outs or ins):
                self._wait(
                    {p: None for p, _, _ in outs},
                    {p: None for p, _, _ in ins},
                    {},
                    {},
                    max(mv.nbytes for _, _, mv in outs + ins),
                )

    def exchange_oneway(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        """Two copies through the slots even for large messages: measured on 2 ranks, a
        broadcast whose root copies in while the receiver copies out beats the receiver
        reading alone (the root would idle)."""
        big = self.single_copy
        if not big or all(mv.nbytes < big for _, mv in (*sends, *recvs)):
            self.exchange(sends, recvs)  # nothing single-copy sized: keep the small-message paths
            return
        if self._aborted is not None:
            raise TransportError(self._aborted)
        self._exchange_reduce(sends, recvs, (), 1 << 62)

    def exchange_pair(self, peer: int, mv: memoryview, send: bool) -> None:
        """A large message to a local peer is split: the sender writes the first half into the
        receiver's memory while the receiver reads the second half from the sender's (both
        cores copy, each byte once; two copies through the slots, ``exchange_oneway``, take
        longer). Measured on 2 ranks, 64 MiB: 4.1-4.8 ms split, 4.6-5.4 ms through the slots."""
        if not self.split_copy or mv.nbytes < self.single_copy or peer not in self._out:
            super().exchange_pair(peer, mv, send)
            return
        if self._aborted is not None:
            raise TransportError(self._aborted)
        self._split_oneway(peer, mv, send)

    def _split_oneway(self, peer: int, mv: memoryview, sending: bool) -> None:
        """Both sides post their buffer's address in a slot and read the other's; the sender
        writes bytes [0, half) into the receiver, the receiver reads [half, end) from the
        sender; each marks the other's post read once its part is done (or once it knows it
        will not do it: an error), and returns when its own post is marked read (its buffer is
        then neither read nor written any more). A receiver that fails after posting first
        lets the sender finish or go (``_settle``): the caller may free the buffer then."""
        ch_out, ch_in, n = self._out[peer], self._in[peer], self.nslots
        nbytes = mv.nbytes
        mine = cma.address(mv)
        while ch_out.count - ch_out.rd[0] >= n:  # earlier chunks not yet read: no free slot
            self._wait({peer: None}, {}, {}, {})
        _DESC.pack_into(ch_out.slots[ch_out.count % n], 0, mine, nbytes)
        ch_out.count += 1
        posted = ch_out.count
        order()
        ch_out.wr[0] = posted
        self._wake(peer)
        try:
            while ch_in.count >= ch_in.wr[0]:
                self._wait({}, {peer: None}, {}, {})
            order()
            slot = ch_in.slots[ch_in.count % n]
            addr, theirs = _DESC.unpack_from(slot, 0)
            ok = False
            try:
                self._split_part(peer, mine, addr, nbytes, theirs, sending)
                ok = True
            finally:  # done with the peer's buffer, or never to touch it (and it must know)
                if not ok:
                    _DESC.pack_into(slot, 0, 0, _FAILED)
                ch_in.count += 1
                order()
                ch_in.rd[0] = ch_in.count
                self._wake(peer)
            if ch_out.rd[0] < posted:
                done = partial(_reached, ch_out.rd, posted)
                while not done():
                    self._wait({}, {peer: None}, {}, {}, self.chunk, done)
            order()
            if _DESC.unpack_from(ch_out.slots[(posted - 1) % n], 0)[1] == _FAILED:
                raise TransportError(
                    f"rank {peer} failed its part of a broadcast with rank {self.rank} (its "
                    "own error says why)"
                )
        except BaseException:
            if not sending:
                self._settle(peer, ch_out.rd, posted, nbytes)
            raise

    def _split_part(
        self, peer: int, mine: int, addr: int, nbytes: int, theirs: int, sending: bool
    ) -> None:
        if theirs != nbytes:
            raise TransportError(
                f"rank {peer} posted a {theirs}-byte buffer for a broadcast where rank "
                f"{self.rank} has {nbytes} bytes: the ranks run different collectives"
            )
        if self._aborted is not None:
            raise TransportError(self._aborted)
        half = nbytes // 2 // PAGE * PAGE
        pid = self._pids[peer]
        try:
            if sending:
                cma.write(pid, mine, addr, half)
            else:
                cma.read(pid, addr + half, mine + half, nbytes - half)
        except OSError as e:
            what = "write into" if sending else "read"
            raise self._cma_failed(peer, e, f"{what} rank {peer}'s memory") from e

    def _settle(self, peer: int, rd: memoryview, posted: int, nbytes: int) -> None:
        """A receiver leaving a split broadcast on an error, its address posted: wait (without
        heeding the abort) until the sender has marked the post read (written or given up), or
        its process is gone, or a bound of 2 s plus the time to write the message has passed,
        so that it does not write into memory the caller frees or reuses. (Our own abort shut
        our TCP connections, so only the process tells whether the sender still runs.)"""
        bound = 2.0 + nbytes / 1e9
        deadline = time.monotonic() + bound
        while rd[0] < posted:
            try:
                os.kill(self._pids[peer], 0)
            except ProcessLookupError:
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log.logger.warning(
                    "rank %d: rank %d neither did nor gave up its part of a broadcast within "
                    "%.1f s of an error; leaving it",
                    self.rank,
                    peer,
                    bound,
                )
                return
            time.sleep(0.001)

    def exchange_copy(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        copies: Sequence[tuple[memoryview, memoryview]],
    ) -> None:
        """With a single-copy receive in the step, the copies are done in pieces between
        reads of it (each rank's own block then crosses the shared cache once for both of its
        readers) and while waiting; otherwise first."""
        big = self.single_copy
        if not big or all(mv.nbytes < big or p not in self._in for p, mv in recvs):
            super().exchange_copy(sends, recvs, copies)
            return
        if self._aborted is not None:
            raise TransportError(self._aborted)
        self._exchange_reduce(sends, recvs, (), big, _Copier(copies))

    def exchange_reduce(
        self, sends: Sequence[Message], recvs: Sequence[Message], reduces: Sequence[Reduce]
    ) -> None:
        if self._aborted is not None:
            raise TransportError(self._aborted)
        self._exchange_reduce(sends, recvs, reduces, self.single_copy or (1 << 62))

    def _exchange_reduce(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        reduces: Sequence[Reduce],
        big: int,
        copier: _Copier | None = None,
    ) -> None:
        """``exchange_reduce`` where local messages of at least ``big`` bytes go by single copy
        (and ``copier``'s copies are done between reads and while waiting)."""
        out: dict[int, list[_Pending]] = {}
        inc: dict[int, list[_Pending]] = {}
        r_sends: list[Message] = []
        r_recvs: list[Message] = []
        after: list[tuple[np.ndarray, Reducer, np.ndarray]] = []
        for peer, mv in sends:
            if mv.nbytes:
                if peer in self._out:
                    out.setdefault(peer, []).append(
                        _Pending(mv.cast("B"), None, None, mv.nbytes >= big)
                    )
                else:
                    r_sends.append((peer, mv))
        for peer, mv in recvs:
            if mv.nbytes:
                if peer in self._in:
                    inc.setdefault(peer, []).append(
                        _Pending(mv.cast("B"), None, None, mv.nbytes >= big)
                    )
                else:
                    r_recvs.append((peer, mv))
        remote_reduces = [(p, d, op) for p, d, op in reduces if d.nbytes and p not in self._in]
        if remote_reduces:
            total = sum(d.nbytes for _, d, _ in remote_reduces)
            raw = self._scratch.get(total, np.dtype(np.uint8))
            off = 0
            for p, d, op in remote_reduces:
                tmp = raw[off : off + d.nbytes].view(d.dtype)
                off += d.nbytes
                r_recvs.append((p, as_bytes(tmp)))
                after.append((d, op, tmp))
        for peer, dst, op in reduces:
            if dst.nbytes and peer in self._in:
                inc.setdefault(peer, []).append(_Pending(as_bytes(dst), dst, op, dst.nbytes >= big))
        tcp = self.inner
        r_out: dict = {}
        r_inc: dict = {}
        if r_sends or r_recvs:
            r_out, r_inc = tcp.queue(r_sends, r_recvs)  # type: ignore[attr-defined]
        while out or inc or r_out or r_inc:
            moved = self._progress(out, inc, copier)
            if r_out or r_inc:
                moved = tcp.progress(r_out, r_inc) or moved  # type: ignore[attr-defined]
            if not moved:
                if copier is not None and copier.left:
                    copier.some(COPY_PIECE)  # rather than wait
                    continue
                self._wait(out, inc, r_out, r_inc, self.chunk)
        if copier is not None:
            copier.some(copier.left)
        for d, op, tmp in after:
            op(d, tmp, out=d)

    def _progress(
        self,
        out: dict[int, list[_Pending]],
        inc: dict[int, list[_Pending]],
        copier: _Copier | None = None,
    ) -> bool:
        moved = False
        nslots, chunk = self.nslots, self.chunk
        for peer in list(out):
            ch = self._out[peer]
            q = out[peer]
            # Direct sends posted earlier (at the front, in order) end when the receiver
            # has read them.
            while q and q[0].ack and ch.rd[0] >= q[0].ack:
                q.pop(0)
                moved = True
            i = 0
            while i < len(q) and q[i].ack:
                i += 1
            wrote = False
            while i < len(q) and ch.count - ch.rd[0] < nslots:
                p = q[i]
                slot = ch.slots[ch.count % nslots]
                if p.direct:  # post where the message lies; it must stay there until read
                    _DESC.pack_into(slot, 0, cma.address(p.mv), p.mv.nbytes)
                    ch.count += 1
                    p.ack = ch.count
                    i += 1
                else:
                    n = min(chunk, p.mv.nbytes - p.off)
                    slot[:n] = p.mv[p.off : p.off + n]
                    p.off += n
                    ch.count += 1
                    if p.off == p.mv.nbytes:
                        q.pop(i)
                order()
                ch.wr[0] = ch.count
                wrote = True
            if wrote:
                moved = True
                self._wake(peer)
            if not q:
                del out[peer]
        for peer in list(inc):
            ch = self._in[peer]
            q = inc[peer]
            read = False
            while q and ch.count < ch.wr[0]:
                order()
                p = q[0]
                slot = ch.slots[ch.count % nslots]
                if p.direct:
                    self._read_direct(peer, p, slot, copier)
                    n = p.mv.nbytes
                elif p.dst is None:
                    n = min(chunk, p.mv.nbytes - p.off)
                    p.mv[p.off : p.off + n] = slot[:n]
                else:
                    n = min(chunk, p.mv.nbytes - p.off)
                    item = p.dst.itemsize
                    lo, k = p.off // item, n // item
                    seg = p.dst[lo : lo + k]
                    p.op(seg, np.frombuffer(slot, p.dst.dtype, k), out=seg)
                p.off += n
                ch.count += 1
                order()
                ch.rd[0] = ch.count
                read = True
                if p.off == p.mv.nbytes:
                    q.pop(0)
            if read:
                moved = True
                self._wake(peer)
            if not q:
                del inc[peer]
        return moved

    def _read_direct(
        self, peer: int, p: _Pending, slot: memoryview, copier: _Copier | None = None
    ) -> None:
        """Receive ``p`` from ``peer``'s memory at the address its slot names: one copy into
        the destination (in pieces, each after a share of ``copier``'s copies), or for a
        reduction chunk by chunk through scratch (cache-sized)."""
        addr, nbytes = _DESC.unpack_from(slot, 0)
        if nbytes != p.mv.nbytes:
            raise TransportError(
                f"rank {peer} posted a {nbytes}-byte message where rank {self.rank} expected "
                f"{p.mv.nbytes} bytes: the ranks run different collectives"
            )
        pid = self._pids[peer]
        try:
            if p.dst is None:
                where = cma.address(p.mv)
                if copier is None or not copier.left:
                    cma.read(pid, addr, where, nbytes)
                    return
                pieces = -(-nbytes // COPY_PIECE)
                share = -(-copier.left // pieces)
                for off in range(0, nbytes, COPY_PIECE):
                    copier.some(share)
                    cma.read(pid, addr + off, where + off, min(COPY_PIECE, nbytes - off))
                return
            dst = p.dst
            item, step = dst.itemsize, self.chunk
            tmp = self._scratch.get(step, np.dtype(np.uint8))
            where = int(tmp.ctypes.data)
            for off in range(0, nbytes, step):
                n = min(step, nbytes - off)
                cma.read(pid, addr + off, where, n)
                seg = dst[off // item : (off + n) // item]
                p.op(seg, tmp[:n].view(dst.dtype), out=seg)
        except OSError as e:
            raise self._cma_failed(peer, e, f"read a message from rank {peer}'s memory") from e

    def _cma_failed(self, peer: int, e: OSError, what: str) -> TransportError:
        """The error for a failed single-copy transfer with ``peer``: the abort's reason, or
        the peer's loss (raised), or what failed and the way out."""
        if self._aborted is not None:
            return TransportError(self._aborted)
        self._check_alive(peer)
        return TransportError(
            f"rank {self.rank} could not {what} ({e.strerror}); set "
            "HOROVOD_SHM_SINGLE_COPY_BYTES=0 to move large messages through shared memory instead"
        )

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
                events = poller.poll(1 if self._backlog else _POLL_MS)
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

    # ---------------------------------------------------------------- control plane
    def send_ctrl(self, peer: int, payload: bytes) -> None:
        self.inner.send_ctrl(peer, payload)

    # The engine's own messages (requests, response lists) to same-host ranks travel through
    # rings in shared memory and are read by whichever thread runs the engine: no reader thread
    # and no socket between them. Only the thread running the engine calls these.
    def is_fast(self, peer: int) -> bool:
        return peer in self._rout

    def send_fast(self, peer: int, payload: bytes) -> None:
        ring = self._rout.get(peer)
        if ring is None:
            self.inner.send_ctrl(peer, payload)
            return
        if self._aborted is not None:
            raise TransportError(self._aborted)
        frame = len(payload).to_bytes(FRAME, "little") + payload
        if ring.put(frame):
            self._wake(peer, ctrl=True)
            return
        ring.pending.append(memoryview(frame))
        self._backlog = True
        if ring.flush():
            self._wake(peer, ctrl=True)

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

    def poll_fast(self) -> list[tuple[int, bytes]]:
        """Control messages that same-host ranks sent (complete ones, in order per peer)."""
        got: list[tuple[int, bytes]] = []
        for peer, ring in self._rin.items():
            if ring.count != ring.wr[0] and ring.take() == RING:
                self._wake(peer, ctrl=True)  # the ring was full: it may wait for room
            if ring.acc:
                for payload in ring.frames():
                    got.append((peer, payload))
        if self._backlog:
            self._flush_backlog()
        return got

    def board_post(
        self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0, out: int = -1
    ) -> None:
        """Post the engine's next peer round (``_Board.post``) and wake sleeping peers."""
        board = self.board
        assert board is not None
        if self._aborted is not None:
            raise TransportError(self._aborted)
        board.post(cids, parts, tag, out)
        for peer in self.peers:
            self._wake(peer, ctrl=True)

    def out_slot(self, nbytes: int) -> int:
        """A free output slot of this rank for a result of ``nbytes`` (``out_owners[k]`` is
        a uint8 array over all of it), or -1: outputs off, too large, or every slot still
        referenced by an earlier result. A slot is free again once no view of it is alive,
        as in the engine's output pool."""
        if nbytes <= OUT_BYTES:
            owners = self.out_owners
            for k in range(len(owners)):
                # 2 = the list's reference and getrefcount's argument: no view is alive.
                if sys.getrefcount(owners[k]) == 2:
                    return k
        return -1

    def peer_out(self, peer: int, k: int) -> memoryview:
        """Output slot ``k`` of local rank ``peer`` (read-only use)."""
        return self._out_views[peer][k]

    def board_ack(self, readers_of: Sequence[int]) -> None:
        """This rank has read the output slots of ``readers_of`` for its round: tell them (a
        datagram to any of them that sleeps waiting for it)."""
        board = self.board
        assert board is not None
        board.ack()
        for peer in readers_of:
            self._wake(peer)

    def board_wait_acked(self) -> None:
        """Wait until every peer has read this rank's output slot for its round (they have
        all posted it, so they only have their reads left)."""
        board = self.board
        assert board is not None
        while True:
            waiting = board.unacked()
            if not waiting:
                return
            self._wait({}, dict.fromkeys(waiting), {}, {}, 0, board.all_acked)

    def ctrl_idle(self) -> bool:
        """No control message from a same-host rank to read, none waiting to be sent."""
        if self._backlog:
            return False
        for ring in self._rin.values():
            if ring.count != ring.wr[0] or ring.acc:
                return False
        for ring in self._rout.values():
            if ring.pending:
                return False
        return True

    def fast_pending(self) -> bool:
        """Is there anything for ``poll_fast`` to read or send, or a peer round to decide?"""
        if self.board is not None and self.board.due():
            return True
        for ring in self._rin.values():
            if ring.count != ring.wr[0]:
                return True
        for ring in self._rout.values():
            if ring.pending and ring.room():
                return True
        return False

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
            poller.poll(-1 if timeout is None else max(0, int(timeout * 1000 + 0.999)))
        finally:
            self._exit_sleep(engine=True)
            self._drain(sock)

    def nap(self, seconds: float) -> None:
        """Sleep ``seconds`` unless ``kick`` is called; peers are not asked to wake us."""
        sock = self._esock
        assert sock is not None
        fd = sock.fileno()
        if fd < 1024:  # select() has microsecond resolution, poll() only milliseconds
            select.select([fd], [], [], max(0.0, seconds))
        else:
            poller = select.poll()
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

    def flush_fast(self, timeout: float) -> None:
        """Give queued control messages up to ``timeout`` s to fit into their rings."""
        deadline = time.monotonic() + timeout
        while any(r.pending for r in self._rout.values()) and time.monotonic() < deadline:
            for peer, ring in self._rout.items():
                if ring.pending and ring.flush():
                    self._wake(peer, ctrl=True)
            time.sleep(0.001)

    def start_ctrl(self, handler: CtrlHandler) -> None:
        self.inner.start_ctrl(handler)

    # ---------------------------------------------------------------- teardown
    def abort(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self.inner.abort(reason)
        for sock in (self._sock, self._esock):  # wake our own sleeping waits
            if sock is not None:
                try:
                    sock.sendto(b"x", sock.getsockname())
                except OSError:
                    pass

    def close(self) -> None:
        if self._aborted is None and not self._closed:
            self.flush_fast(2.0)  # e.g. the coordinator's final response list
        self.inner.close()
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ptracer_set:
            cma.forbid_readers()
            self._ptracer_set = False
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
        for sock in (self._sock, self._esock):
            if sock is not None:
                sock.close()
        for path in self._sock_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        for ch in list(self._in.values()) + list(self._out.values()):
            for v in [ch.wr, ch.rd, *ch.slots]:
                v.release()
        for v in self._asleep.values():
            v.release()
        for ring in list(self._rin.values()) + list(self._rout.values()):
            ring.release()
        if self.board is not None:
            self.board.release()
            self.board = None
        self.out_owners = []
        for views in self._out_views.values():
            for v in views:
                try:
                    v.release()
                except BufferError:
                    pass  # a result still lives there; the mapping goes with it
        self._out_views.clear()
        self._rin.clear()
        self._rout.clear()
        if hasattr(self, "_me_asleep"):
            self._me_asleep.release()
        self._in.clear()
        self._out.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a view is still referenced; the mapping goes with it
        self._maps.clear()

    @property
    def aborted(self) -> str | None:
        return self._aborted


def _address(name: str) -> str:
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name + ".sock")


class _Unusable(TransportError):
    """Shared memory cannot be set up on this host (all its ranks agree)."""
