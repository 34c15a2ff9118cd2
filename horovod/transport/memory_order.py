"""Memory ordering between processes that share memory (the shared-memory plane's counters and
flags, and the engine's "somebody drives" word).

CPython has no atomics; a lock round trip is an atomic read-modify-write and so a full barrier.
``fence()`` orders every earlier load and store before every later one; ``order()`` is the cheap
form for plain loads/stores, free on CPUs that keep them in order (x86). Owns nothing else.

Must not touch: anything: it only orders memory accesses.
"""

from __future__ import annotations

import platform
import threading

STRONG_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: a lock round trip is an atomic read-modify-write."""
    _fence_lock.acquire()
    _fence_lock.release()


def order() -> None:
    """Order plain loads/stores on CPUs that reorder them (x86 keeps them in order)."""
    if not STRONG_ORDER:
        fence()
        fence()
