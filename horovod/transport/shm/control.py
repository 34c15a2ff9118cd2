"""The engine's side of shared memory: control messages through the rings, peer rounds on the
board (with the TCP board's posts to the other hosts in a job on several: ``MixedBoard``), and
the output slots where an allgather's result may live (``PolledTransport``).

Only the thread running the engine calls these (``kick`` aside, in ``waiting``).

Must not touch: the data channels (``exchange``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np

from horovod.common.exceptions import TransportError
from horovod.transport.base import CtrlHandler
from horovod.transport.mixed_board import MixedBoard
from horovod.transport.shm.board import Board
from horovod.transport.shm.layout import FRAME, OUT_BYTES, PAGE, RING, out_place, out_where
from horovod.transport.shm.waiting import ShmWaiting


class ShmControl(ShmWaiting):
    """Rings, board and output slots: what the engine's fast paths need from a transport."""

    def send_ctrl(self, peer: int, payload: bytes) -> None:
        self.inner.send_ctrl(peer, payload)

    def is_fast(self, peer: int) -> bool:
        # (a peer on another host too where its control connection is polled: its last
        # messages, e.g. a shutdown, are read by the engine's thread before its loss counts)
        return peer in self._rout or self._remote is not None

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

    def poll_fast(self) -> list[tuple[int, bytes]]:
        """Control messages that same-host ranks sent (complete ones, in order per peer), and
        where the TCP plane to other hosts is polled (``PolledTcpTransport``), theirs."""
        got: list[tuple[int, bytes]] = self._remote.poll_fast() if self._remote else []
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
        """Post the engine's next peer round (``Board.post``) and wake sleeping peers."""
        board = self.board
        assert board is not None
        if self._aborted is not None:
            raise TransportError(self._aborted)
        board.post(cids, parts, tag, out)
        for peer in self.peers:
            self._wake(peer, ctrl=True)

    def mix_boards(self) -> None:
        """In a job on several hosts whose TCP plane has board connections (``remote.board``):
        peer rounds on this host's board and on the TCP board to the other hosts' ranks
        (``MixedBoard``), output slots off (the other hosts cannot read them). Set-up only."""
        remote = self._remote
        if self.board is not None or remote is None or remote.board is None:
            return
        mine = self._maps[self.rank]
        local = Board(mine, {r: self._maps[r] for r in self.peers}, self.layout.board)
        self.board = MixedBoard(
            local, remote.narrow_board(self.local), 0 in self.peers, self._wake_board_peers
        )
        self.outputs = False

    def _wake_board_peers(self) -> None:
        for peer in self.peers:
            self._wake(peer, ctrl=True)

    def out_slot(self, nbytes: int) -> int:
        """A place for a result of ``nbytes`` in a free output slot of this rank (``out_owner``
        gives its bytes), or -1: outputs off, too large, or every slot still referenced by an
        earlier result. A slot is free again once no view of it is alive, as in the engine's
        output pool. In a slot, each result goes right after the last one (back to the start
        where it would not fit): its block is then not written over lines the peers have just
        read from there, which their caches would first have to give back (the board's posts
        move the same way, and for the same reason: ``shm.board``). Not where the host's ranks
        outnumber its cores (``oversubscribed``): there it measured no faster."""
        if nbytes <= OUT_BYTES:
            owners = self.out_owners
            for k in range(len(owners)):
                # 2 = the list's reference and getrefcount's argument: no view is alive.
                if sys.getrefcount(owners[k]) == 2:
                    at = 0 if self._yield else self._out_next[k]
                    if at + nbytes > OUT_BYTES:
                        at = 0
                    self._out_next[k] = -(-(at + nbytes) // PAGE) * PAGE
                    return out_place(k, at)
        return -1

    def out_owner(self, place: int) -> np.ndarray:
        """This rank's output bytes from ``place`` on (``out_slot``), as a uint8 array whose
        views keep the slot taken."""
        k, at = out_where(place)
        return self.out_owners[k][at:]

    def peer_out(self, peer: int, place: int) -> memoryview:
        """Output bytes of local rank ``peer`` from ``place`` on (read-only use)."""
        k, at = out_where(place)
        return self._out_views[peer][k][at:]

    def board_ack(self, readers_of: Sequence[int]) -> None:
        """This rank has read the output slots of ``readers_of`` for its round: tell them (a
        datagram to any of them that sleeps waiting for it)."""
        board = self.board
        assert isinstance(board, Board)  # (output slots: one host's board only)
        board.ack()
        for peer in readers_of:
            self._wake(peer)

    def board_wait_acked(self) -> None:
        """Wait until every peer has read this rank's output slot for its round (they have
        all posted it, so they only have their reads left)."""
        board = self.board
        assert isinstance(board, Board)
        while True:
            waiting = board.unacked()
            if not waiting:
                return
            self._wait({}, dict.fromkeys(waiting), {}, {}, 0, board.all_acked)

    def ctrl_idle(self) -> bool:
        """No control message from a same-host rank to read, none waiting to be sent."""
        if self._backlog or (self._remote is not None and not self._remote.ctrl_idle()):
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
        if self.board is not None and self.board.due_now():  # (no socket I/O: any thread)
            return True
        if self._remote is not None and self._remote.fast_pending():
            return True
        for ring in self._rin.values():
            if ring.count != ring.wr[0]:
                return True
        for ring in self._rout.values():
            if ring.pending and ring.room():
                return True
        return False

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
