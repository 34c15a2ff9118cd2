"""The data plane's reduction numerics, for reductions done outside the data plane.

The coordinator's eager allreduce and the peer rounds fold every rank's part themselves; they
must give the same bits as the data plane's algorithms: prescale, fold in rank order (pair by
pair where the data plane's recursive doubling runs), postscale (Average divides by the set's
size, correctly rounded), integers truncated. Pure functions of arrays.

Must not touch: transports, the engine's state.
"""

from __future__ import annotations

import numpy as np

from horovod.collectives import algorithms as alg
from horovod.collectives.algorithms import average_post
from horovod.core import ops
from horovod.core.messages import (
    AVERAGE,
    Response,
)


def fold(parts: list[np.ndarray], resp: Response, nranks: int) -> np.ndarray:
    """An allreduce of ``parts`` (one per rank, in rank order, left untouched) with the data
    plane's numerics: prescale each part, fold them in order, postscale (Average divides by
    ``nranks``), integers truncated. A new array."""
    reducer = ops.UFUNCS[resp.reduce_op]
    pre = resp.prescale
    post = average_post(resp.postscale, nranks) if resp.reduce_op == AVERAGE else resp.postscale
    if pre != 1.0:
        parts = [p.copy() for p in parts]
        for p in parts:
            ops.scale(p, pre)
    if len(parts) == 1:
        acc = parts[0].copy()
    elif in_pairs(len(parts), parts[0]):
        # the data plane's recursive doubling: ((0, 1), (2, 3)), ... pair by pair
        level = [reducer(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
        while len(level) > 1:
            level = [reducer(level[i], level[i + 1], out=level[i]) for i in range(0, len(level), 2)]
        acc = level[0]
    else:
        acc = reducer(parts[0], parts[1])
        for p in parts[2:]:
            reducer(acc, p, out=acc)
    ops.scale(acc, post)
    return acc


def in_pairs(nranks: int, part: np.ndarray) -> bool:
    """Does the data plane combine ``nranks`` parts like ``part`` pair by pair (recursive
    doubling: a power of two above 2, up to the ring threshold), not in rank order?"""
    return (
        nranks > 2
        and nranks & (nranks - 1) == 0
        and (part.nbytes <= alg.SMALL_BYTES or part.size < nranks)
    )


def one_fold(resp: Response, nranks: int) -> bool:
    """Can an allreduce of two ranks' data be one ufunc straight into the output (no scale
    factors, no Average; the same bits as ``_fold``)?"""
    return (
        nranks == 2 and resp.prescale == 1.0 and resp.postscale == 1.0 and resp.reduce_op != AVERAGE
    )
