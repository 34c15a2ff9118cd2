"""Data channels between two local ranks: counters and slots in the receiver's segment, and
the bookkeeping of messages that move through them.

A message moves as consecutive pieces, one per slot, so the sender fills the next slot while the
receiver empties (or reduces straight out of) the previous one: a chunk each, or for a message
larger than a slot that fits them all, equal whole pages, one per slot (``piece``). Both sides
cut messages into the same pieces because lengths agree (the Transport contract), so no framing
is stored.

Must not touch: waking or waiting (``waiting``), the control rings, the board.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from horovod.transport.memory_order import order
from horovod.transport.shm.layout import PAGE


class Channel:
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


def reached(counter: memoryview, value: int) -> bool:
    return counter[0] >= value


def advance(items: list, move, touched: set[int]) -> list:
    """One pass of ``move(chan, message)`` (``Channel.put`` or ``get``) over ``items`` in order;
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


class Copier:
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


# Pieces are whole multiples of this (a page: any dtype's item divides it, and a reducing
# receiver's ufunc sees aligned pieces).
PIECE_ALIGN = 4096


def piece(nbytes: int, chunk: int, nslots: int) -> int:
    """Bytes per slot of a message of ``nbytes`` through a channel of ``nslots`` slots of
    ``chunk``: one chunk, or for a message larger than one slot that fits them all, spread over
    all the slots (whole pages), so that it lands in the same first part of each slot every
    time instead of wherever the slots' turn is. The second step of an allreduce (allgather
    after reduce-scatter) then reuses the slot memory the first just brought into cache, and
    the memory a step's messages pass through is their size, not up to every slot's: a
    training step's gradients, reduced after forward and backward evicted the slots, miss on
    less of it (a 2-rank 2.4 MB allreduce after a cache flush: see docs/benchmarks.md)."""
    if nbytes <= chunk or nbytes >= chunk * nslots:
        return chunk  # (one slot's worth: one piece, the fewest per-piece steps)
    spread = -(-nbytes // nslots)
    return min(chunk, -(-spread // PIECE_ALIGN) * PIECE_ALIGN)


class InFlight:
    """A message in progress over a channel: bytes (copy) or an array to reduce into.
    ``direct``: it moves by single copy (the sender posts its address in one slot, the receiver
    reads it from the sender's memory); ``ack``: the channel count at which the receiver is done
    with a posted direct send (0 before it is posted)."""

    __slots__ = ("mv", "dst", "op", "off", "direct", "ack", "piece")

    def __init__(
        self,
        mv: memoryview,
        dst: np.ndarray | None = None,
        op=None,
        direct: bool = False,
        piece: int = 0,
    ) -> None:
        self.mv, self.dst, self.op, self.off = mv, dst, op, 0
        self.direct, self.ack = direct, 0
        self.piece = piece  # bytes per slot (both ends compute it from the length: ``piece``)
