"""Shared-memory data plane for ranks on the same host; TCP (the inner transport) for the rest.

Every rank owns one segment (a file in ``/dev/shm``, mapped by every rank on its host) holding a
data channel and a control ring per local peer, the engine's board for peer rounds and output
slots (``layout``). The parts, bottom up, each a module:

- ``layout``: where everything lies in a segment, and the sizes ranks must agree on;
- ``channels``, ``rings``, ``board``: the structures in shared memory (no I/O, no waiting);
- ``segments``: creating, mapping, unlinking and releasing segments and sockets; single copy;
- ``waiting``: spin, then sleep on a socket; wake a sleeping peer with one datagram;
- ``exchange``: the data plane (``Transport.exchange`` and its forms);
- ``control``: the engine's control messages, board and output slots (``PolledTransport``);
- this module: ``ShmTransport``, their sum, with its creation (falling back to TCP where
  shared memory is unusable) and its end (abort, close).

Must not be touched by: anything outside ``horovod.transport`` (the engine uses
``PolledTransport`` and ``PeerBoard``; ``horovod.core.context`` only creates the transport).
"""

from __future__ import annotations

from collections.abc import Sequence

from horovod.common import log
from horovod.transport.base import Transport
from horovod.transport.shm.control import ShmControl
from horovod.transport.shm.exchange import ShmExchange
from horovod.transport.shm.segments import Unusable


class ShmTransport(ShmControl, ShmExchange):
    """Shared memory between the ranks of this host, ``inner`` (TCP) for the others."""

    @classmethod
    def create(cls, inner: Transport, hostnames: Sequence[str], **kw) -> Transport:
        """A ShmTransport over ``inner`` for the ranks sharing this rank's host name, or
        ``inner`` itself when there are none or they agreed that shared memory is unusable."""
        me = hostnames[inner.rank]
        local = [r for r, h in enumerate(hostnames) if h == me]
        if len(local) < 2:
            return inner
        try:
            t = cls(inner, local, **kw)
        except Unusable as e:
            log.logger.warning(
                "rank %d: shared memory unavailable on host %s (%s); ranks there use TCP",
                inner.rank,
                me,
                e,
            )
            return inner
        t.mix_boards()
        return t

    def abort(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self.inner.abort(reason)
        for sock in (self._sock, self._esock):  # wake our own sleeping waits
            if sock is not None:
                try:
                    sock.sendto(b"x", sock.getsockname())
                except OSError:
                    pass

    def close(self) -> None:
        if self._aborted is None and not self._closed:
            self.flush_fast(2.0)  # e.g. the coordinator's final response list
        self.inner.close()
        self._release()

    @property
    def aborted(self) -> str | None:
        return self._aborted
