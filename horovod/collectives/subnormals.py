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

Looking costs a few microseconds (``present``: 256 values in runs of 16, one cache line each),
so it is done only for buffers of ``MIN_ELEMENTS`` or more, and, where none were found in a
buffer of a size, only at every ``RECHECK``-th buffer of that size (``likely``): subnormal
gradients come and go over many steps, not from one call to the next, and a bucket of
gradients has the same size every step.

Must not touch: anything but the buffers it is given (the reductions' numerics live in
``algorithms.scale``).
"""

from __future__ import annotations

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


def present(flat: np.ndarray) -> bool:
    """Does float32 ``flat`` (one dimension) hold subnormals, judged from ``SAMPLE_RUNS`` runs
    of 16 values spread over it (all of it, if smaller)? A share too small to show there costs
    little where it is missed."""
    step = flat.size // SAMPLE_RUNS
    if step < 16:  # (a part too small to sample: all of it)
        bits = np.array(flat).view(np.uint32)
        if not bits.size:
            return False
    else:
        bits = np.array(flat[: SAMPLE_RUNS * step].reshape(SAMPLE_RUNS, step)[:, :16])
        bits = bits.view(np.uint32)
    # (bits less one, without the sign: a zero wraps to the top, a subnormal stays below the
    # least normal)
    bits -= _ONE
    bits &= _NO_SIGN
    return int(bits.min()) < _LEAST_NORMAL_LESS_ONE


def likely(buf: np.ndarray, part: np.ndarray | None = None) -> bool:
    """Should ``buf`` be scaled through float64: is it C-contiguous float32 of ``MIN_ELEMENTS``
    or more, is it the turn of buffers of its size to be looked at (every one while subnormals
    keep being found, else one in ``RECHECK``; a size stands for a gradient bucket, which comes
    back every step), and does it (or ``part``, this rank's part of it) hold subnormals
    (``present``)?"""
    size = buf.size
    if size < MIN_ELEMENTS or buf.dtype is not FLOAT32 or not buf.flags.c_contiguous:
        return False
    skips = _skips
    left = skips.get(size, 0)
    if left > 0:
        skips[size] = left - 1
        return False
    found = present((buf if part is None else part).reshape(-1))
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
