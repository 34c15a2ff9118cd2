"""In-process transport: N ranks as N threads, for fast multi-rank tests.

A ``LoopbackWorld`` is shared by the rank threads; every ``hvd.init()`` round gets a fresh
set of channels, so init/shutdown/init works as it does across processes.

Must not touch: the engine; other processes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from horovod.common.exceptions import TransportError
from horovod.rendezvous.store import MemoryStore
from horovod.transport.base import CtrlHandler, Message, PolledTransport, Transport


class _Round:
    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.chans: dict[tuple[int, int], deque[bytes]] = {}
        self.handlers: list[CtrlHandler | None] = [None] * size
        self.pending_ctrl: list[list[tuple[int, bytes | None]]] = [[] for _ in range(size)]
        self.closed: set[int] = set()
        self.aborted: dict[int, str] = {}


class LoopbackWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self.store = MemoryStore()
        self._rounds: dict[int, _Round] = {}
        self._lock = threading.Lock()

    def transport(self, rank: int, round_id: int) -> LoopbackTransport:
        with self._lock:
            rnd = self._rounds.setdefault(round_id, _Round(self.size))
        return LoopbackTransport(rank, rnd)


class LoopbackTransport(Transport):
    kind = "LOOPBACK"

    def __init__(self, rank: int, rnd: _Round) -> None:
        self.rank, self.size, self._r = rank, rnd.size, rnd

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        r = self._r
        with r.cond:
            self._check(None)
            for peer, mv in sends:
                if mv.nbytes:
                    r.chans.setdefault((self.rank, peer), deque()).append(bytes(mv))
            if sends:
                r.cond.notify_all()
            for peer, mv in recvs:
                if not mv.nbytes:
                    continue
                q = r.chans.setdefault((peer, self.rank), deque())
                while not q:
                    self._check(peer)
                    r.cond.wait(0.5)
                data = q.popleft()
                if len(data) != mv.nbytes:
                    raise TransportError(
                        f"internal error: rank {self.rank} expected {mv.nbytes} bytes from rank "
                        f"{peer} but the next message has {len(data)}",
                        peer,
                    )
                mv[:] = data

    def _check(self, peer: int | None) -> None:
        r = self._r
        if self.rank in r.aborted:
            raise TransportError(r.aborted[self.rank])
        if peer is not None and peer in r.closed:
            raise TransportError(
                f"connection to rank {peer} was lost (rank {peer} closed it)", peer
            )

    def send_ctrl(self, peer: int, payload: bytes) -> None:
        r = self._r
        with r.cond:
            if self.rank in r.closed:
                raise TransportError(r.aborted.get(self.rank, "this rank's connections are closed"))
            if peer in r.closed:
                return
            handler = r.handlers[peer]
            if handler is None:
                r.pending_ctrl[peer].append((self.rank, payload))
                return
        handler(self.rank, payload)

    def start_ctrl(self, handler: CtrlHandler) -> None:
        r = self._r
        with r.cond:
            r.handlers[self.rank] = handler
            backlog, r.pending_ctrl[self.rank] = r.pending_ctrl[self.rank], []
            gone = [p for p in sorted(r.closed) if self.rank == 0 or p == 0]
        for peer, payload in backlog:
            handler(peer, payload)
        for peer in gone:  # peers that left before we listened: their EOF arrives now
            handler(peer, None)

    def abort(self, reason: str) -> None:
        with self._r.cond:
            self._r.aborted.setdefault(self.rank, reason)
            self._r.cond.notify_all()
        self._close(notify=True)

    def close(self) -> None:
        self._close(notify=True)

    def _close(self, notify: bool) -> None:
        r = self._r
        with r.cond:
            if self.rank in r.closed:
                return
            r.closed.add(self.rank)
            r.handlers[self.rank] = None
            r.cond.notify_all()
            peers = [p for p in range(self.size) if p != self.rank and (self.rank == 0 or p == 0)]
            handlers = [(p, r.handlers[p]) for p in peers]
        if notify:
            for _, h in handlers:
                if h is not None:
                    h(self.rank, None)


class SoloTransport(LoopbackTransport, PolledTransport):
    """A job of one process. Nothing can arrive from a peer, so the thread that waits for a
    result runs the engine itself, as on shared memory (``poll_fast`` and the rest of that
    interface, see docs/architecture.md "Who runs the engine"): a synchronous op is negotiated
    and executed on the caller's thread instead of crossing to the engine thread and back.
    ``kick`` wakes an engine thread blocked in ``sleep`` or ``nap``."""

    kind = "LOOPBACK"
    oversubscribed = False

    def __init__(self, spin_s: float) -> None:
        super().__init__(0, _Round(1))
        self.spin_s = spin_s
        self._wakeup = threading.Event()

    @property
    def aborted(self) -> str | None:
        return self._r.aborted.get(self.rank)

    def poll_fast(self) -> list[tuple[int, bytes]]:
        return []

    def fast_pending(self) -> bool:
        return False

    def is_fast(self, peer: int) -> bool:
        return False

    def send_fast(self, peer: int, payload: bytes) -> None:  # no peers: never called
        self.send_ctrl(peer, payload)

    def set_driving(self, on: bool) -> None:
        pass

    def kick(self) -> None:
        self._wakeup.set()

    def sleep(self, timeout: float | None, busy) -> None:
        if not busy():
            self._wakeup.wait(timeout)
        self._wakeup.clear()

    def nap(self, seconds: float, alarm: int | None = None) -> None:  # (no alarms here)
        self._wakeup.wait(max(0.0, seconds))
        self._wakeup.clear()
