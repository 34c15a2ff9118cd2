"""Handles and entries: what a submission hands the engine and what the caller waits on.

``Handle`` completes once per entry (several for a grouped op) and raises the error with the
call site; ``Handle.wait`` lets the waiting thread run the engine when the transport allows
(``driver``). ``Entry`` is one tensor of a submitted op as the engine tracks it. Nothing here
knows the engine's loop or the wire.

Must not touch: the engine's table (the engine completes handles), framework tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from horovod.common.exceptions import CollectiveRejected, HorovodInternalError
from horovod.core import pool
from horovod.core.messages import (
    Request,
)


class Handle:
    """Completion of one submitted op (several entries for a grouped op). The event that a
    blocked waiter sleeps on is created only when somebody has to block (a thread that runs
    the engine itself usually finds the handle done)."""

    __slots__ = (
        "_event",
        "_left",
        "_done",
        "results",
        "error",
        "rejected",
        "callsite",
        "_lock",
        "finish",
        "driver",
    )

    def __init__(
        self, n: int, callsite: str = "", finish: Callable[[list[Any]], Any] | None = None
    ) -> None:
        self._event: threading.Event | None = None
        self._left = n
        self._done = n == 0
        self._lock = threading.Lock()
        self.results: list[Any] = [None] * n
        self.error: str | None = None
        self.rejected = False  # the error is the coordinator's refusal (CollectiveRejected)
        self.callsite = callsite
        self.finish = finish
        self.driver: Callable[[Handle], None] | None = None  # runs the engine until done

    def done(self) -> bool:
        return self._done

    def _complete(
        self, index: int, result: Any = None, error: str | None = None, rejected: bool = False
    ) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
                self.rejected = rejected
            else:
                self.results[index] = result
            self._left -= 1
            if self._left == 0:
                self._done = True
                if self._event is not None:
                    self._event.set()

    def wait(self) -> list[Any]:
        if not self._done:
            if self.driver is not None:
                self.driver(self)
            if not self._done:
                with self._lock:
                    if self._event is None:
                        self._event = threading.Event()
                    if self._done:
                        self._event.set()
                while not self._event.wait(0.5):
                    pass
        if self.error is not None:
            where = f"\n  (this rank submitted it at {self.callsite})" if self.callsite else ""
            raise (CollectiveRejected if self.rejected else HorovodInternalError)(
                self.error + where
            )
        return self.results


class Entry:
    """One tensor of one submitted op, as the engine tracks it."""

    __slots__ = ("request", "array", "output", "splits", "handle", "index", "alloc", "cid")

    def __init__(
        self,
        request: Request,
        array: np.ndarray | None,
        output: np.ndarray | None,
        handle: Handle,
        index: int = 0,
        splits: list[int] | None = None,
        alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
    ) -> None:
        self.request = request
        self.array: Any = array  # None only for barrier, join and process-set requests
        self.output: Any = output
        self.splits: list[int] = splits or []
        self.handle = handle
        self.index = index
        self.alloc = alloc or np_alloc
        self.cid: int | None = None

    @property
    def key(self) -> tuple[int, str]:
        return (self.request.ps_id, self.request.name)


class BareEntry:
    """What ``ops.execute`` reads of a lone op's entry: its array, its output (an allreduce's
    or a broadcast's; None for an allgather) and how an allgather's result is allocated."""

    __slots__ = ("array", "output")

    def __init__(self, array: np.ndarray, output: np.ndarray | None) -> None:
        self.array = array
        self.output = output

    @staticmethod
    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np_alloc(shape, dtype)


def np_alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return pool.POOL.empty(shape, dtype)
