"""The elastic membership protocol: how horovodrun's elastic driver and its workers agree on
who is in the job, through the rendezvous store (scope ``elastic``).

A *slot* is ``<host>:<local_rank>``; a *round* is one membership of the job (generation ``g``):
which slots take part and with which rank. Keys:

``ready.<slot>``   worker -> driver: ``"<g> <worker id>"``, put by a worker that wants to join
                   the round after ``g`` (``g`` is the round it left; a new process was told
                   which round it is for). The worker id tells a process from its predecessor.
``round``          driver -> workers: the newest generation.
``round.<g>``      driver -> workers: the round's JSON: members (slot -> rank, size, local and
                   cross rank and size) and the newest host update it reflects.
``update``         driver -> workers: JSON ``{"id": n, "flags": f}``, the newest host change
                   (``flags``: 1 removed, 2 added), read by the workers' update poller.
``suspect.<slot>`` worker -> driver: ranks of its round that made no progress (a frozen or
                   stuck process the driver should stop).

The driver publishes a round only when every member has put ``ready`` for it, so all members
enter the round's data-plane rendezvous (scope ``elastic<g>``) together.

Must not touch: processes, transports or the engine (it only reads and writes store keys).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from horovod.common.exceptions import RendezvousError
from horovod.rendezvous.store import Store

if TYPE_CHECKING:
    from horovod.rendezvous.server import RendezvousServer

SCOPE = "elastic"
NO_UPDATE, REMOVED, ADDED, MIXED = 0, 1, 2, 3


def slot_id(host: str, local_rank: int) -> str:
    return f"{host}:{local_rank}"


def data_scope(generation: int) -> str:
    """The rendezvous scope of a round's data plane."""
    return f"elastic{generation}"


@dataclass(frozen=True)
class Seat:
    """One member's place in a round."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def env(self) -> dict[str, str]:
        return {
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


@dataclass(frozen=True)
class Round:
    generation: int
    seats: dict[str, Seat]
    update: int  # the newest host update (``update`` key's id) this membership reflects

    def encode(self) -> bytes:
        return json.dumps(
            {
                "generation": self.generation,
                "update": self.update,
                "seats": {s: list(vars(seat).values()) for s, seat in self.seats.items()},
            }
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> Round:
        d = json.loads(raw)
        return Round(
            d["generation"], {s: Seat(*v) for s, v in d["seats"].items()}, int(d["update"])
        )


def publish_round(store: Store | RendezvousServer, rnd: Round) -> None:
    store.set(SCOPE, f"round.{rnd.generation}", rnd.encode())
    store.set(SCOPE, "round", str(rnd.generation).encode())


def read_ready(raw: bytes | None) -> tuple[int, str] | None:
    """(generation left, worker id) from a ``ready`` value."""
    if raw is None:
        return None
    try:
        g, wid = raw.decode().split(" ", 1)
        return int(g), wid
    except ValueError:
        return None


def encode_update(update_id: int, flags: int) -> bytes:
    return json.dumps({"id": update_id, "flags": flags}).encode()


def decode_update(raw: bytes | None) -> tuple[int, int]:
    if raw is None:
        return 0, NO_UPDATE
    d = json.loads(raw)
    return int(d["id"]), int(d["flags"])


class NoRound(RendezvousError):
    """The driver formed no round for this worker in time (or horovodrun is gone)."""


class Removed(Exception):
    """The driver formed a round without this slot: this worker is no longer in the job."""


def join(
    store: Store,
    slot: str,
    left: int,
    worker_id: str,
    timeout: float,
    poll: float = 0.02,
    margin: float = 0.0,
) -> Round:
    """Ask for the round after ``left`` and wait for it. Returns the round this slot is a
    member of; raises ``Removed`` if the next round leaves this slot out, and RendezvousError
    if the driver forms none within ``timeout`` (the elastic timeout) + ``margin`` seconds."""
    store.set(SCOPE, f"ready.{slot}", f"{left} {worker_id}".encode())
    deadline = time.monotonic() + timeout + margin
    delay = poll / 4
    while True:
        raw = store.get(SCOPE, "round")
        if raw is not None and int(raw) > left:
            g = int(raw)
            body = store.get(SCOPE, f"round.{g}")
            if body is not None:
                rnd = Round.decode(body)
                if slot not in rnd.seats:
                    raise Removed(f"{slot} has been removed from the elastic job (round {g})")
                return rnd
        if time.monotonic() >= deadline:
            raise NoRound(
                f"the elastic driver formed no round after round {left} for {slot} within "
                f"{timeout:g} s (HOROVOD_ELASTIC_TIMEOUT): not enough hosts or slots became "
                "available, or horovodrun is gone"
            )
        time.sleep(delay)
        delay = min(delay * 2, poll * 5)
