"""BLAS threads for the small matrix products the library itself computes (PowerSGD's
projections).

OpenBLAS and MKL start a thread per core for every product; with one rank per core (the usual
layout) each rank's threads fight the other ranks' for the same cores and spin, which made
PowerSGD's step 5x slower and its time vary run to run. ``one_blas_thread()`` runs a block
with one BLAS thread (``threadpoolctl``, the library scikit-learn uses for this), restoring the
user's setting after it.

(Adasum's dot products do not use BLAS at all: the order in which a BLAS dot product sums
depends on its threads and on the kernel it picks for the CPU; see ``collectives.adasum``.)

Must not touch: the frameworks' own thread pools (torch, TensorFlow).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_controller: Any = None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()  # finds the loaded BLAS libraries once
        except ImportError:  # pragma: no cover - a dependency; without it, leave BLAS be
            _controller = False
    if not _controller:
        yield
        return
    with _controller.limit(limits=1, user_api="blas"):
        yield
