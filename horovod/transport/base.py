"""The Transport contract.

Data plane: ``exchange(sends, recvs)`` posts every send and receive of one algorithm step at
once and returns when all are complete. Messages between a pair of ranks are matched in the
order they are posted, and a receive must have exactly the byte length of the matching send;
zero-length messages are not transmitted at all (both sides skip them, since lengths agree).
Only the engine thread calls ``exchange``.

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


def as_bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class Transport(ABC):
    rank: int
    size: int
    kind = "DIRECT"  # names the data path in timeline activities (TCP_ALLREDUCE, ...)

    @abstractmethod
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None: ...

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

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        r = self.ranks
        self.parent.exchange([(r[p], m) for p, m in sends], [(r[p], m) for p, m in recvs])

    def global_rank(self, rank: int) -> int:
        return self.ranks[rank]
