"""Scaling float32 buffers that hold subnormal values, at the speed of normal ones and with the
same bits.

A float32 multiplication or division whose operand or result is subnormal (nonzero, below
2**-126) costs x86 a microcode assist: averaging a 2.4 MB gradient bucket a third of whose
values are subnormal took 3.6 ms against 0.12 ms for normal values. Converting a float32 to
float64 and back costs no assist. So a buffer found to hold subnormals is scaled through
float64, a block at a time (``multiply``, ``divide``): a product of two float32 values is exact
in float64 and is rounded once on the way back, which is ``np.multiply``'s float32 result; a
float64 quotient rounded to float32 is the correctly rounded float32 quotient (float64 has more
than twice float32's precision plus two bits, so the double rounding is innocuous; checked
against ``np.divide`` on every float32 below 2**-123 in magnitude and a million random ones).
Either way every rank computes the same bits; the choice only moves the time.

Not every CPU charges for subnormals: on an AMD EPYC (stop 58) multiplying the same bucket took
83 us whatever its values, and the float64 way 490-535 us. So each process times the three
ways once, on one block (``threshold``): the float32 multiplication of normal and of subnormal
values, and the float64 way. The float64 way is taken only for buffers whose share of
subnormal values makes it the faster one there (never where subnormals cost nothing extra).

Looking costs a few microseconds (``share``: 256 values in runs of 16, one cache line each),
so it is done only for buffers of ``MIN_ELEMENTS`` or more, and, where too few were found in a
buffer of a size, only at every ``RECHECK``-th buffer of that size (``likely``): subnormal
gradients come and go over many steps, not from one call to the next, and a bucket of
gradients has the same size every step.

Must not touch: anything but the buffers it is given (the reductions' numerics live in
``algorithms.scale``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

MIN_ELEMENTS = 1 << 16  # buffers this large (256 KiB of float32) or more are looked at
RECHECK = 16  # while none were found, one buffer in this many is looked at
SAMPLE_RUNS = 16  # runs of 16 values spread over the buffer
BLOCK = 1 << 14  # elements scaled through float64 at a time (128 KiB of float64)

FLOAT32 = np.dtype(np.float32)
_ONE = np.uint32(1)
_NO_SIGN = np.uint32(0x7FFFFFFF)
_LEAST_NORMAL_LESS_ONE = 0x7FFFFF  # the least normal float32's bits, less one
MAX_SIZES = 256  # buffer sizes whose schedules are kept (all are dropped past this)
# Per buffer size, how many buffers of it are left before the next look (a race between
# threads only moves the time).
_skips: dict[int, int] = {}
# This process's ``threshold`` (None: not timed yet; a race between threads times it twice).
_THRESHOLD: list[float | None] = [None]


def share(flat: np.ndarray) -> float:
    """The share of subnormal values in float32 ``flat`` (one dimension), judged from
    ``SAMPLE_RUNS`` runs of 16 values spread over it (all of it, if smaller). A share too small
    to show there costs little where it is missed."""
    step = flat.size // SAMPLE_RUNS
    if step < 16:  # (a part too small to sample: all of it)
        bits = np.array(flat).view(np.uint32)
        if not bits.size:
            return 0.0
    else:
        bits = np.array(flat[: SAMPLE_RUNS * step].reshape(SAMPLE_RUNS, step)[:, :16])
        bits = bits.view(np.uint32)
    # (bits less one, without the sign: a zero wraps to the top, a subnormal stays below the
    # least normal)
    bits -= _ONE
    bits &= _NO_SIGN
    return int(np.count_nonzero(bits < _LEAST_NORMAL_LESS_ONE)) / bits.size


def threshold() -> float:
    """The share of subnormal values above which scaling a float32 buffer through float64 is
    faster on this CPU than the float32 arithmetic (``inf``: never, where subnormals cost it
    nothing extra); timed once per process (``_measured``) and kept."""
    found = _THRESHOLD[0]
    if found is None:
        found = _THRESHOLD[0] = _measured(_best_of)
    return found


def _best_of(fn: Callable[[], object], reps: int = 7) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measured(timed: Callable[[Callable[[], object]], float]) -> float:
    """``threshold`` from the times ``timed(fn)`` gives for one block: the float32
    multiplication of normal values (cost ``normal`` per element) and of subnormal ones
    (``normal`` plus the ``extra`` a subnormal costs), and the float64 way (``wide``). A buffer
    with a share ``s`` of subnormals costs ``normal + s * extra`` per element in float32, so the
    float64 way pays from ``s = (wide - normal) / extra``. Twice that, so that a share near it
    (where the gain would be small and the timing's noise larger) stays in float32."""
    ones = np.ones(BLOCK, np.float32)
    tiny = np.full(BLOCK, np.float32(2.0**-140), np.float32)  # (halved: still subnormal)
    out = np.empty(BLOCK, np.float32)
    half = np.float32(0.5)
    normal = timed(lambda: np.multiply(ones, half, out=out))
    subnormal = timed(lambda: np.multiply(tiny, half, out=out))
    np.copyto(out, tiny)  # (scaled in place, in float64 whatever its values)
    wide = timed(lambda: multiply(out, 0.5))
    extra = subnormal - normal
    if extra <= 0.0 or wide >= subnormal:
        return float("inf")
    return 2.0 * max(wide - normal, 0.0) / extra


def likely(buf: np.ndarray, part: np.ndarray | None = None) -> bool:
    """Should ``buf`` be scaled through float64: is it C-contiguous float32 of ``MIN_ELEMENTS``
    or more, is it the turn of buffers of its size to be looked at (every one while enough
    subnormals keep being found, else one in ``RECHECK``; a size stands for a gradient bucket,
    which comes back every step), and does it (or ``part``, this rank's part of it) hold a
    share of subnormals above which the float64 way is faster on this CPU (``threshold``)?"""
    size = buf.size
    if size < MIN_ELEMENTS or buf.dtype is not FLOAT32 or not buf.flags.c_contiguous:
        return False
    least = threshold()
    if least >= 1.0:  # (this CPU: never, so no look either)
        return False
    skips = _skips
    left = skips.get(size, 0)
    if left > 0:
        skips[size] = left - 1
        return False
    found = share((buf if part is None else part).reshape(-1)) > least
    if len(skips) >= MAX_SIZES and size not in skips:
        skips.clear()
    skips[size] = 0 if found else RECHECK - 1
    return found


def multiply(flat: np.ndarray, factor: float) -> None:
    """In place, ``flat`` (float32, one dimension) times ``np.float32(factor)``: the bits of
    ``np.multiply(flat, np.float32(factor))``, computed in float64."""
    f = np.float64(np.float32(factor))
    _through_float64(flat, lambda w: np.multiply(w, f, out=w))


def divide(flat: np.ndarray, n: int) -> None:
    """In place, ``flat`` (float32, one dimension) over ``n``: the bits of
    ``np.divide(flat, np.float32(n))``, computed in float64."""
    d = np.float64(n)
    _through_float64(flat, lambda w: np.divide(w, d, out=w))


def _through_float64(flat: np.ndarray, op: Callable[[np.ndarray], object]) -> None:
    wide = np.empty(min(flat.size, BLOCK), np.float64)
    for at in range(0, flat.size, BLOCK):
        part = flat[at : at + BLOCK]
        w = wide[: part.size]
        np.copyto(w, part)
        op(w)
        np.copyto(part, w, casting="same_kind")
