"""The response cache.

Every member of a process set (and the coordinator) holds an identical copy: it changes only
while response lists are processed, in the one order the coordinator decided, by the same
rule — a compact ``K`` (or eager ``V``) item touches its entries (most recently used), a full
``R`` item puts each of its tensors (replacing an older entry of the same name). The ids a list
names are all looked up before the list runs (they were live when the coordinator built it), so
a put earlier in the list that evicts one of them does no harm. Entry ids are never reused, so
an id a rank sent before an eviction can still be resolved from the coordinator's graveyard.

A rank whose request equals the cached one sends just the id; when every rank does, the
coordinator skips validation and answers with ids too, so steady-state training exchanges a
few integers per tensor instead of full descriptions.

Must not touch: anything but its own table, and that only while response lists are processed.
"""

from __future__ import annotations

from collections import OrderedDict

from horovod.core.messages import Response


class ResponseCache:
    def __init__(self, capacity: int, keep_evicted: int = 0) -> None:
        self.capacity = capacity
        self.keep_evicted = keep_evicted
        self.live: OrderedDict[int, Response] = OrderedDict()  # LRU order, oldest first
        self.by_name: dict[str, int] = {}
        self.signatures: dict[int, tuple] = {}  # live id -> (set rank, request it stands for)
        self.grave: OrderedDict[int, Response] = OrderedDict()
        self.next_id = 0
        self.evictions = 0
        # Autotune switches the cache off and on at the same point of the response stream on
        # every rank; the entries are kept meanwhile, so every copy stays identical.
        self.suspended = False

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and not self.suspended

    def lookup(self, name: str, signature: tuple, set_rank: int) -> int | None:
        """The id of the cached response for ``name`` if this rank's request still matches it."""
        cid = self.by_name.get(name)
        if cid is None:
            return None
        memo = self.signatures.get(cid)
        if memo is None or memo[0] != set_rank:  # computed once per entry and set rank
            memo = self.signatures[cid] = (set_rank, self.live[cid].request_for(set_rank))
        return cid if memo[1] == signature else None

    def resolve(self, cid: int) -> Response | None:
        return self.live.get(cid) or self.grave.get(cid)

    def touch(self, cid: int) -> None:
        self.live.move_to_end(cid)

    def put(self, resp: Response) -> int:
        name = resp.names[0]
        old = self.by_name.pop(name, None)
        if old is not None:
            self._bury(old)
        cid = self.next_id
        self.next_id += 1
        self.live[cid] = resp
        self.by_name[name] = cid
        while len(self.live) > self.capacity:
            victim, vresp = next(iter(self.live.items()))
            del self.by_name[vresp.names[0]]
            self._bury(victim)
            self.evictions += 1
        return cid

    def _bury(self, cid: int) -> None:
        resp = self.live.pop(cid)
        self.signatures.pop(cid, None)
        if self.keep_evicted:
            self.grave[cid] = resp
            while len(self.grave) > self.keep_evicted:
                self.grave.popitem(last=False)
