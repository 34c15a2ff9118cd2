"""BLAS threads for the small matrix and vector products the library itself computes
(Adasum's dot products, PowerSGD's projections).

OpenBLAS and MKL start a thread per core for every product; with one rank per core (the usual
layout) each rank's threads fight the other ranks' for the same cores and spin, which made
PowerSGD's step 5x slower and its time vary run to run. ``one_blas_thread()`` runs a block
with one BLAS thread (``threadpoolctl``, the library scikit-learn uses for this), restoring the
user's setting after it (after the last of several threads' overlapping blocks).

Must not touch: the frameworks' own thread pools (torch, TensorFlow).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_controller: Any = None
# Blocks may overlap on several threads (rank threads of one process, or a user's threads):
# the first one in sets the limit and the last one out restores the user's setting. A block
# that restored it on its own would let another thread's product, still inside its block, run
# on every core, in another order of sums: Adasum's bits would differ between ranks.
_lock = threading.Lock()
_inside = 0
_limiter: Any = None


def _blas() -> Any:
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()  # finds the loaded BLAS libraries once
        except ImportError:  # pragma: no cover - a dependency; without it, leave BLAS be
            _controller = False
    return _controller


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    global _inside, _limiter
    controller = _blas()
    if not controller:
        yield
        return
    with _lock:
        if _inside == 0:
            _limiter = controller.limit(limits=1, user_api="blas")
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                _limiter.restore_original_limits()
                _limiter = None
