"""BLAS threads for the small matrix and vector products the library itself computes
(Adasum's dot products, PowerSGD's projections).

OpenBLAS and MKL start a thread per core for every product; with one rank per core (the usual
layout) each rank's threads fight the other ranks' for the same cores and spin, which made
PowerSGD's step 5x slower and its time vary run to run. ``one_blas_thread()`` runs a block
with one BLAS thread (``threadpoolctl``, the library scikit-learn uses for this), restoring the
user's setting after it.

Dot products whose bits must not depend on threads (Adasum's: every rank must compute the same
coefficients) use ``ordered_dot``: BLAS splits a long dot product across its threads and adds
the partial sums, so the same vectors give other bits at another thread count (seen at 1 Mi
elements with 1 and 2 threads), and a thread limit set by one thread of a process can be lifted
by another in the middle of the product. ``ordered_dot`` cuts the vectors into rows shorter
than any BLAS threads (OpenBLAS keeps a dot product under 10,000 elements on one thread), dots
each row and adds the row sums in a fixed order: the same bits at any thread setting, and no
slower than a thread-limited BLAS call.

Must not touch: the frameworks' own thread pools (torch, TensorFlow).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

_controller: Any = None
# Elements per row of ``ordered_dot``: under the length at which BLAS splits a dot product.
DOT_ROW = 8192
_vecdot = getattr(np, "vecdot", None)  # NumPy 2; einsum's own loop (no BLAS) before it


def ordered_dot(a: np.ndarray, b: np.ndarray) -> float:
    """The dot product of two flat arrays of one float type, summed in an order fixed by their
    length alone (module docstring): the same bits whatever BLAS's thread setting."""
    n = a.size
    rows = n // DOT_ROW
    total = 0.0
    if rows:
        head = rows * DOT_ROW
        a2 = a[:head].reshape(rows, DOT_ROW)
        b2 = b[:head].reshape(rows, DOT_ROW)
        sums = _vecdot(a2, b2) if _vecdot is not None else np.einsum("ij,ij->i", a2, b2)
        total = float(sums.sum())
        a, b = a[head:], b[head:]
    if a.size:
        total += float(np.dot(a, b))
    return total


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
