"""The framework-free API: every Horovod call on NumPy arrays.

``horovod.numpy`` exports it as is; framework packages adapt their tensors to arrays (zero-copy
views where the framework allows) and call the ``submit_*`` functions here, so argument checks,
naming, handles and error texts are written once.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from horovod.common.dtypes import code_of
from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core import context as _context
from horovod.core.express import NOT_EXPRESS
from horovod.core.handles import Entry, Handle
from horovod.core.messages import (
    ADASUM_OP,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    AVERAGE,
    BARRIER,
    BROADCAST,
    CPU_DEVICE,
    JOIN,
    MAX,
    MIN,
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
    PRODUCT,
    REDUCESCATTER,
    SUM,
    Request,
)
from horovod.core.pool import POOL as _POOL

# Reduce ops, as upstream exports them.
Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM_OP, MIN, MAX, PRODUCT
_REDUCE_OPS = {Average, Sum, Min, Max, Product}
_PKG = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------- basics


def init(process_sets: Any = None, comm: Any = None) -> None:
    """Start Horovod. ``process_sets``: a list of ``ProcessSet`` to register on every rank, or
    ``"dynamic"`` to allow ``add_process_set``/``remove_process_set`` later."""
    _context.init(process_sets=process_sets, comm=comm)


def shutdown() -> None:
    """Stop Horovod on this rank (every rank stops after the collectives already decided);
    ``init()`` may be called again afterwards."""
    _context.shutdown()


def is_initialized() -> bool:
    return _context.current() is not None


def _ctx() -> _context.Context:
    return _context.require()


def size() -> int:
    return _ctx().size


def rank() -> int:
    return _ctx().rank


def local_size() -> int:
    return _ctx().local_size


def local_rank() -> int:
    return _ctx().local_rank


def cross_size() -> int:
    return _ctx().cross_size


def cross_rank() -> int:
    return _ctx().cross_rank


def is_homogeneous() -> bool:
    return _ctx().is_homogeneous


def mpi_threads_supported() -> bool:
    raise ValueError(
        "Horovod MPI is not enabled; this build runs on pyhorovod's own TCP "
        "transport (the Gloo controller)."
    )


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return is_initialized()


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (rank 0 writes; other ranks return at once).
    A timeline already being written is closed first. Works whether or not HOROVOD_TIMELINE
    was set (upstream required HOROVOD_TIMELINE=DYNAMIC)."""
    ctx = _ctx()
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise ValueError(f"start_timeline: file_path must be a non-empty path, got {file_path!r}")
    try:
        ctx.start_timeline(os.fspath(file_path), bool(mark_cycles))
    except OSError as e:
        raise ValueError(f"start_timeline: cannot write {file_path!r}: {e.strerror or e}") from None


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (a no-op when none is being written)."""
    _ctx().stop_timeline()


# --------------------------------------------------------------------------------- compression
class Compressor:
    """Upstream's interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def _cast_compressor(target: np.dtype) -> type[Compressor]:
    class _Cast(Compressor):
        @staticmethod
        def compress(tensor: Any) -> tuple[Any, Any]:
            arr = np.asarray(tensor)
            if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
                return arr.astype(target), arr.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor: Any, ctx: Any) -> Any:
            return tensor if ctx is None else np.asarray(tensor).astype(ctx)

    return _Cast


class Compression:
    """Gradient compression for transport: ``none``, ``fp16`` (upstream) and ``bf16``."""

    none = NoneCompressor
    fp16 = _cast_compressor(np.dtype(np.float16))
    try:
        import ml_dtypes as _mld

        bf16 = _cast_compressor(np.dtype(_mld.bfloat16))
        del _mld
    except ImportError:  # pragma: no cover
        pass


# --------------------------------------------------------------------------------- helpers
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


_INTERNAL: dict[str, bool] = {}  # code file name -> part of this package (memoized)
_SITES: dict[tuple[Any, int], str] = {}  # (code, line) -> "file.py:42 in fn" (memoized)


def _callsite() -> str:
    f = sys._getframe(1)
    internal = _INTERNAL
    while f is not None:
        name = f.f_code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal[name] = os.path.abspath(name).startswith(_PKG)
        if not inside:
            break
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return ""
    key = (f.f_code, f.f_lineno)
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) > 4096:
            _SITES.clear()
        site = _SITES[key] = (
            f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
        )
    return site


_NUMBERS = (float, int)


def _express(
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
    return ctx.engine.express(op, prefix + name, arr, out, reduce_op, root, _callsite)


def _express_allreduce(
    name: Any, arr: Any, out: Any, op: Any, average: Any, pre: Any, post: Any, process_set: Any
) -> Any:
    """``_express`` for an allreduce: only with the default ``average`` and scale factors of
    exactly 1 (plain numbers); ``op`` None is Average."""
    if (
        average is not None
        or type(pre) not in _NUMBERS
        or type(post) not in _NUMBERS
        or pre != 1
        or post != 1
    ):
        return NOT_EXPRESS
    reduce_op = AVERAGE if op is None else op
    return _express(ALLREDUCE, "allreduce.", name, arr, out, process_set, reduce_op)


def _array(tensor: Any, what: str) -> np.ndarray:
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


def _writable(tensor: np.ndarray, what: str) -> None:
    if not tensor.flags.writeable:
        raise ValueError(f"{what}: the array is read-only, so it cannot be updated in place")


def _resolve_set(ctx: _context.Context, process_set: ProcessSet, what: str) -> int:
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


def _reduce_op(op: int | None, average: bool | None, what: str, default: int = Average) -> int:
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
        raise NotImplementedError(
            f"{what}: op=Adasum is not available in this pyhorovod build "
            "yet; use op=hvd.Average or hvd.Sum"
        )
    if op not in _REDUCE_OPS:
        raise ValueError(f"{what}: unknown op={op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _names(
    ctx: _context.Context, prefix: str, name: str | None, ps_id: int, n: int | None, count: int = 1
) -> list[str]:
    """Core names: ``<op>.<name>``, or ``<op>.noname.<k>`` where k counts this rank's unnamed
    ops on that process set, so unnamed ops match across ranks by call order within the set."""
    if n is None and count != 1:
        raise ValueError(f"{prefix}: one tensor expected, got {count}; use the grouped_ form")
    if name:
        base = f"{prefix}.{name}"
    else:
        ctx.op_counters[f"noname.{ps_id}"] += 1
        base = f"{prefix}.noname.{ctx.op_counters[f'noname.{ps_id}']}"
    if n is None:
        return [base]
    return [f"{base}_{i + 1}of{n}" for i in range(n)]


def _enqueue(
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
        names = _names(ctx, what, name, ps_id, n if grouped else None, n)
    group = _group_id(ctx, n if grouped else None)
    site = _callsite()
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


def _group_id(ctx: _context.Context, n: int | None) -> int:
    if n is None:
        return -1
    ctx.op_counters["group"] += 1
    return ctx.op_counters["group"]


# --------------------------------------------------------------------------------- submission
Alloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]


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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, what)
    for t in tensors:
        if t.dtype == np.bool_ and op == Average:
            raise ValueError(
                f"{what}: op=Average is not defined for bool arrays; use Sum (or), "
                "Min (and) or Max (or)"
            )
    pre, post = float(prescale_factor), float(postscale_factor)
    if not (math.isfinite(pre) and math.isfinite(post)):
        raise ValueError(f"{what}: prescale_factor and postscale_factor must be finite")
    return _enqueue(
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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, "allreduce")
    if len(names) != len(tensors) or len(set(names)) != len(names):
        raise ValueError("allreduce batch: give one distinct name per tensor")
    return _enqueue(
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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, what)
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(
                f"{what}: needs an array with at least one dimension (the one "
                "gathered along), got a scalar; reshape it with x.reshape(1)"
            )
    return _enqueue(
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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, "broadcast")
    ranks = ctx.engine.sets[ps_id].ranks
    if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in ranks:
        raise ValueError(
            f"broadcast: root_rank={root_rank!r} is not a rank of the process set "
            f"(its ranks are {ranks}); root_rank is a global rank"
        )
    return _enqueue(
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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, "alltoall")
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
    return _enqueue(
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
    ctx = _ctx()
    ps_id = _resolve_set(ctx, process_set, what)
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(f"{what}: needs an array with at least one dimension, got a scalar")
        if t.dtype == np.bool_:
            raise ValueError(f"{what}: bool arrays cannot be summed; cast them first")
    return _enqueue(
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


def _blocking(ctx: _context.Context, op: int, name: str, ps_id: int, extra: Any = None) -> Any:
    site = _callsite()
    handle = Handle(1, site)
    req = Request(ps_id, name, op, 0, (), SUM, -1, 1.0, 1.0, CPU_DEVICE, -1, extra, site)
    ctx.engine.submit([Entry(req, None, None, handle)], wake=False)
    return handle.wait()[0]


# --------------------------------------------------------------------------------- handles
def poll(handle: int) -> bool:
    """True once the op behind ``handle`` has completed (never blocks)."""
    ctx = _ctx()
    h = ctx.handles.get(handle)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return h.done()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its output; raises HorovodInternalError if
    the op failed. Each handle can be synchronized once."""
    ctx = _ctx()
    h = ctx.handles.pop(handle, None)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    results = h.wait()
    return h.finish(results) if h.finish is not None else results[0]


# --------------------------------------------------------------------------------- numpy API
def allreduce_async(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = _reduce_op(op, average, "allreduce")
    t = _array(tensor, "allreduce")
    return submit_allreduce(
        [t],
        [_POOL.empty(t.shape, t.dtype)],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
    )


def allreduce(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Reduce ``tensor`` over all ranks of ``process_set``; returns a new array."""
    if compression is Compression.none:
        got = _express_allreduce(
            name, tensor, None, op, average, prescale_factor, postscale_factor, process_set
        )
        if got is not NOT_EXPRESS:
            return got  # type: ignore[no-any-return]
    op = _reduce_op(op, average, "allreduce")
    compressed, cctx = compression.compress(_array(tensor, "allreduce"))
    with waited():
        h = allreduce_async(
            compressed,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
    return compression.decompress(synchronize(h), cctx)


def allreduce_async_(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = _reduce_op(op, average, "allreduce_")
    t = _array(tensor, "allreduce_")
    _writable(t, "allreduce_")
    return submit_allreduce(
        [t],
        [t],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
    )


def allreduce_(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """In-place allreduce; returns ``tensor``."""
    got = _express_allreduce(
        name, tensor, tensor, op, average, prescale_factor, postscale_factor, process_set
    )
    if got is not NOT_EXPRESS:
        return got  # type: ignore[no-any-return]
    with waited():
        h = allreduce_async_(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )
    return synchronize(h)


def grouped_allreduce_async(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = _reduce_op(op, average, "grouped_allreduce")
    ts = [_array(t, "grouped_allreduce") for t in tensors]
    return submit_allreduce(
        ts,
        [_POOL.empty(t.shape, t.dtype) for t in ts],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        finish=list,
    )


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    op = _reduce_op(op, average, "grouped_allreduce")
    packed = [compression.compress(_array(t, "grouped_allreduce")) for t in tensors]
    with waited():
        h = grouped_allreduce_async(
            [p[0] for p in packed],
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
    return [compression.decompress(o, p[1]) for o, p in zip(synchronize(h), packed, strict=False)]


def grouped_allreduce_async_(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = _reduce_op(op, average, "grouped_allreduce_")
    ts = [_array(t, "grouped_allreduce_") for t in tensors]
    for t in ts:
        _writable(t, "grouped_allreduce_")
    return submit_allreduce(
        ts,
        ts,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        finish=list,
    )


def grouped_allreduce_(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def allgather_async(
    tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    return submit_allgather(
        [_array(tensor, "allgather")], name=name, process_set=process_set, grouped=False
    )


def allgather(
    tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order; the first
    dimension may differ between ranks."""
    got = _express(ALLGATHER, "allgather.", name, tensor, None, process_set)
    if got is not NOT_EXPRESS:
        return got  # type: ignore[no-any-return]
    with waited():
        h = allgather_async(tensor, name, process_set)
    return synchronize(h)


def grouped_allgather_async(
    tensors: Sequence[Any], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    return submit_allgather(
        [_array(t, "grouped_allgather") for t in tensors],
        name=name,
        process_set=process_set,
        grouped=True,
        finish=list,
    )


def grouped_allgather(
    tensors: Sequence[Any], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[np.ndarray]:
    with waited():
        h = grouped_allgather_async(tensors, name, process_set)
    return synchronize(h)


def broadcast_async(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    t = _array(tensor, "broadcast")
    return submit_broadcast(
        t, _POOL.empty(t.shape, t.dtype), root_rank, name=name, process_set=process_set
    )


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """``root_rank``'s ``tensor`` on every rank (a new array)."""
    got = _express(BROADCAST, "broadcast.", name, tensor, None, process_set, SUM, root_rank)
    if got is not NOT_EXPRESS:
        return got  # type: ignore[no-any-return]
    with waited():
        h = broadcast_async(tensor, root_rank, name, process_set)
    return synchronize(h)


def broadcast_async_(
    tensor: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    t = _array(tensor, "broadcast_")
    _writable(t, "broadcast_")
    return submit_broadcast(t, t, root_rank, name=name, process_set=process_set)


def broadcast_(
    tensor: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    got = _express(BROADCAST, "broadcast.", name, tensor, tensor, process_set, SUM, root_rank)
    if got is not NOT_EXPRESS:
        return got  # type: ignore[no-any-return]
    with waited():
        h = broadcast_async_(tensor, root_rank, name, process_set)
    return synchronize(h)


def alltoall_async(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    with_splits = splits is not None
    return submit_alltoall(
        _array(tensor, "alltoall"),
        splits,
        name=name,
        process_set=process_set,
        finish=(lambda r: r[0]) if with_splits else (lambda r: r[0][0]),
    )


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows (in order) to rank i and concatenate what arrives, in rank order.
    Returns the output, or ``(output, received_splits)`` when ``splits`` is given."""
    with waited():
        h = alltoall_async(tensor, splits, name, process_set)
    return synchronize(h)


def reducescatter_async(
    tensor: Any,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    op = _reduce_op(op, None, "reducescatter")
    return submit_reducescatter(
        [_array(tensor, "reducescatter")],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
    )


def reducescatter(
    tensor: Any,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> np.ndarray:
    """Reduce over ranks, then give rank r its block of rows (the first ``d0 % n`` ranks get one
    row more)."""
    compressed, cctx = compression.compress(_array(tensor, "reducescatter"))
    with waited():
        h = reducescatter_async(
            compressed, name, op, process_set, prescale_factor, postscale_factor
        )
    return compression.decompress(synchronize(h), cctx)


def grouped_reducescatter_async(
    tensors: Sequence[Any],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    op = _reduce_op(op, None, "grouped_reducescatter")
    return submit_reducescatter(
        [_array(t, "grouped_reducescatter") for t in tensors],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        finish=list,
    )


def grouped_reducescatter(
    tensors: Sequence[Any],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[np.ndarray]:
    packed = [compression.compress(_array(t, "grouped_reducescatter")) for t in tensors]
    with waited():
        h = grouped_reducescatter_async(
            [p[0] for p in packed], name, op, process_set, prescale_factor, postscale_factor
        )
    return [compression.decompress(o, p[1]) for o, p in zip(synchronize(h), packed, strict=False)]


def join(device: int = -1) -> int:
    """This rank has no more data: it takes part in other ranks' allreduces with zeros until
    every rank has joined. Returns the rank that joined last (the same on every rank)."""
    ctx = _ctx()
    return int(_blocking(ctx, JOIN, "join.noname", 0))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached the barrier."""
    ctx = _ctx()
    _blocking(ctx, BARRIER, "barrier.noname", _resolve_set(ctx, process_set, "barrier"))


# --------------------------------------------------------------------------------- objects
def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``obj`` on every rank (serialised with cloudpickle)."""
    ctx = _ctx()
    name = name or type(obj).__name__
    if ctx.rank == root_rank:
        payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
        length = np.array([payload.size], dtype=np.int64)
    else:
        payload = None
        length = np.zeros(1, dtype=np.int64)
    broadcast_(length, root_rank, name=f"{name}.sz", process_set=process_set)
    buf = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
    broadcast_(buf, root_rank, name=f"{name}.t", process_set=process_set)
    if ctx.rank == root_rank:
        return obj
    return cloudpickle.loads(buf.tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order."""
    name = name or type(obj).__name__
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(
        np.array([payload.size], dtype=np.int64), name=f"{name}.sz", process_set=process_set
    )
    data = allgather(payload, name=f"{name}.t", process_set=process_set)
    out, off = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[off : off + n].tobytes()))
        off += n
    return out


# --------------------------------------------------------------------------------- process sets
def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after init (needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or
    ``init(process_sets="dynamic")``). Every rank must call it, in the same order."""
    ctx = _ctx()
    if not ctx.config.dynamic_process_sets:
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call "
            "hvd.init(process_sets='dynamic')) to allow adding process sets after "
            "Horovod initialization."
        )
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    bad = [r for r in ps.ranks if r >= ctx.size]
    if bad:
        raise ValueError(
            f"add_process_set: ranks {bad} do not exist; the job has {ctx.size} "
            f"ranks (0..{ctx.size - 1})"
        )
    if ps.process_set_id is not None and ctx.public_sets.get(ps.process_set_id) is ps:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    for ps_id, state in ctx.engine.sets.items():
        if state.ranks == ps.ranks:
            raise ValueError(
                f"Attempted to add a duplicate process set: {ps} has the same ranks "
                f"as registered process set {ps_id}"
            )
    ctx.op_counters["ps"] += 1
    new_id = _blocking(
        ctx, PROCESS_SET_ADD, f"process_set.add.{ctx.op_counters['ps']}", 0, tuple(ps.ranks)
    )
    ps.process_set_id = int(new_id)
    ctx.public_sets[ps.process_set_id] = ps
    ctx.op_counters.pop(f"noname.{new_id}", None)  # ids are reused: restart its auto-names
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a dynamic process set on every rank; False for the global or an unregistered
    set."""
    ctx = _ctx()
    if not ctx.config.dynamic_process_sets:
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets "
            "after Horovod initialization."
        )
    ps_id = process_set.process_set_id
    if ps_id in (None, 0) or ctx.public_sets.get(ps_id) is not process_set:
        return False
    ctx.op_counters["ps"] += 1
    _blocking(ctx, PROCESS_SET_REMOVE, f"process_set.remove.{ctx.op_counters['ps']}", 0, ps_id)
    ctx.public_sets.pop(ps_id, None)
    process_set.process_set_id = None
    return True


__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compression",
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "broadcast_object",
    "allgather_object",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "HorovodInternalError",
]
