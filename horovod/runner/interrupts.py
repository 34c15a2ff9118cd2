"""SIGINT and SIGTERM during a launcher's run: handed to the job (``on_interrupt``).

Python lets only the main thread install signal handlers. ``on_interrupt`` installs the
handler for the run's duration when called from the main thread (and puts the previous ones
back after); called from any other thread (``horovod.run`` from a worker thread, a thread pool
or a server's request handler) it installs nothing and the run goes on: the process's signals
then reach the main thread as usual, and a terminal's Ctrl-C still reaches the job's processes
through the terminal's process group.

Must not touch: the job (the handler decides what an interrupt does to it).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def on_interrupt(handler: Callable[[int, FrameType | None], object]) -> Iterator[bool]:
    """``handler(signum, frame)`` for SIGINT and SIGTERM while the block runs; yields whether
    it was installed (False off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield True
    finally:
        for s, h in old.items():
            signal.signal(s, h)
