"""How the elastic driver starts and stops its workers: the seam between the driver's rounds
and whatever runs a worker.

The driver decides (which slot gets a worker, which worker is stopped); a ``Launcher`` acts:
``start`` brings up one worker for a slot and returns its handle, which it puts on the driver's
``exits`` queue when the worker ends; ``stop`` ends running ones; ``describe`` says in a few
words why a worker that failed ended. ``ProcessLauncher`` runs processes (``horovodrun``: local
or over ssh); ``horovod.ray`` runs actors and ``horovod.spark`` processes inside Spark tasks
behind the same interface.

A handle (``procs.Worker`` or an engine's own) has ``rank`` (the driver updates it at each
round), ``exit_code`` (None while it runs; 0 when the job's function finished), ``stopped_by_us``,
``tail`` (its last lines of output) and ``threads`` (joined briefly at the end).

Must not touch: the driver's decisions (rounds, blacklist).
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from horovod.runner.procs import Command, OutputSink, exit_description, spawn, stop_workers


class Launcher(Protocol):
    def start(self, host: str, rank: int, env: dict[str, str], exits: queue.SimpleQueue) -> Any:
        """One worker for a slot on ``host``, with ``env`` added to the job's environment."""

    def stop(self, workers: Sequence[Any], grace: float, sig: int = signal.SIGTERM) -> None:
        """End the running ones of ``workers`` (marking them ``stopped_by_us``)."""

    def describe(self, worker: Any) -> str:
        """Why ``worker`` (which failed) ended, e.g. ``exited with code 1``."""

    def close(self) -> None:
        """After the job: release what the launcher holds."""


@dataclass
class EngineWorker:
    """A handle of a worker run by a cluster engine (a Ray actor, a process in a Spark task):
    the driver's fields, and ``why`` it failed and its ``result`` when it returned."""

    rank: int
    host: str
    remote: bool = True
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    exit_code: int | None = None
    exit_time: float = 0.0
    why: str = ""
    result: Any = None
    stopped_by_us: bool = False
    stop_time: float = 0.0
    threads: list[threading.Thread] = field(default_factory=list)


class ProcessLauncher:
    """Workers as processes, from ``make_command(host, rank, env)`` (horovodrun's launcher)."""

    def __init__(
        self,
        make_command: Callable[[str, int, dict[str, str]], Command],
        sink: OutputSink,
        size_hint: int,
    ) -> None:
        self.make_command = make_command
        self.sink = sink
        self.size_hint = size_hint

    def start(self, host: str, rank: int, env: dict[str, str], exits: queue.SimpleQueue) -> Any:
        return spawn(self.make_command(host, rank, env), self.sink, self.size_hint, exits)

    def stop(self, workers: Sequence[Any], grace: float, sig: int = signal.SIGTERM) -> None:
        stop_workers(workers, grace, sig)

    def describe(self, worker: Any) -> str:
        return exit_description(worker.exit_code or 1, worker.remote)

    def close(self) -> None:
        self.sink.close()
