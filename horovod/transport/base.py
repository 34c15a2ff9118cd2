"""The Transport contract.

Data plane: ``exchange(sends, recvs)`` posts every send and receive of one algorithm step at
once and returns when all are complete. Messages between a pair of ranks are matched in the
order they are posted, and a receive must have exactly the byte length of the matching send;
zero-length messages are not transmitted at all (both sides skip them, since lengths agree).
Only the engine thread calls ``exchange``. ``exchange_reduce(sends, recvs, reduces)`` is the same
step with receives that are combined into an array instead of stored: for ``(peer, dst, op)``
the incoming message (``dst.nbytes`` long) ends as ``op(dst, incoming, out=dst)``. The shared-
memory transport reduces straight out of its slots chunk by chunk; others receive into scratch.
``exchange_copy(sends, recvs, copies)`` is ``exchange`` plus local copies ``(dst, src)`` (byte
views of one length) that the transport may interleave with the step's transfers; no send may
read a copy's ``dst``. By default the copies come first.

Control plane: a star between rank 0 (the coordinator) and every other rank, carrying framed
messages. ``send_ctrl`` is thread-safe; ``start_ctrl(handler)`` makes the transport call
``handler(peer, payload)`` for each message received and ``handler(peer, None)`` once when the
connection to ``peer`` is lost. The handler runs on a transport thread and must not block.

``abort(reason)`` may be called from any thread: every ``exchange`` in progress or started later
raises ``TransportError(reason)`` promptly, and peers blocked on this rank see the connection
drop. ``close()`` ends a transport after a clean shutdown.

Capabilities beyond that contract, which decide the engine's fast paths (docs/architecture.md):

- ``PolledTransport``: control messages from same-host ranks arrive in memory that a thread
  polls (``poll_fast``), so the thread that waits for a result can run the engine itself, and
  the engine thread sleeps in the transport until a peer or ``kick`` wakes it.
- ``PeerBoard`` (``PolledTransport.board``, when every rank of the job shares the host): the
  board where ranks post peer rounds and read each other's posts, and output slots where an
  allgather's result may live while the peers read this rank's block from it.

The engine uses a transport only through these classes; a new data plane (MPI, NCCL) is one
new module implementing them, and passes ``tests/test_transport_conformance.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

CtrlHandler = Callable[[int, "bytes | None"], None]
Message = tuple[int, memoryview]
Reducer = Callable[..., np.ndarray]
Reduce = tuple[int, np.ndarray, Reducer]


class Scratch:
    """A growable byte buffer reused across calls (no allocation on the hot path)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def get(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.nbytes), np.uint8)
        return self._buf[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes


def as_bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class Transport(ABC):
    rank: int
    size: int
    kind = "DIRECT"  # names the data path in timeline activities (TCP_ALLREDUCE, ...)
    # The host of every rank (set at hvd.init()); hierarchical algorithms group ranks by it.
    hosts: list[str] | None = None
    # The plane's own collectives (MPI), which the algorithms prefer where they apply
    # (``horovod.collectives.algorithms.native``); None: point-to-point only.
    native: object | None = None
    # ``exchange_pair`` messages (two-rank broadcasts) of this many bytes or more are split
    # between both sides (the shared-memory plane's single copy), faster than a peer round
    # carrying the data; 0: none are.
    split_pair_bytes: int = 0

    @abstractmethod
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None: ...

    def exchange_reduce(
        self, sends: Sequence[Message], recvs: Sequence[Message], reduces: Sequence[Reduce]
    ) -> None:
        """``exchange`` where each of ``reduces`` is combined into its array on arrival."""
        if not reduces:
            self.exchange(sends, recvs)
            return
        scratch = self.__dict__.setdefault("_reduce_scratch", Scratch())
        total = sum(dst.nbytes for _, dst, _ in reduces)
        raw = scratch.get(total, np.dtype(np.uint8))
        tmps, off = [], 0
        for _, dst, _ in reduces:
            tmps.append(raw[off : off + dst.nbytes].view(dst.dtype))
            off += dst.nbytes
        self.exchange(
            sends,
            list(recvs)
            + [(p, as_bytes(tmp)) for (p, _, _), tmp in zip(reduces, tmps, strict=True)],
        )
        for (_, dst, op), tmp in zip(reduces, tmps, strict=True):
            op(dst, tmp, out=dst)

    def exchange_copy(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        copies: Sequence[tuple[memoryview, memoryview]],
    ) -> None:
        """``exchange`` plus the local copies ``(dst, src)``, in any order relative to the
        transfers (a rank's own block of an allgather: the shared-memory transport copies it
        piece by piece between reads of the peer's block, while that block is in cache)."""
        for dst, src in copies:
            dst[:] = src
        self.exchange(sends, recvs)

    def exchange_oneway(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        """``exchange`` for a step whose data flows one way between each pair (a broadcast
        tree: the sender has nothing else to do). The shared-memory transport then keeps both
        sides copying (pipelined through its slots) instead of letting the receiver read
        everything alone; both sides of a pair must use the same form."""
        self.exchange(sends, recvs)

    def exchange_pair(self, peer: int, mv: memoryview, send: bool) -> None:
        """One message to (``send``) or from ``peer``, whose call is the mirror image: the step
        has no other message on either side (a two-rank broadcast). The shared-memory
        transport splits a large one between both sides."""
        if send:
            self.exchange_oneway([(peer, mv)], [])
        else:
            self.exchange_oneway([], [(peer, mv)])

    def direct_reads(self, nbytes: int, ranks: Sequence[int] | None = None) -> bool:
        """Is a message of ``nbytes`` between any two of ``ranks`` (default: every rank of
        this transport) read straight from the sender's memory (one copy, the sender only
        waits), so that every other rank may read one rank's buffer at once (a broadcast's
        star)? False unless a transport knows better."""
        return False

    @abstractmethod
    def send_ctrl(self, peer: int, payload: bytes) -> None: ...

    @abstractmethod
    def start_ctrl(self, handler: CtrlHandler) -> None: ...

    @abstractmethod
    def abort(self, reason: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def global_rank(self, rank: int) -> int:
        return rank


class PeerBoard(ABC):
    """Peer rounds' board: each rank posts what it is about to run for round ``n`` (cache ids,
    a tag, and data) into memory every rank of the host reads; once all have posted, every
    rank reads every post, so all decide the same. A rank posts round n+1 only after reading
    every post of round n. Posting goes through ``PolledTransport.board_post`` (which wakes
    sleeping peers); this is the reading side and the round's state."""

    data_bytes: ClassVar[int]  # the most data one post carries
    max_ids: ClassVar[int]  # the most cache ids one post carries
    open: bool  # this rank posted its round and not every peer has yet
    deferred: bool  # a peer's round is seen and this rank leaves its answer for later

    @abstractmethod
    def due(self) -> bool:
        """Can this rank's open round be decided, or does a peer wait for this rank's post?"""

    @abstractmethod
    def opened(self) -> bool:
        """Has a peer posted a round this rank has not?"""

    @abstractmethod
    def tags(self) -> list[int]:
        """The tags of the peers' posts of this rank's next round that are there already."""

    @abstractmethod
    def waiting(self) -> list[int]:
        """Peers that have not posted this rank's open round yet."""

    @abstractmethod
    def read(self) -> list[tuple[int, int, list[int], memoryview, int]]:
        """Every peer's post of the open round: (rank, tag, cache ids, data, output slot or
        -1); call once ``due()``."""


# Where ranks outnumber the machine's cores, a waiting rank's polls yield the CPU between
# looks, and it polls this many times as long before it sleeps: a yielding poll holds no core
# a peer could use, while every sleep costs a wake-up, and with four ranks on two cores a peer
# is often not scheduled within the plain spin. Measured on the 2-core VM (benchmarks.md, stop
# 61), a barrier then a 4-byte allreduce at 4 ranks on two host names: about 800 us each at
# 100 us of spin, 130-510 us at 1 ms (the same ops back to back take about 300 us); at 3
# ranks 100-560 us against 50-460 us; loops of ops without a barrier were even.
OVERSUBSCRIBED_SPIN_FACTOR = 10


def spin_seconds(spin_us: float, oversubscribed: bool) -> float:
    """How long a waiting thread polls before it sleeps: HOROVOD_SPIN_MICROSECONDS
    (``spin_us``), ``OVERSUBSCRIBED_SPIN_FACTOR`` times that where ranks outnumber the cores
    (0 stays 0: sleep at once)."""
    return spin_us / 1e6 * (OVERSUBSCRIBED_SPIN_FACTOR if oversubscribed else 1)


class PolledTransport(Transport):
    """A transport whose same-host control messages a thread polls, so the thread waiting
    for a result can run the engine (see "Who runs the engine" in docs/architecture.md). Only
    the thread holding the engine's ``drive`` lock calls ``poll_fast``, ``send_fast`` and the
    board's methods; ``kick`` may be called from any thread."""

    spin_s: float = 0.0  # how long a waiting thread polls before it hands over and sleeps
    oversubscribed: bool = False  # more ranks than cores: waiting loops yield the CPU
    board: PeerBoard | None = None  # when every rank of the job shares this host
    outputs: bool = False  # allgather results may live in this rank's output slots
    out_min: int = 0  # ... for a block of at least this many bytes
    out_owners: list[np.ndarray] = []  # (read-only) this rank's output slots, as bytes

    @property
    def aborted(self) -> str | None:
        """Why this transport was aborted, or None."""
        return None

    @abstractmethod
    def poll_fast(self) -> list[tuple[int, bytes]]:
        """Control messages that same-host ranks sent (complete ones, in order per peer)."""

    @abstractmethod
    def fast_pending(self) -> bool:
        """Is there anything for ``poll_fast`` to read or send, or a round to decide?"""

    @abstractmethod
    def is_fast(self, peer: int) -> bool:
        """Do the engine's messages to and from ``peer`` go through polled memory?"""

    @abstractmethod
    def send_fast(self, peer: int, payload: bytes) -> None:
        """An engine-to-engine message (through polled memory where ``is_fast(peer)``)."""

    @abstractmethod
    def set_driving(self, on: bool) -> None:
        """Publish whether a thread of this rank polls (peers then need not wake it)."""

    @abstractmethod
    def kick(self) -> None:
        """Wake this rank's engine thread if it is blocked in ``sleep`` or ``nap``."""

    @abstractmethod
    def sleep(self, timeout: float | None, busy: Callable[[], bool]) -> None:
        """Block until a same-host rank sends a message, ``kick`` is called or ``timeout``
        passes; return at once if ``busy()`` or messages are there."""

    @abstractmethod
    def nap(self, seconds: float, alarm: int | None = None) -> None:
        """Sleep ``seconds`` unless ``kick`` is called (peers are not asked to wake us), or,
        with ``alarm`` (a file descriptor: ``horovod.common.alarm``), until it is readable.
        Only where ``naps_on_alarm``."""

    naps_on_alarm = False  # ``nap`` takes an alarm (it sleeps on file descriptors)

    def ctrl_idle(self) -> bool:
        """No control message from a same-host rank to read, none waiting to be sent."""
        return True

    # The board's writing side (only where ``board`` is set).
    def board_post(
        self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0, out: int = -1
    ) -> None:
        """Post this rank's next round: ``cids``, their data ``parts`` in order (or, with
        ``out`` >= 0, none: the data is in output slot ``out``), and ``tag``; wake peers."""
        raise NotImplementedError("this transport has no peer-round board")

    def out_slot(self, nbytes: int) -> int:
        """A place for a result of ``nbytes`` in a free output slot, or -1."""
        return -1

    def out_owner(self, place: int) -> np.ndarray:
        """This rank's output bytes from ``place`` on (``out_slot``)."""
        raise NotImplementedError("this transport has no output slots")

    def peer_out(self, peer: int, place: int) -> memoryview:
        """Output bytes of same-host rank ``peer`` from ``place`` on (read-only use)."""
        raise NotImplementedError("this transport has no output slots")

    def board_ack(self, readers_of: Sequence[int]) -> None:
        """This rank has read the output slots of ``readers_of`` for its round."""
        raise NotImplementedError("this transport has no output slots")

    def board_wait_acked(self) -> None:
        """Wait until every peer has read this rank's output slot for its round."""
        raise NotImplementedError("this transport has no output slots")


class SubTransport:
    """The data plane restricted to a subset of ranks (a process set): rank ``i`` of the view
    is global rank ``ranks[i]``, so every algorithm runs on subsets unchanged."""

    def __init__(self, parent: Transport, ranks: Sequence[int]) -> None:
        self.parent = parent
        self.ranks = list(ranks)
        self.rank = self.ranks.index(parent.rank)
        self.size = len(self.ranks)
        self.kind = parent.kind
        names = getattr(parent, "hosts", None)
        self.hosts = [names[r] for r in self.ranks] if names else None
        self._native: object | None = None

    @property
    def native(self) -> object | None:
        """The parent plane's collectives on a communicator of these ranks (made by the
        plane on first use), or None where the plane has none."""
        whole = getattr(self.parent, "native", None)
        if self._native is None and whole is not None:
            self._native = whole.subset(self.ranks)
        return self._native

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        r = self.ranks
        self.parent.exchange([(r[p], m) for p, m in sends], [(r[p], m) for p, m in recvs])

    def exchange_copy(
        self,
        sends: Sequence[Message],
        recvs: Sequence[Message],
        copies: Sequence[tuple[memoryview, memoryview]],
    ) -> None:
        r = self.ranks
        self.parent.exchange_copy(
            [(r[p], m) for p, m in sends], [(r[p], m) for p, m in recvs], copies
        )

    def exchange_oneway(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        r = self.ranks
        self.parent.exchange_oneway([(r[p], m) for p, m in sends], [(r[p], m) for p, m in recvs])

    def exchange_pair(self, peer: int, mv: memoryview, send: bool) -> None:
        self.parent.exchange_pair(self.ranks[peer], mv, send)

    def direct_reads(self, nbytes: int, ranks: Sequence[int] | None = None) -> bool:
        r = self.ranks
        return self.parent.direct_reads(nbytes, r if ranks is None else [r[p] for p in ranks])

    def exchange_reduce(
        self, sends: Sequence[Message], recvs: Sequence[Message], reduces: Sequence[Reduce]
    ) -> None:
        r = self.ranks
        self.parent.exchange_reduce(
            [(r[p], m) for p, m in sends],
            [(r[p], m) for p, m in recvs],
            [(r[p], d, op) for p, d, op in reduces],
        )

    def global_rank(self, rank: int) -> int:
        return self.ranks[rank]
