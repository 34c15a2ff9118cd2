"""The elastic retry loop (``hvd.elastic.run``) and the poller that hears of host changes.

``run_fn(func, reset)`` wraps a training function ``func(state, ...)``. Each pass syncs the
state (unless only hosts were removed), then calls ``func``. When a collective fails
(``HorovodInternalError``: a lost worker) every surviving rank rolls back to its last commit;
when hosts changed (``HostsUpdatedInterrupt`` at a commit) the state is already committed. Then
Horovod is re-initialised in the next membership round (``reset``), the reset callbacks run,
and the loop goes on. A worker the driver left out of the new round exits with status 0.

The poller is a daemon thread per process that reads the driver's newest host change (one
small request every ``HOROVOD_ELASTIC_POLL_SECONDS``) and hands it to every registered state;
``State.check_host_updates`` then decides, collectively, whether to reset.

Must not touch: the launcher; the engine's internals (it reads which peers were unresponsive).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from horovod import frontend as F
from horovod.common import log
from horovod.common.exceptions import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RendezvousError,
)
from horovod.core import context, membership
from horovod.elastic.state import State
from horovod.rendezvous import elastic as protocol

# How many times in a row re-initialisation may fail (a member lost while the round's data
# plane was being set up) before the worker gives up.
MAX_INIT_RETRIES = 20


class UpdatePoller:
    """Hands the driver's host changes to the states of this process."""

    def __init__(self) -> None:
        self._states: weakref.WeakSet[State] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.seen = 0

    def register(self, state: State) -> None:
        with self._lock:
            self._states.add(state)
            if self._thread is None and membership.elastic_requested_here():
                self._thread = threading.Thread(
                    target=self._loop, name="horovod-elastic-updates", daemon=True
                )
                self._thread.start()

    def unregister(self, state: State) -> None:
        with self._lock:
            self._states.discard(state)

    def _loop(self) -> None:
        cfg = membership.config()
        store = membership.store_for(cfg)
        while not self._stop.wait(cfg.elastic_poll_seconds):
            try:
                update_id, flags = protocol.decode_update(store.get(protocol.SCOPE, "update"))
            except Exception as e:  # the driver is gone: the job is ending anyway
                log.logger.debug("elastic update poll failed: %s", e)
                continue
            if update_id > self.seen:
                self.seen = update_id
                with self._lock:
                    states = list(self._states)
                for s in states:
                    s.on_hosts_updated(update_id, flags)


POLLER = UpdatePoller()


def _leave_round() -> None:
    """Tell the driver which peers made no progress, then shut this round's Horovod down."""
    ctx = context.current()
    if ctx is not None and ctx.elastic_round is not None:
        suspects = ctx.engine.unresponsive_peers()
        if suspects:
            try:
                membership.report_suspects(ctx.config, suspects)
            except Exception as e:
                log.logger.debug("could not report unresponsive peers: %s", e)
    F.shutdown()


def reinit(init: Callable[[], None]) -> None:
    """Join the next round; a failure while its data plane is set up (a member lost meanwhile)
    means leaving that round too and joining the one after."""
    for attempt in range(MAX_INIT_RETRIES):
        try:
            init()
            return
        except protocol.NoRound:
            raise
        except (HorovodInternalError, RendezvousError) as e:
            if attempt + 1 == MAX_INIT_RETRIES:
                raise
            log.logger.warning("re-initialisation failed (%s); joining the next round", e)
            _leave_round()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic retry loop; ``reset`` re-initialises
    the framework's Horovod (``shutdown(); init()``)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        POLLER.register(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    log.logger.warning("rolling back to the last commit: %s", _first_line(e))
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync
                try:
                    reset()
                except membership.WorkerRemoved as e:
                    print(f"horovod: {e}; this worker exits.", file=sys.stderr, flush=True)
                    raise SystemExit(0) from None
                state.on_reset()
        finally:
            POLLER.unregister(state)

    return wrapper


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def reset() -> None:
    """Leave the current round and join the next: ``shutdown(); init()`` for elastic jobs."""
    _leave_round()
    reinit(F.init)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``@hvd.elastic.run``: the retry loop with Horovod's own ``shutdown(); init()``."""
    return run_fn(func, reset)
