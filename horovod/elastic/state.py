"""``State`` and ``ObjectState``: what an elastic job commits, rolls back to and hands to new
workers, with upstream's interface (``commit``, ``restore``, ``sync``, ``check_host_updates``,
``register_reset_callbacks``, ``on_reset``, ``on_hosts_updated``).

Two decisions every rank must share are made collectively here, never by one rank alone:

- whether hosts changed: ``check_host_updates`` takes the maximum over all ranks of the newest
  change each has heard of, so every rank raises ``HostsUpdatedInterrupt`` at the same commit;
- who hands its state to the others: ``sync`` broadcasts from the lowest rank among those
  holding the most commits, so a new worker never overwrites a survivor's state, whichever
  rank it was given (upstream always broadcasts from rank 0).

Must not touch: the launcher; the engine (it calls frontend collectives).
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from horovod import frontend as F
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.core import context
from horovod.rendezvous.elastic import ADDED, REMOVED


def round_update_id() -> int:
    """The newest host change the current membership round already reflects."""
    ctx = context.current()
    rnd = None if ctx is None else ctx.elastic_round
    return 0 if rnd is None else rnd.update


class State:
    """Base class: subclasses implement ``save``, ``restore`` and ``sync``."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or F.broadcast_object
        self._rank = get_rank or F.rank
        self._host_messages: queue.Queue[tuple[int, int]] = queue.Queue()
        self._last_updated_timestamp = round_update_id()
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0  # commits in this state's history (synced from the holder)

    # ------------------------------------------------------------------ upstream interface
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions to call after every reset (the job's size may have changed), before the
        state is synced; e.g. to scale the learning rate by the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = round_update_id()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (what a failure rolls back to), then check for host changes."""
        self.commits += 1
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if any rank has heard of a host
        change since the current membership round began (a collective: call it on all ranks)."""
        prev = self._last_updated_timestamp
        last, flags = prev, 0
        while True:
            try:
                timestamp, update = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > prev:
                last = max(last, timestamp)
                flags |= update
        heard = np.array([last, flags & REMOVED, (flags & ADDED) >> 1], dtype=np.int64)
        agreed = F.allreduce(heard, op=F.Max, name="elastic.check_host_updates")
        last = int(agreed[0])
        flags = (REMOVED if agreed[1] else 0) | (ADDED if agreed[2] else 0)
        if last > prev:
            self._last_updated_timestamp = last
            raise HostsUpdatedInterrupt(flags == REMOVED)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after the job was re-initialised (a hook for subclasses)."""

    # ------------------------------------------------------------------ shared decisions
    def newest_holder(self) -> int:
        """The rank every rank syncs from: the lowest rank holding the most commits. A
        collective; also adopts that number of commits."""
        counts = F.allgather(np.array([self.commits], dtype=np.int64), name="elastic.commits")
        self.commits = int(counts.max())
        return int(np.flatnonzero(counts == self.commits)[0])


class ObjectState(State):
    """A state of plain attributes: ``ObjectState(epoch=0, batch=0)`` -> ``state.epoch``.
    Values are deep-copied on save and restore, so later changes never alter a commit."""

    def __init__(
        self,
        bcast_object: Callable[..., Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._saved_state = {k: copy.deepcopy(v) for k, v in kwargs.items()}
        for k, v in kwargs.items():
            setattr(self, k, v)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    if TYPE_CHECKING:  # attributes come from the keyword arguments

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._apply_saved()

    def _apply_saved(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))

    def sync(self) -> None:
        self.sync_objects(self.newest_holder())

    def sync_objects(self, root: int) -> None:
        """Take the attributes of ``root``'s last commit (and keep them as this rank's)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(
                self._saved_state, root_rank=root, name="elastic.object_state"
            )
            self._apply_saved()  # (a subclass's restore would roll back what it synced)
