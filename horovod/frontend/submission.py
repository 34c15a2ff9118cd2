"""Turning one checked call into the engine's entries: ``submit_*`` (used by every framework
package and by ``collectives``), the express way for lone synchronous calls
(``Engine.express``), ``waited()`` (a thread about to wait runs the engine itself), and the
blocking control ops (join, barrier, process-set changes).

Must not touch: framework tensors (frameworks pass arrays), the engine's internals (it calls
``Engine.submit`` and ``Engine.express``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.dtypes import code_of
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core import context as _context
from horovod.core.express import NOT_EXPRESS
from horovod.core.handles import Entry, Handle
from horovod.core.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    AVERAGE,
    BROADCAST,
    CPU_DEVICE,
    REDUCESCATTER,
    SUM,
    Request,
)
from horovod.frontend.arguments import Adasum, Average, Sum, require_context, resolve_set
from horovod.frontend.naming import callsite, group_id, op_names

Alloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]

_tls = threading.local()


class _Waited:
    """Ops submitted inside are waited for by this thread right after (``synchronize(x_async(
    ...))``): a sleeping engine thread is not woken for them, the waiting thread runs the
    engine itself (shared-memory jobs). If the block raises, the engine thread is woken after
    all so that nothing submitted is left behind. (A class rather than a generator-based
    context manager: it sits on the path of every synchronous op.)"""

    __slots__ = ()

    def __enter__(self) -> None:
        _tls.waited = True

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        _tls.waited = False
        if kind is not None:
            ctx = _context.current()
            if ctx is not None:
                ctx.engine.wake()


_WAITED = _Waited()


def waited() -> _Waited:
    return _WAITED


NUMBERS = (float, int)


def express(
    op: int,
    prefix: str,
    name: Any,
    arr: Any,
    out: Any,
    process_set: Any,
    reduce_op: int = SUM,
    root: Any = -1,
) -> Any:
    """A synchronous call of a named op on a C-contiguous NumPy array of the global set: try
    the engine's express way (``Engine.express``: no submission at all when the op is a lone
    small cached one). ``NOT_EXPRESS``: submit it as usual."""
    if (
        type(arr) is not np.ndarray
        or type(name) is not str
        or not name
        or process_set is not global_process_set
        or type(root) is not int
    ):
        return NOT_EXPRESS
    ctx = _context.current()
    if ctx is None:
        return NOT_EXPRESS
    flags = arr.flags
    if not flags.c_contiguous or (out is arr and not flags.writeable):
        return NOT_EXPRESS
    return ctx.engine.express(op, prefix + name, arr, out, reduce_op, root, callsite)


def express_allreduce(
    name: Any, arr: Any, out: Any, op: Any, average: Any, pre: Any, post: Any, process_set: Any
) -> Any:
    """``express`` for an allreduce: only with the default ``average`` and scale factors of
    exactly 1 (plain numbers); ``op`` None is Average."""
    if (
        average is not None
        or type(pre) not in NUMBERS
        or type(post) not in NUMBERS
        or pre != 1
        or post != 1
    ):
        return NOT_EXPRESS
    reduce_op = AVERAGE if op is None else op
    return express(ALLREDUCE, "allreduce.", name, arr, out, process_set, reduce_op)


def _check_adasum(t: np.ndarray, op: int, what: str) -> None:
    if op == Adasum and t.dtype.kind != "f" and t.dtype.name != "bfloat16":
        raise TypeError(
            f"{what}: op=Adasum needs floating-point tensors (its coefficients are ratios of "
            f"dot products), got {t.dtype.name}; use op=hvd.Sum for integers"
        )


def submit_allreduce(
    tensors: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray],
    *,
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    grouped: bool,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    what = "grouped_allreduce" if grouped else "allreduce"
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, what)
    for t in tensors:
        _check_adasum(t, op, what)
        if t.dtype == np.bool_ and op == Average:
            raise ValueError(
                f"{what}: op=Average is not defined for bool arrays; use Sum (or), "
                "Min (and) or Max (or)"
            )
    pre, post = float(prescale_factor), float(postscale_factor)
    if not (math.isfinite(pre) and math.isfinite(post)):
        raise ValueError(f"{what}: prescale_factor and postscale_factor must be finite")
    return enqueue(
        ctx,
        what,
        ALLREDUCE,
        ps_id,
        tensors,
        outputs,
        name=name,
        grouped=grouped,
        reduce_op=op,
        prescale=pre,
        postscale=post,
        device=device,
        finish=finish,
    )


def submit_allreduce_batch(
    tensors: Sequence[np.ndarray],
    names: Sequence[str],
    *,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    """Several independent in-place allreduces (``allreduce.<name>`` each, not a group)
    submitted in one call: one message to the coordinator instead of one per tensor. Ranks may
    batch the same names differently."""
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, "allreduce")
    if len(names) != len(tensors) or len(set(names)) != len(names):
        raise ValueError("allreduce batch: give one distinct name per tensor")
    for t in tensors:
        _check_adasum(t, op, "allreduce")
    return enqueue(
        ctx,
        "allreduce",
        ALLREDUCE,
        ps_id,
        tensors,
        tensors,
        name=None,
        grouped=False,
        reduce_op=op,
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
        device=device,
        finish=finish,
        core_names=[f"allreduce.{n}" for n in names],
    )


def submit_allgather(
    tensors: Sequence[np.ndarray],
    *,
    name: str | None,
    process_set: ProcessSet,
    grouped: bool,
    alloc: Alloc | None = None,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    what = "grouped_allgather" if grouped else "allgather"
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, what)
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(
                f"{what}: needs an array with at least one dimension (the one "
                "gathered along), got a scalar; reshape it with x.reshape(1)"
            )
    return enqueue(
        ctx,
        what,
        ALLGATHER,
        ps_id,
        tensors,
        [None] * len(tensors),
        name=name,
        grouped=grouped,
        device=device,
        alloc=alloc,
        finish=finish,
    )


def submit_broadcast(
    tensor: np.ndarray,
    output: np.ndarray,
    root_rank: int,
    *,
    name: str | None,
    process_set: ProcessSet,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, "broadcast")
    ranks = ctx.engine.sets[ps_id].ranks
    if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in ranks:
        raise ValueError(
            f"broadcast: root_rank={root_rank!r} is not a rank of the process set "
            f"(its ranks are {ranks}); root_rank is a global rank"
        )
    return enqueue(
        ctx,
        "broadcast",
        BROADCAST,
        ps_id,
        [tensor],
        [output],
        name=name,
        grouped=False,
        root=int(root_rank),
        device=device,
        finish=finish,
    )


def submit_alltoall(
    tensor: np.ndarray,
    splits: Any,
    *,
    name: str | None,
    process_set: ProcessSet,
    alloc: Alloc | None = None,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, "alltoall")
    n = len(ctx.engine.sets[ps_id].ranks)
    if tensor.ndim == 0:
        raise ValueError("alltoall: needs an array with at least one dimension, got a scalar")
    d0 = tensor.shape[0]
    if splits is None:
        if d0 % n:
            raise ValueError(
                f"alltoall: splits not given, so the first dimension ({d0}) must "
                f"be a multiple of the number of ranks ({n}); pass splits="
            )
        split_list = [d0 // n] * n
    else:
        arr = np.asarray(splits)
        if arr.ndim != 1:
            raise ValueError(f"alltoall: splits must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"alltoall: splits must hold integers, got {arr.dtype}")
        if len(arr) != n:
            raise ValueError(
                f"alltoall: splits has {len(arr)} entries but the process set has "
                f"{n} ranks; give one count per rank"
            )
        if (arr < 0).any():
            raise ValueError(f"alltoall: splits must be >= 0, got {arr.tolist()}")
        if int(arr.sum()) > d0:
            raise ValueError(
                f"alltoall: splits sum to {int(arr.sum())}, more than the first "
                f"dimension of the array ({d0})"
            )
        split_list = [int(x) for x in arr]
    return enqueue(
        ctx,
        "alltoall",
        ALLTOALL,
        ps_id,
        [tensor],
        [None],
        name=name,
        grouped=False,
        device=device,
        splits=split_list,
        alloc=alloc,
        finish=finish,
    )


def submit_reducescatter(
    tensors: Sequence[np.ndarray],
    *,
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    grouped: bool,
    alloc: Alloc | None = None,
    device: int = CPU_DEVICE,
    finish: Callable[[list], Any] | None = None,
) -> int:
    what = "grouped_reducescatter" if grouped else "reducescatter"
    if op not in (Average, Sum):
        raise ValueError(f"{what}: only op=hvd.Average and hvd.Sum are supported, got {op}")
    ctx = require_context()
    ps_id = resolve_set(ctx, process_set, what)
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(f"{what}: needs an array with at least one dimension, got a scalar")
        if t.dtype == np.bool_:
            raise ValueError(f"{what}: bool arrays cannot be summed; cast them first")
    return enqueue(
        ctx,
        what,
        REDUCESCATTER,
        ps_id,
        tensors,
        [None] * len(tensors),
        name=name,
        grouped=grouped,
        reduce_op=op,
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
        device=device,
        alloc=alloc,
        finish=finish,
    )


def blocking(ctx: _context.Context, op: int, name: str, ps_id: int, extra: Any = None) -> Any:
    site = callsite()
    handle = Handle(1, site)
    req = Request(ps_id, name, op, 0, (), SUM, -1, 1.0, 1.0, CPU_DEVICE, -1, extra, site)
    ctx.engine.submit([Entry(req, None, None, handle)], wake=False)
    return handle.wait()[0]


def enqueue(
    ctx: _context.Context,
    what: str,
    op_type: int,
    ps_id: int,
    tensors: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray | None],
    *,
    name: str | None,
    grouped: bool,
    reduce_op: int = SUM,
    root: int = -1,
    prescale: float = 1.0,
    postscale: float = 1.0,
    device: int = CPU_DEVICE,
    splits: list[int] | None = None,
    alloc: Alloc | None = None,
    finish: Callable[[list], Any] | None = None,
    core_names: Sequence[str] | None = None,
) -> int:
    """Name, describe and submit one op (one entry per tensor); returns its handle id.
    ``core_names``: explicit names for independent (ungrouped) ops submitted together."""
    n = len(tensors)
    hid = ctx.new_handle()
    if core_names is not None:
        names = list(core_names)
    else:
        names = op_names(ctx, what, name, ps_id, n if grouped else None, n)
    group = group_id(ctx, n if grouped else None)
    site = callsite()
    handle = Handle(n, site, finish)
    entries = [
        Entry(
            Request(
                ps_id,
                nm,
                op_type,
                code_of(t.dtype, what),
                tuple(t.shape),
                reduce_op,
                root,
                prescale,
                postscale,
                device,
                group,
                site=site,
            ),
            t,
            o,
            handle,
            i,
            splits=splits,
            alloc=alloc,
        )
        for i, (nm, t, o) in enumerate(zip(names, tensors, outputs, strict=True))
    ]
    ctx.engine.submit(entries, wake=not getattr(_tls, "waited", False))
    ctx.handles[hid] = handle
    return hid
