"""The shared-memory data plane: moving, copying and reducing the bytes of one algorithm step.

Small messages (one slot each) take short paths without per-message bookkeeping; larger ones
move chunk by chunk (``InFlight``), the receiver reducing straight out of the slots; messages of
at least the single-copy threshold are read (or, for large two-rank broadcasts, half written)
straight from the peer's memory with cross-memory attach (``horovod.transport.cma``). Messages
to ranks on other hosts go through the inner TCP transport in the same loop.

Must not touch: the control rings and the board (``control``), the segments' set-up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from functools import partial

import numpy as np

from horovod.common import log
from horovod.common.exceptions import TransportError
from horovod.transport import cma
from horovod.transport.base import Message, Reduce, Reducer, as_bytes
from horovod.transport.memory_order import order
from horovod.transport.shm.channels import Channel, Copier, InFlight, advance, piece, reached
from horovod.transport.shm.layout import COPY_PIECE, DESC, FAILED, PAGE
from horovod.transport.shm.waiting import ShmWaiting


class ShmExchange(ShmWaiting):
    """``exchange`` and its forms over the channels (and the inner transport for other hosts)."""

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
                outs = advance(outs, Channel.put, touched)
            if ins:
                ins = advance(ins, Channel.get, touched)
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

    def direct_reads(self, nbytes: int, ranks: Sequence[int] | None = None) -> bool:
        """Single copy between every pair of ``ranks``: messages of at least the threshold
        (which every local rank agreed on, so all decide alike) between ranks of this host
        (none reached over TCP)."""
        big = self.single_copy
        if not big or nbytes < big:
            return False
        if ranks is None:
            return len(self.local) == self.size
        local = self.local
        return all(r in local for r in ranks)

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
        DESC.pack_into(ch_out.slots[ch_out.count % n], 0, mine, nbytes)
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
            addr, theirs = DESC.unpack_from(slot, 0)
            ok = False
            try:
                self._split_part(peer, mine, addr, nbytes, theirs, sending)
                ok = True
            finally:  # done with the peer's buffer, or never to touch it (and it must know)
                if not ok:
                    DESC.pack_into(slot, 0, 0, FAILED)
                ch_in.count += 1
                order()
                ch_in.rd[0] = ch_in.count
                self._wake(peer)
            if ch_out.rd[0] < posted:
                done = partial(reached, ch_out.rd, posted)
                while not done():
                    self._wait({}, {peer: None}, {}, {}, self.chunk, done)
            order()
            if DESC.unpack_from(ch_out.slots[(posted - 1) % n], 0)[1] == FAILED:
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
        self._exchange_reduce(sends, recvs, (), big, Copier(copies))

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
        copier: Copier | None = None,
    ) -> None:
        """``exchange_reduce`` where local messages of at least ``big`` bytes go by single copy
        (and ``copier``'s copies are done between reads and while waiting)."""
        out: dict[int, list[InFlight]] = {}
        inc: dict[int, list[InFlight]] = {}
        r_sends: list[Message] = []
        r_recvs: list[Message] = []
        after: list[tuple[np.ndarray, Reducer, np.ndarray]] = []
        chunk, nslots = self.chunk, self.nslots

        def moving(mv: memoryview, dst: np.ndarray | None = None, op=None) -> InFlight:
            return InFlight(mv, dst, op, mv.nbytes >= big, piece(mv.nbytes, chunk, nslots))

        for peer, mv in sends:
            if mv.nbytes:
                if peer in self._out:
                    out.setdefault(peer, []).append(moving(mv.cast("B")))
                else:
                    r_sends.append((peer, mv))
        for peer, mv in recvs:
            if mv.nbytes:
                if peer in self._in:
                    inc.setdefault(peer, []).append(moving(mv.cast("B")))
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
                inc.setdefault(peer, []).append(moving(as_bytes(dst), dst, op))
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
        out: dict[int, list[InFlight]],
        inc: dict[int, list[InFlight]],
        copier: Copier | None = None,
    ) -> bool:
        moved = False
        nslots = self.nslots
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
                    DESC.pack_into(slot, 0, cma.address(p.mv), p.mv.nbytes)
                    ch.count += 1
                    p.ack = ch.count
                    i += 1
                else:
                    n = min(p.piece, p.mv.nbytes - p.off)
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
                    n = min(p.piece, p.mv.nbytes - p.off)
                    p.mv[p.off : p.off + n] = slot[:n]
                else:
                    n = min(p.piece, p.mv.nbytes - p.off)
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
        self, peer: int, p: InFlight, slot: memoryview, copier: Copier | None = None
    ) -> None:
        """Receive ``p`` from ``peer``'s memory at the address its slot names: one copy into
        the destination (in pieces, each after a share of ``copier``'s copies), or for a
        reduction chunk by chunk through scratch (cache-sized)."""
        addr, nbytes = DESC.unpack_from(slot, 0)
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
