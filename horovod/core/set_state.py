"""A process set as one rank's engine sees it: its ranks, this rank's place in it, the data
plane restricted to it (a ``SubTransport``), and its response cache.

Must not touch: the coordinator's tables, a transport's internals.
"""

from __future__ import annotations

from collections.abc import Sequence

from horovod.core.cache import ResponseCache
from horovod.transport.base import SubTransport, Transport


class SetState:
    """A process set as the engine sees it."""

    def __init__(
        self,
        ps_id: int,
        ranks: Sequence[int],
        transport: Transport,
        cache_capacity: int,
        coordinator: bool,
    ) -> None:
        self.id = ps_id
        self.ranks = list(ranks)
        self.member = transport.rank in self.ranks
        view: Transport | SubTransport | None = None
        if self.member:
            # The set of all ranks needs no translation of ranks: run on the transport itself.
            identity = self.ranks == list(range(transport.size))
            view = transport if identity else SubTransport(transport, self.ranks)
        self.view = view
        self.set_rank = self.ranks.index(transport.rank) if self.member else -1
        self.cache = ResponseCache(
            cache_capacity, keep_evicted=4 * cache_capacity if coordinator else 0
        )
