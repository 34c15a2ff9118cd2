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


# Elements per step of ``combine``: a step's float64 copies and products stay in cache.
CHUNK = 65536


def combine(a: np.ndarray, b: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
    """``out`` = adasum(a, b) per segment of ``counts`` elements (flat arrays of one float
    type; ``out`` may be ``a`` or ``b``), in steps of ``CHUNK`` elements copied to float64.

    A segment's dot product and squared norms are sums of elementwise products (exact for
    float32 and float16 inputs) in an order fixed by the segments' lengths alone: each step's
    by NumPy's own loops (``einsum``, compiled for the baseline of NumPy's build, or
    ``reduceat`` over the products where a step holds many small tensors: ``MANY``), the
    steps' sums added in order. A BLAS dot product (what this used) sums in the order of the
    kernel it picks for the CPU: OpenBLAS gave other bits for the same vectors as "SkylakeX",
    "Haswell" and "Prescott" on this VM, so ranks on hosts of different CPU generations
    computed other coefficients and their results drifted apart. Then ``acoeff * a + bcoeff *
    b`` in float64, rounded to the type: upstream's scaled add."""
    if len(counts) == 1:  # (one tensor: the usual unfused call)
        n = int(counts[0])
        if n:
            _combine_one(a[:n], b[:n], out[:n], np.empty((2, min(n, CHUNK))))
        return
    lens = np.asarray(counts, dtype=np.int64)
    if int(np.count_nonzero(lens)) > MANY[0] and int(lens.max()) <= MANY[1]:
        _combine_many(a, b, lens[lens > 0], out)
        return
    room = np.empty((2, min(int(lens.max(initial=0)), CHUNK)))  # (float64 copies, reused)
    off = 0
    for c in counts:
        if c:
            _combine_one(a[off : off + c], b[off : off + c], out[off : off + c], room)
        off += c


# ``combine`` takes a buffer of more than MANY[0] tensors of at most MANY[1] elements in steps
# across the tensors (a few calls a step) rather than tensor by tensor (a few a tensor).
MANY = (8, 8192)
# A step of at most this many elements computes its three sums in one ``einsum`` (a 2 x 2 Gram
# matrix), a longer one in three (faster there): the order is fixed by the length either way.
SMALL = 8192


def _combine_one(sa: np.ndarray, sb: np.ndarray, so: np.ndarray, room: np.ndarray) -> None:
    """``combine`` of one tensor's segment (``room``: float64, 2 x at least min(its size,
    ``CHUNK``))."""
    n = sa.size
    if n <= SMALL:  # (one step, straight through: a small tensor costs its calls)
        xy = room[:, :n]
        x, y = xy
        np.copyto(x, sa, casting="unsafe")
        np.copyto(y, sb, casting="unsafe")
        (aa, ab), (_, bb) = np.einsum("ij,kj->ik", xy, xy).tolist()
        np.multiply(x, 1.0 - ab / aa * 0.5 if aa >= TINY else 1.0, out=x)
        np.multiply(y, 1.0 - ab / bb * 0.5 if bb >= TINY else 1.0, out=y)
        np.copyto(so, np.add(x, y, out=x), casting="unsafe")
        return
    dot = anormsq = bnormsq = 0.0
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        xy = room[:, :m]
        x, y = xy
        np.copyto(x, sa[s : s + m], casting="unsafe")
        np.copyto(y, sb[s : s + m], casting="unsafe")
        if m <= SMALL:  # (the last step of a long tensor: the three sums in one call)
            (aa, ab), (_, bb) = np.einsum("ij,kj->ik", xy, xy).tolist()
            dot += ab
            anormsq += aa
            bnormsq += bb
        else:
            dot += float(np.einsum("i,i->", x, y))
            anormsq += float(np.einsum("i,i->", x, x))
            bnormsq += float(np.einsum("i,i->", y, y))
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= TINY else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= TINY else 1.0
    for s in range(0, n, CHUNK):  # (each step reads its elements before writing them)
        m = min(CHUNK, n - s)
        x, y = room[:, :m]
        if n > CHUNK:  # (one step: its copies are still there)
            np.copyto(x, sa[s : s + m], casting="unsafe")
            np.copyto(y, sb[s : s + m], casting="unsafe")
        np.multiply(x, acoeff, out=x)
        np.multiply(y, bcoeff, out=y)
        np.copyto(so[s : s + m], np.add(x, y, out=x), casting="unsafe")


def _combine_many(a: np.ndarray, b: np.ndarray, lens: np.ndarray, out: np.ndarray) -> None:
    """``combine`` of many small tensors (``lens``: their nonzero lengths, in order), in steps
    across them: per step, the products' sums per tensor by ``reduceat``, and the output with
    each element's coefficients repeated from its tensor's."""
    ends = np.cumsum(lens)
    starts = ends - lens
    n = int(ends[-1])
    k = min(n, CHUNK)
    x, y, t = np.empty(k), np.empty(k), np.empty(k)
    sums = np.zeros((3, lens.size))
    steps = []  # per step: (start, size, its first and past-last tensor, their offsets in it)
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        first = int(np.searchsorted(ends, s, side="right"))
        stop = int(np.searchsorted(starts, s + m, side="left"))
        at = np.maximum(starts[first:stop] - s, 0)
        steps.append((s, m, first, stop, at))
        xs, ys, ts = x[:m], y[:m], t[:m]
        np.copyto(xs, a[s : s + m], casting="unsafe")
        np.copyto(ys, b[s : s + m], casting="unsafe")
        sums[0, first:stop] += np.add.reduceat(np.multiply(xs, ys, out=ts), at)
        sums[1, first:stop] += np.add.reduceat(np.multiply(xs, xs, out=ts), at)
        sums[2, first:stop] += np.add.reduceat(np.multiply(ys, ys, out=ts), at)
    dot, anormsq, bnormsq = sums
    acoeff, bcoeff = (_coefficients(dot, normsq) for normsq in (anormsq, bnormsq))
    for s, m, first, stop, at in steps:  # (each step reads its elements before writing them)
        xs, ys = x[:m], y[:m]
        if len(steps) > 1:  # (one step: its copies are still there)
            np.copyto(xs, a[s : s + m], casting="unsafe")
            np.copyto(ys, b[s : s + m], casting="unsafe")
        sizes = np.diff(np.append(at, m))
        np.multiply(xs, np.repeat(acoeff[first:stop], sizes), out=xs)
        np.multiply(ys, np.repeat(bcoeff[first:stop], sizes), out=ys)
        np.copyto(out[s : s + m], np.add(xs, ys, out=xs), casting="unsafe")


def _coefficients(dot: np.ndarray, normsq: np.ndarray) -> np.ndarray:
    """1 - dot / (2 normsq) per segment, 1 where the squared norm is below ``TINY`` (the
    scalar formula's operations, elementwise: the same bits)."""
    big = normsq >= TINY
    ratio = np.divide(dot, normsq, out=np.zeros_like(dot), where=big)
    return np.subtract(1.0, ratio * 0.5, out=np.ones_like(dot), where=big)


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
