"""The NumPy API of every collective, as upstream names them: allreduce, allgather, broadcast,
alltoall, reducescatter (each with ``_async``, in-place ``_`` and ``grouped_`` forms where
upstream has them), join and barrier.

Must not touch: the engine (everything goes through ``submission``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core.express import NOT_EXPRESS
from horovod.core.messages import (
    ALLGATHER,
    BARRIER,
    BROADCAST,
    JOIN,
    SUM,
)
from horovod.core.pool import POOL as _POOL
from horovod.frontend.arguments import (
    Average,
    as_array,
    check_writable,
    require_context,
    resolve_op,
    resolve_set,
)
from horovod.frontend.compression import Compression, Compressor
from horovod.frontend.handles import synchronize
from horovod.frontend.submission import (
    blocking,
    express,
    express_allreduce,
    submit_allgather,
    submit_allreduce,
    submit_alltoall,
    submit_broadcast,
    submit_reducescatter,
    waited,
)


def allreduce_async(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = resolve_op(op, average, "allreduce")
    t = as_array(tensor, "allreduce")
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
    if getattr(compression, "exchange", False):
        return exchange_reduce(
            compression,
            [tensor],
            name,
            op,
            average,
            prescale_factor,
            postscale_factor,
            process_set,
            "allreduce",
        )[0]
    if compression is Compression.none:
        got = express_allreduce(
            name, tensor, None, op, average, prescale_factor, postscale_factor, process_set
        )
        if got is not NOT_EXPRESS:
            return got  # type: ignore[no-any-return]
    op = resolve_op(op, average, "allreduce")
    compressed, cctx = compression.compress(as_array(tensor, "allreduce"))
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
    op = resolve_op(op, average, "allreduce_")
    t = as_array(tensor, "allreduce_")
    check_writable(t, "allreduce_")
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
    got = express_allreduce(
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
    op = resolve_op(op, average, "grouped_allreduce")
    ts = [as_array(t, "grouped_allreduce") for t in tensors]
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
    if getattr(compression, "exchange", False):
        return exchange_reduce(
            compression,
            tensors,
            name,
            op,
            average,
            prescale_factor,
            postscale_factor,
            process_set,
            "grouped_allreduce",
        )
    op = resolve_op(op, average, "grouped_allreduce")
    packed = [compression.compress(as_array(t, "grouped_allreduce")) for t in tensors]
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
    op = resolve_op(op, average, "grouped_allreduce_")
    ts = [as_array(t, "grouped_allreduce_") for t in tensors]
    for t in ts:
        check_writable(t, "grouped_allreduce_")
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
        [as_array(tensor, "allgather")], name=name, process_set=process_set, grouped=False
    )


def allgather(
    tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order; the first
    dimension may differ between ranks."""
    got = express(ALLGATHER, "allgather.", name, tensor, None, process_set)
    if got is not NOT_EXPRESS:
        return got  # type: ignore[no-any-return]
    with waited():
        h = allgather_async(tensor, name, process_set)
    return synchronize(h)


def grouped_allgather_async(
    tensors: Sequence[Any], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    return submit_allgather(
        [as_array(t, "grouped_allgather") for t in tensors],
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
    t = as_array(tensor, "broadcast")
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
    got = express(BROADCAST, "broadcast.", name, tensor, None, process_set, SUM, root_rank)
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
    t = as_array(tensor, "broadcast_")
    check_writable(t, "broadcast_")
    return submit_broadcast(t, t, root_rank, name=name, process_set=process_set)


def broadcast_(
    tensor: np.ndarray,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    got = express(BROADCAST, "broadcast.", name, tensor, tensor, process_set, SUM, root_rank)
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
        as_array(tensor, "alltoall"),
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
    op = resolve_op(op, None, "reducescatter")
    return submit_reducescatter(
        [as_array(tensor, "reducescatter")],
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
    compressed, cctx = compression.compress(as_array(tensor, "reducescatter"))
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
    op = resolve_op(op, None, "grouped_reducescatter")
    return submit_reducescatter(
        [as_array(t, "grouped_reducescatter") for t in tensors],
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
    packed = [compression.compress(as_array(t, "grouped_reducescatter")) for t in tensors]
    with waited():
        h = grouped_reducescatter_async(
            [p[0] for p in packed], name, op, process_set, prescale_factor, postscale_factor
        )
    return [compression.decompress(o, p[1]) for o, p in zip(synchronize(h), packed, strict=False)]


def join(device: int = -1) -> int:
    """This rank has no more data: it takes part in other ranks' allreduces with zeros until
    every rank has joined. Returns the rank that joined last (the same on every rank)."""
    ctx = require_context()
    return int(blocking(ctx, JOIN, "join.noname", 0))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached the barrier."""
    ctx = require_context()
    blocking(ctx, BARRIER, "barrier.noname", resolve_set(ctx, process_set, "barrier"))


def exchange_reduce(
    compressor: Any,
    tensors: Sequence[Any],
    name: str | None,
    op: int | None,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    what: str,
) -> list[np.ndarray]:
    """An allreduce through a lossy compressor's own exchange (``horovod.frontend.lossy``):
    its error-feedback state is kept per tensor under ``name`` (or the shapes, unnamed)."""
    op = resolve_op(op, average, what)
    arrays = [as_array(t, what) for t in tensors]
    if prescale_factor != 1.0:
        arrays = [a * prescale_factor for a in arrays]
    base = name or "unnamed." + "/".join(f"{a.shape}{a.dtype}" for a in arrays)
    keys = [f"{base}.{i}" for i in range(len(arrays))] if len(arrays) > 1 else [base]
    out = compressor.reduce(arrays, keys, op, process_set, name=f"{what}.{base}")
    if postscale_factor != 1.0:
        out = [o * postscale_factor for o in out]
    return out
