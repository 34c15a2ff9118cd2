"""The byte layout of a rank's shared-memory segment and the sizes every local rank agrees on.

A segment (one per rank, mapped by every rank of its host) holds, in order: a page whose first
words say whether the owner sleeps (data-plane word at 0, engine word at 8); one channel per
local peer that sends to it (a page of counters, then ``slots`` slots of ``chunk`` bytes); one
control-message ring per peer (a page of counters, then ``RING`` bytes); the engine's board
(a page with the latest round and the acknowledgement, then two posts); and the output slots.
``Layout`` computes the offsets; the modules beside this one own what lives at them.

Must not touch: the segments themselves (``segments`` maps them); nothing here has state.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PAGE = 4096
RING = 256 * 1024  # control-message ring per pair and direction
FRAME = 8  # little-endian length before each control message
DESC = struct.Struct("<QQ")  # a direct send's slot: sender's address, length
FAILED = (1 << 64) - 1  # length written over a split broadcast's post its reader gave up on
POLL_MS = 200  # a sleeping wait looks again at least this often (a safety net)
# Data of one peer-round post (allreduces, allgathers, broadcasts up to this size take data
# rounds: measured faster than plane rounds up to 2 MiB posts, benchmarks.md, stop 54).
BOARD_DATA = 2 * 1024 * 1024
BOARD_IDS = PAGE // 8 - 8  # cache ids per post
# Output slots: a rank's result of an allgather data round can live in its own segment, where
# the peers read its block from (instead of from a copy in the board): one copy less per rank.
OUT_SLOTS = 2
OUT_BYTES = 2 * BOARD_DATA
# ... for a rank's own block from this size on: below it the post is faster (the copy saved
# costs less than the wait for the peers' acks; timed in one job, benchmarks.md, stop 56).
OUT_MIN = 320 * 1024
# Own-block copies interleaved with single-copy reads (``exchange_copy``): this much of the
# peer's message is read, then as large a share of the copies, so both ranks' blocks pass
# through the shared cache once for the two readers (the owner's copy, the peer's read).
COPY_PIECE = 1 << 20


def out_place(slot: int, at: int) -> int:
    """The number a post carries for a result in output slot ``slot`` from byte ``at`` (a
    multiple of ``PAGE``): results move along their slot from use to use, like posts on the
    board, so that a block is not written where the peers have just read the last one."""
    return slot + OUT_SLOTS * (at // PAGE)


def out_where(place: int) -> tuple[int, int]:
    """(slot, byte offset) of an output ``place`` (``out_place``)."""
    return place % OUT_SLOTS, place // OUT_SLOTS * PAGE


@dataclass(frozen=True)
class Layout:
    """Offsets in a segment of a host with ``nlocal`` ranks, ``nslots`` slots of ``chunk``."""

    nlocal: int
    nslots: int
    chunk: int

    @property
    def chan_bytes(self) -> int:
        return PAGE + self.nslots * self.chunk

    def chan(self, index: int) -> int:
        """The channel from the owner's ``index``-th peer."""
        return PAGE + index * self.chan_bytes

    def ring(self, index: int) -> int:
        """The control ring from the owner's ``index``-th peer."""
        return PAGE + (self.nlocal - 1) * self.chan_bytes + index * (PAGE + RING)

    @property
    def board(self) -> int:
        return PAGE + (self.nlocal - 1) * (self.chan_bytes + PAGE + RING)

    @property
    def outputs(self) -> int:
        return self.board + PAGE + 2 * (PAGE + BOARD_DATA)

    @property
    def total(self) -> int:
        return self.outputs + OUT_SLOTS * OUT_BYTES
