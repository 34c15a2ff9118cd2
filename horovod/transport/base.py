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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

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
