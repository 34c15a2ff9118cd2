"""Checking what a caller passed before anything is submitted: arrays (type, layout, dtype,
writability), process sets (registered, not removed, this rank a member) and reduce ops
(upstream's ``average=`` included); each error names the call and the way out.

Must not touch: the engine's queue (nothing is submitted here), naming.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from horovod.common.dtypes import code_of
from horovod.common.process_sets import ProcessSet
from horovod.core import context as _context
from horovod.core.messages import (
    ADASUM_OP,
    AVERAGE,
    MAX,
    MIN,
    PRODUCT,
    SUM,
)

# Reduce ops, as upstream exports them.
Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM_OP, MIN, MAX, PRODUCT
REDUCE_OPS = {Average, Sum, Min, Max, Product}


def require_context() -> _context.Context:
    return _context.require()


def as_array(tensor: Any, what: str) -> np.ndarray:
    if not isinstance(tensor, np.ndarray):
        if isinstance(tensor, (list, tuple, int, float, bool, np.generic)):
            tensor = np.asarray(tensor)
        else:
            raise TypeError(f"{what}: expected a NumPy array, got {type(tensor).__name__}")
    if not tensor.flags.c_contiguous:
        raise ValueError(
            f"{what}: the array is not C-contiguous (it is a strided view); pass "
            "np.ascontiguousarray(x)"
        )
    code_of(tensor.dtype, what)
    return tensor


def check_writable(tensor: np.ndarray, what: str) -> None:
    if not tensor.flags.writeable:
        raise ValueError(f"{what}: the array is read-only, so it cannot be updated in place")


def resolve_set(ctx: _context.Context, process_set: ProcessSet, what: str) -> int:
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    ps_id = process_set.process_set_id
    if ps_id is None or ctx.public_sets.get(ps_id) is not process_set:
        raise ValueError(
            f"{what}: {process_set} is not registered; register it with "
            "hvd.init(process_sets=[...]) or hvd.add_process_set()"
        )
    if ps_id not in ctx.engine.sets:
        raise ValueError(f"{what}: {process_set} has been removed")
    if ctx.rank not in ctx.engine.sets[ps_id].ranks:
        raise ValueError(
            f"{what}: rank {ctx.rank} is not a member of {process_set}; only its "
            f"ranks {ctx.engine.sets[ps_id].ranks} may call it"
        )
    return ps_id


def resolve_op(op: int | None, average: bool | None, what: str, default: int = Average) -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        op = Average if average else Sum
    if op is None:
        op = default
    if op == Adasum:
        if "reducescatter" in what:
            raise ValueError(
                f"{what}: op=Adasum combines whole vectors (its coefficients need every "
                "element), so it cannot scatter; use op=hvd.Average or hvd.Sum"
            )
        return op
    if op not in REDUCE_OPS:
        raise ValueError(f"{what}: unknown op={op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op
