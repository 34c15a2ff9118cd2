"""The engine's board for peer rounds in a job on several hosts (the ``PeerBoard`` of a
shared-memory transport whose other hosts are reached over TCP).

Peer rounds need every rank to see every other rank's post. On one host the posts are in
shared memory (``shm.board``); between ranks that talk over TCP alone they travel on board
connections (``tcp_board``). A rank of a host with shared memory in a job on several hosts
has both kinds of peer: ``MixedBoard`` posts to both boards and decides a round once both
have every post, so a small cached op costs a post to each rank instead of a request to rank
0 and its response (two round trips through rank 0, which on a 2 x 2 job took 350 us against
about 200 us for a peer round over TCP).

Rank 0 reads a post last: it may finish a round as soon as it has every post and then send a
response list, which must not reach a rank before a post that rank still waits for (the TCP
board keeps the same rule among its peers). Where rank 0 shares this rank's host, a post whose
TCP copies have not all been taken by their sockets yet is written to shared memory but
published (made visible to the host's peers) only once they have, which the next read checks.
Where rank 0 is on another host, the post is published in shared memory before the TCP copies
go out.

Only the thread holding the engine's ``drive`` lock calls these methods (as on either board),
``due_now`` aside: it reads no socket, so any thread may ask (the TCP board's reads are not
thread-safe: ``fast_pending`` once asked ``due`` from another thread, whose read of half a
post made the next read look like a closed connection).

Output slots (an allgather's result read from the poster's shared memory) are off in such a
job: the other hosts cannot read them, so every post carries its data.

Must not touch: either board's internals beyond its public methods; waking local peers
(``wake_local`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from horovod.transport.base import PeerBoard

if TYPE_CHECKING:  # (the shared-memory package imports this module)
    from horovod.transport.shm.board import Board
    from horovod.transport.tcp_board import TcpBoard


class MixedBoard(PeerBoard):
    """A shared-memory board for this host's peers and a TCP board for the other hosts'."""

    def __init__(
        self, local: Board, remote: TcpBoard, rank0_local: bool, wake_local: Callable[[], None]
    ) -> None:
        """``rank0_local``: rank 0 is one of ``local``'s peers (this rank is not rank 0), so
        this rank's posts reach the host's ranks only once the TCP ones are taken whole;
        ``wake_local()``: wake this host's sleeping peers (a post was published)."""
        self.local, self.remote = local, remote
        self.data_bytes = min(local.data_bytes, remote.data_bytes)  # type: ignore[misc]
        self.max_ids = min(local.max_ids, remote.max_ids)  # type: ignore[misc]
        self._rank0_local = rank0_local
        self._wake_local = wake_local
        self.unpublished = False  # this rank's last post waits for its TCP copies

    # (the round state lives in both boards, always alike: the engine sets it here)
    @property
    def open(self) -> bool:  # type: ignore[override]
        return self.local.open

    @open.setter
    def open(self, value: bool) -> None:
        self.local.open = self.remote.open = value

    @property
    def deferred(self) -> bool:  # type: ignore[override]
        return self.local.deferred

    @deferred.setter
    def deferred(self, value: bool) -> None:
        self.local.deferred = self.remote.deferred = value

    def _publish_if_sent(self) -> None:
        if self.unpublished and not self.remote.backlogged():
            self.unpublished = False
            self.local.publish()
            self._wake_local()

    def _opened_now(self) -> bool:
        return self.local.opened() or self.remote.opened_now()

    def due(self) -> bool:
        if self.local.open:
            got = self.remote.due()  # (reads and flushes the TCP board; raises if lost)
            self._publish_if_sent()
            return got and self.local.due()
        return not self.local.deferred and self.opened()

    def due_now(self) -> bool:
        """``due`` from what was read so far, without socket I/O: a thread that does not hold
        ``drive`` may ask (``fast_pending``; the TCP board's reads are the drive holder's)."""
        if self.unpublished and not self.remote.backlogged():
            return True  # (the drive holder publishes it)
        if self.local.open:
            return self.local.due() and self.remote.due_now()
        return not self.local.deferred and self._opened_now()

    def opened(self) -> bool:
        self.remote.pump()
        self._publish_if_sent()
        return self._opened_now()

    def tags(self) -> list[int]:
        return self.local.tags() + self.remote.tags()

    def waiting(self) -> list[int]:
        return sorted(self.local.waiting() + self.remote.waiting())

    def read(self) -> list[tuple[int, int, list[int], memoryview, int]]:
        return sorted(self.local.read() + self.remote.read(), key=lambda post: post[0])

    def post(
        self, cids: Sequence[int], parts: Sequence[memoryview], tag: int = 0, out: int = -1
    ) -> None:
        """Post round ``n + 1`` to every peer (``Board.post``; ``out`` must be -1), rank 0
        last: with rank 0 on this host, the TCP copies first and the host's copy published
        once they are out; with rank 0 on another host (or this rank rank 0), the host's copy
        first, then the TCP ones (rank 0's last of those)."""
        assert out < 0, "no output slots in a job on several hosts"
        if not self._rank0_local:
            # (else rank 0 could end the round and send a shutdown list that reaches a peer
            # on this host before this post does: the list would end that peer's open round,
            # as it did a 4-rank job's last broadcast under load, 3-4 runs in 30)
            self.local.post(cids, parts, tag, -1)
            self._wake_local()
            self.remote.post(cids, parts, tag)
            return
        self.remote.post(cids, parts, tag)
        hold = bool(self.remote.backlogged())
        self.local.post(cids, parts, tag, -1, publish=not hold)
        self.unpublished = hold

    def release(self) -> None:
        self.local.release()
