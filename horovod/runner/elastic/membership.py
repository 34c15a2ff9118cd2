"""Which hosts an elastic job may use, and who gets which rank.

``HostBook`` keeps the discovered hosts in a stable order (hosts seen before keep their place,
new ones go last, so surviving workers keep low ranks and their relative order) and the
blacklist: a host where a worker failed is not used again; with a cooldown range it comes back
after ``clamp(MIN * 2**n + U(0, 1) * MIN, MIN, MAX)`` seconds on its n-th blacklisting (as
upstream), which counts as a host being added.

A blacklisted host gets no new workers, but the workers that survive on it keep their seats: a
failed process says little about its host, and its neighbours hold the training state.

``seats`` fills the planned slots in host order, up to ``max_np`` workers.

Must not touch: processes (it decides; the driver acts).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from horovod.rendezvous.elastic import ADDED, NO_UPDATE, REMOVED, Seat, slot_id
from horovod.runner.hosts import HostInfo


@dataclass
class HostRecord:
    slots: int
    discovered: bool = True
    failures: int = 0
    blacklisted_until: float | None = None  # None: usable; inf: for good
    why: str = ""


@dataclass
class HostBook:
    cooldown: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    order: list[str] = field(default_factory=list)
    records: dict[str, HostRecord] = field(default_factory=dict)

    def plan(self, alive: Iterable[str]) -> list[tuple[str, list[int]]]:
        """(host, slot indices) to fill, in order: every slot of a usable host, and the
        slots of ``alive`` (slots with a live worker) on a blacklisted one."""
        usable = {h.hostname for h in self.usable()}
        alive_on: dict[str, list[int]] = {}
        for slot in alive:
            name, index = slot.rsplit(":", 1)
            alive_on.setdefault(name, []).append(int(index))
        out = []
        for name in self.order:
            r = self.records[name]
            if not r.discovered:
                continue
            if name in usable:
                indices = list(range(r.slots))
            else:
                indices = sorted(i for i in alive_on.get(name, []) if i < r.slots)
            if indices:
                out.append((name, indices))
        return out

    def usable(self) -> list[HostInfo]:
        now = self.clock()
        out = []
        for name in self.order:
            r = self.records[name]
            if not r.discovered:
                continue
            if r.blacklisted_until is not None:
                if now < r.blacklisted_until:
                    continue
                r.blacklisted_until = None  # cooled down: resurrected
            out.append(HostInfo(name, r.slots))
        return out

    def discovered(self) -> list[str]:
        return [n for n in self.order if self.records[n].discovered]

    def all_blacklisted_for_good(self) -> bool:
        names = self.discovered()
        return bool(names) and all(self.records[n].blacklisted_until == float("inf") for n in names)

    def update(self, hosts: list[HostInfo]) -> None:
        seen = {h.hostname for h in hosts}
        for h in hosts:
            r = self.records.get(h.hostname)
            if r is None:
                self.records[h.hostname] = HostRecord(h.slots)
                self.order.append(h.hostname)
            else:
                r.slots, r.discovered = h.slots, True
        for name, r in self.records.items():
            if name not in seen:
                r.discovered = False

    def blacklist(self, host: str, why: str) -> None:
        r = self.records.get(host)
        if r is None:
            return
        r.failures += 1
        r.why = why
        if self.cooldown is None:
            r.blacklisted_until = float("inf")
        else:
            lo, hi = self.cooldown
            wait = lo * 2 ** (r.failures - 1) + self.rng.random() * lo
            r.blacklisted_until = self.clock() + min(max(wait, lo), hi)

    def next_resurrection(self) -> float | None:
        """Seconds until the next blacklisted host cools down (None: none will)."""
        now = self.clock()
        left = [
            r.blacklisted_until - now
            for r in self.records.values()
            if r.discovered and r.blacklisted_until not in (None, float("inf"))
        ]
        return max(0.0, min(left)) if left else None


def change(before: Iterable[str], after: Iterable[str]) -> int:
    """REMOVED/ADDED flags between two sets of slots."""
    old, new = set(before), set(after)
    return (REMOVED if old - new else NO_UPDATE) | (ADDED if new - old else NO_UPDATE)


def seats(plan: list[tuple[str, list[int]]], max_np: int | None) -> dict[str, Seat]:
    """Rank assignment (slot -> seat) over ``plan``, (host, slot indices) in order, at most
    ``max_np`` workers. A host's local ranks follow its slots' order."""
    placed: list[tuple[str, int]] = []
    for name, indices in plan:
        for index in indices:
            if max_np is not None and len(placed) >= max_np:
                break
            placed.append((name, index))
    size = len(placed)
    local_size: dict[str, int] = {}
    local_rank: list[int] = []
    for name, _ in placed:
        local_rank.append(local_size.get(name, 0))
        local_size[name] = local_rank[-1] + 1
    host_order = list(local_size)
    out = {}
    for rank, ((name, index), lr) in enumerate(zip(placed, local_rank, strict=True)):
        with_lr = [x for x in host_order if local_size[x] > lr]
        out[slot_id(name, index)] = Seat(
            rank, size, lr, local_size[name], with_lr.index(name), len(with_lr)
        )
    return out


def host_of(slot: str) -> str:
    return slot.rsplit(":", 1)[0]
