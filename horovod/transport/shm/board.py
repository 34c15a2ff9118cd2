"""The engine's board for peer rounds in shared memory (the ``PeerBoard`` of this transport).

Must not touch: waking peers (``control.board_post`` does), the output slots' reference counts.
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Sequence

from horovod.common.exceptions import TransportError
from horovod.transport.base import PeerBoard
from horovod.transport.memory_order import order
from horovod.transport.shm.layout import BOARD_DATA, BOARD_IDS, PAGE

ALIGN = 64  # posts start on a cache line


class Board(PeerBoard):
    """Peer rounds of the engine (see "Peer rounds" in docs/architecture.md): each rank posts
    what it is about to run (cache ids and their data) for round ``n`` into its own segment;
    every rank reads every peer's post once all have posted, so all of them decide the same.

    A rank posts round n+1 only after reading every post of round n, so a peer is at most one
    round ahead: two slots (by parity) per rank suffice. ``latest`` is published after the
    slot's contents (like a channel's counter).

    Within its slot, a post goes right after the last one of the same parity (back to the
    start where it would not fit), and its header says where: so a post overwrites memory its
    readers last read about 4 MiB of posts ago, which their private caches no longer hold.
    Written at the same place every time, each post first had to take every cache line back
    from the readers that had just copied it out (a 128 KiB post took 20 us to write instead of
    4.4 us, a 512 KiB one 35 instead of 17: ``horovod.benchmarks.handoff``, benchmarks.md)."""

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
        "_next",
        "move",
    )
    data_bytes = BOARD_DATA
    max_ids = BOARD_IDS

    def __init__(
        self, mine: mmap.mmap, peers: dict[int, mmap.mmap], base: int, move: bool = True
    ) -> None:
        """``move``: posts move along their slot (see above; not where the host's ranks
        outnumber its cores, where that measured no faster)."""

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
        self._next = [0, 0]  # where this rank's next post of each parity goes in its slot
        self.move = move
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

    due_now = due  # (reads shared memory only: any thread may ask)

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
        self,
        cids: Sequence[int],
        parts: Sequence[memoryview],
        tag: int = 0,
        out: int = -1,
        publish: bool = True,
    ) -> None:
        """Post round ``n + 1``: ``cids`` (empty: nothing to run), their data in order, and a
        ``tag`` the engine compares (what kind of round, and where in its list sequence).
        ``out``: this rank's data is in its output slot ``out`` instead (``parts`` empty).
        Without ``publish`` the post is written but the peers see it only at ``publish()``
        (a job on several hosts: ``MixedBoard``)."""
        n = self.n + 1
        head, data = self._mine[n % 2]
        total = 0
        for mv in parts:
            total += mv.nbytes
        start = self._next[n % 2] if self.move else 0
        if start + total > BOARD_DATA:
            start = 0
        off = start
        for mv in parts:
            end = off + mv.nbytes
            data[off:end] = mv
            off = end
        self._next[n % 2] = (off + ALIGN - 1) & -ALIGN  # (the next one on a cache line)
        k = len(cids)
        head[1] = k
        head[2] = total
        head[3] = tag
        head[4] = out + 1
        head[5] = start
        if k == 1:  # (a lone op: every small express call)
            head[8] = cids[0]
        else:
            head[8 : 8 + k] = memoryview(array("q", cids))
        head[0] = n
        self.n = n
        self.open = True
        self.deferred = False
        if publish:  # (``publish`` inline: every small op posts)
            order()
            self.latest[0] = n

    def publish(self) -> None:
        """Let the peers see this rank's post of round ``n`` (``post`` wrote it)."""
        order()
        self.latest[0] = self.n

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
            start = head[5]
            out.append(
                (r, head[3], head[8 : 8 + k].tolist(), data[start : start + head[2]], head[4] - 1)
            )
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
