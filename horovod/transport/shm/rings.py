"""Control-message rings: the engine's messages (requests, response lists) between local ranks
travel as length-framed byte streams in shared memory, read by whichever thread runs the engine.

Must not touch: waking peers (the caller does, ``control``), the data channels.
"""

from __future__ import annotations

import mmap

from horovod.transport.memory_order import order
from horovod.transport.shm.layout import FRAME, PAGE, RING


class Ring:
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
