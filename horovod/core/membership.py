"""Elastic membership at ``hvd.init()``: a worker of an elastic job asks horovodrun's driver for
its place in the next round, takes on the rank and size it is given (in ``os.environ`` too,
as upstream, so code that reads ``HOROVOD_RANK`` sees the new value), and names the round's
data-plane rendezvous scope.

Owns the process's memory of the round it last took part in (a re-init asks for the round after
it). The protocol itself is ``horovod.rendezvous.elastic``.

Must not touch: the engine and transports (the context builds them for the round it returns);
the driver's keys other than the protocol's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping

from horovod.common.config import Config
from horovod.common.exceptions import HorovodInternalError
from horovod.rendezvous import elastic as protocol
from horovod.rendezvous.store import HTTPStoreClient, Store

Round = protocol.Round
# How much longer than the elastic timeout a worker waits for its next round: the driver, which
# waits as long for hosts and knows why none forms, ends the job and says why first; the
# worker's own limit is for a driver that is gone.
DRIVER_FIRST_S = 5.0
_last_round: int | None = None  # the round this process last joined (None: none yet)


class WorkerRemoved(RuntimeError):
    """horovodrun's elastic driver formed the next round without this worker (its host was
    removed or blacklisted, or the job shrank): the worker should exit."""


def elastic_requested(env: MutableMapping[str, str]) -> bool:
    from horovod.common.config import parse_bool

    try:
        return parse_bool(env.get("HOROVOD_ELASTIC", ""))
    except ValueError:
        return False  # Config.from_env names the bad value


def elastic_requested_here() -> bool:
    """Whether this process is a worker of an elastic job."""
    return elastic_requested(os.environ)


def config() -> Config:
    return Config.from_env(os.environ)


def store_for(cfg: Config) -> HTTPStoreClient:
    return HTTPStoreClient(cfg.rendezvous_addr, cfg.rendezvous_port, bytes.fromhex(cfg.secret_key))


def join(env: MutableMapping[str, str]) -> tuple[protocol.Round, str]:
    """Join the next round: returns it and its data-plane scope; ``env`` takes the new seat."""
    global _last_round
    cfg = Config.from_env(env)
    if not cfg.elastic_slot or not cfg.rendezvous_addr or not cfg.secret_key:
        raise HorovodInternalError(
            "HOROVOD_ELASTIC=1 but this worker was not started by horovodrun's elastic driver "
            "(HOROVOD_ELASTIC_SLOT and the rendezvous address are missing): start elastic jobs "
            "with horovodrun --min-np/--host-discovery-script"
        )
    left = cfg.elastic_round - 1 if _last_round is None else _last_round
    try:
        rnd = protocol.join(
            store_for(cfg),
            cfg.elastic_slot,
            left,
            cfg.elastic_worker_id,
            cfg.elastic_timeout,
            margin=DRIVER_FIRST_S,
        )
    except protocol.Removed as e:
        raise WorkerRemoved(str(e)) from None
    _last_round = rnd.generation
    env.update(rnd.seats[cfg.elastic_slot].env())
    return rnd, protocol.data_scope(rnd.generation)


def abandon_check(store: Store, generation: int) -> Callable[[], str | None]:
    """For ``Store.abandon_if``: the driver says the round ended while it was being set up
    (a member died), so waiting for that member's keys is pointless."""

    def check() -> str | None:
        if store.get(protocol.SCOPE, f"broken.{generation}"):
            return f"elastic round {generation} ended while its members were connecting"
        return None

    return check


def last_round() -> int | None:
    return _last_round


def report_suspects(cfg: Config, ranks: list[int]) -> None:
    """Tell the driver which ranks of this worker's round made no progress."""
    if ranks and cfg.elastic_slot:
        store_for(cfg).set(
            protocol.SCOPE, f"suspect.{cfg.elastic_slot}", " ".join(map(str, ranks)).encode()
        )
