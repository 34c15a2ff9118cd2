"""Adasum: the adaptive summation of gradients (upstream's ``op=hvd.Adasum``), over a
Transport (or a process-set view of one), for any number of ranks.

The pairwise rule, per tensor (per layer, also inside a fused buffer), with dot products and
norms accumulated in float64 as upstream does::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

where a coefficient stays 1 when its squared norm is below sqrt(DBL_MIN). Orthogonal
gradients add up; identical ones give the gradient itself (an average).

The ranks are combined as a binary tree: pairs (0, 1), (2, 3), ... first, then pairs of pairs,
which is upstream's order for a power of two. For other sizes the rule extends the same tree:
at each level, a group without a partner group (the last one, when the number of groups is
odd) passes up unchanged; 3 ranks give ``adasum(adasum(g0, g1), g2)``. Upstream implements only
powers of two on CPU (and fails at 3 processes, upstream #3400).

Each level is one exchange of the whole buffer: every rank receives the other group's combined
vector from one of its members and computes ``adasum(lower group's, upper group's)``, so every
rank computes the same operations on the same data and the results are bitwise identical on
all ranks. log2(n) exchanges of the buffer: more traffic than upstream's vector halving for
large n, no sub-communicators, on every plane.

Must not touch: the engine, negotiation, a transport beyond the ``Transport`` contract.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from horovod.common.blas import ordered_dot
from horovod.transport.base import Scratch, as_bytes

TINY = math.sqrt(sys.float_info.min)  # upstream's threshold on a squared norm


def levels(n: int, me: int) -> list[tuple[bool, list[int], int] | None]:
    """For rank ``me`` of ``n``, each level of the tree: (its group is the lower one, the ranks
    it sends its vector to, the rank it receives the other group's vector from), or None where
    its group has no partner group and passes up unchanged."""
    out: list[tuple[bool, list[int], int] | None] = []
    d = 1
    while d < n:
        block = me // d
        start = block * d
        lower = block % 2 == 0
        pstart = start + d if lower else start - d
        psize = max(0, min(d, n - pstart))
        if psize > 0:
            my_size = min(d, n - start)
            sends = [
                q for q in range(pstart, pstart + psize) if (q - pstart) % my_size == me - start
            ]
            out.append((lower, sends, pstart + (me - start) % psize))
        else:
            out.append(None)
        d *= 2
    return out


def combine(a: np.ndarray, b: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
    """``out`` = adasum(a, b) per segment of ``counts`` elements (flat arrays of one float
    type; ``out`` may be ``a`` or ``b``)."""
    off = 0
    for c in counts:
        sa, sb, so = a[off : off + c], b[off : off + c], out[off : off + c]
        off += c
        if c == 0:
            continue
        a64 = sa.astype(np.float64, copy=False)
        b64 = sb.astype(np.float64, copy=False)
        # (summed in a fixed order: the bits must not depend on BLAS's threads)
        dot = ordered_dot(a64, b64)
        anormsq = ordered_dot(a64, a64)
        bnormsq = ordered_dot(b64, b64)
        acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= TINY else 1.0
        bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= TINY else 1.0
        # upstream's scaled add: double coefficients times the elements, rounded to the type
        np.copyto(so, acoeff * a64 + bcoeff * b64, casting="unsafe")


def adasum_allreduce(t, buf: np.ndarray, counts: Sequence[int], scratch: Scratch) -> None:
    """In place: ``buf`` (flat, the tensors' segments of ``counts`` elements in order)
    becomes the Adasum combination of every rank's ``buf`` (module docstring)."""
    n, me = t.size, t.rank
    if n == 1:
        return
    other = scratch.get(buf.nbytes, buf.dtype)
    for level in levels(n, me):
        if level is None:
            continue
        lower, sends, source = level
        t.exchange([(q, as_bytes(buf)) for q in sends], [(source, as_bytes(other))])
        a, b = (buf, other) if lower else (other, buf)
        combine(a, b, counts, buf)


def reference(vectors: Sequence[np.ndarray], counts: Sequence[int] | None = None) -> np.ndarray:
    """The tree combination of ``vectors`` (one per rank, in rank order) in one process:
    what every rank's result must equal (tests, and a definition to read)."""
    items = [np.array(v).reshape(-1) for v in vectors]
    counts = list(counts) if counts is not None else [items[0].size]
    while len(items) > 1:
        nxt = []
        for i in range(0, len(items) - 1, 2):
            out = np.empty_like(items[i])
            combine(items[i], items[i + 1], counts, out)
            nxt.append(out)
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0]
