"""MXNet collectives on pyhorovod's engine (upstream's ``horovod.mxnet.mpi_ops``).

An ``NDArray`` goes to the engine as the NumPy copy ``asnumpy()`` makes (which also waits for
MXNet's asynchronous engine to finish writing it); results come back as NDArrays of the same
dtype on the same context, and the in-place forms (``allreduce_``, ``broadcast_``, ...) write
into the given array. ``priority`` is accepted for upstream's signature: the engine orders
collectives itself.

Must not touch: the engine's internals (it submits through ``horovod.frontend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product


def _array(tensor: Any, what: str) -> np.ndarray:
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what}: expected an mxnet.nd.NDArray, got {type(tensor).__name__}")
    return tensor.asnumpy()


def _like(result: np.ndarray, tensor: Any) -> Any:
    return mx.nd.array(result, dtype=tensor.dtype, ctx=tensor.context)


def _write(tensor: Any, result: np.ndarray) -> Any:
    tensor[:] = result
    return tensor


def _reduced(
    tensors: Sequence[Any],
    what: str,
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> list[np.ndarray]:
    """The allreduce every form here runs (NumPy results): one tensor's under its own name,
    several as a group."""
    kw = dict(
        average=average,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )
    arrays = [_array(t, what) for t in tensors]
    if what.startswith("grouped"):
        return F.grouped_allreduce(arrays, **kw)  # type: ignore[arg-type]
    return [F.allreduce(arrays[0], **kw)]  # type: ignore[arg-type]


def allreduce(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> Any:
    """A new NDArray: ``tensor`` reduced over the ranks (Average by default)."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    return _like(_reduced([tensor], "allreduce", *args)[0], tensor)


def allreduce_(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> Any:
    """``allreduce`` written into ``tensor``; returns it."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    return _write(tensor, _reduced([tensor], "allreduce_", *args)[0])


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> list[Any]:
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    outs = _reduced(tensors, "grouped_allreduce", *args)
    return [_like(o, t) for o, t in zip(outs, tensors, strict=True)]


def grouped_allreduce_(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> list[Any]:
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    outs = _reduced(tensors, "grouped_allreduce_", *args)
    return [_write(t, o) for o, t in zip(outs, tensors, strict=True)]


def allgather(
    tensor: Any,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    out = F.allgather(_array(tensor, "allgather"), name=name, process_set=process_set)
    return _like(out, tensor)


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    outs = F.grouped_allgather(
        [_array(t, "grouped_allgather") for t in tensors], name=name, process_set=process_set
    )
    return [_like(o, t) for o, t in zip(outs, tensors, strict=True)]


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """A new NDArray with ``root_rank``'s ``tensor``."""
    out = F.broadcast(_array(tensor, "broadcast"), root_rank, name=name, process_set=process_set)
    return _like(out, tensor)


def broadcast_(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``tensor`` written into ``tensor`` on every rank; returns it."""
    out = F.broadcast(_array(tensor, "broadcast_"), root_rank, name=name, process_set=process_set)
    return _write(tensor, out)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows (even by default) to rank i; the rows received, in rank order.
    With ``splits``, also the received splits (an int32 NDArray), as the other frontends."""
    if splits is not None:
        splits = splits.asnumpy() if isinstance(splits, mx.nd.NDArray) else splits
        splits = np.asarray(splits).tolist()
    got = F.alltoall(_array(tensor, "alltoall"), splits, name=name, process_set=process_set)
    if splits is None:
        return _like(got, tensor)
    out, received = got
    return _like(out, tensor), mx.nd.array(np.asarray(received), dtype="int32")


def reducescatter(
    tensor: Any,
    op: int = Average,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reduce over the ranks, then rank i gets the i-th block of rows."""
    out = F.reducescatter(
        _array(tensor, "reducescatter"),
        op=op,
        name=name,
        process_set=process_set,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    return _like(out, tensor)


def grouped_reducescatter(
    tensors: Sequence[Any],
    op: int = Average,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    outs = F.grouped_reducescatter(
        [_array(t, "grouped_reducescatter") for t in tensors],
        op=op,
        name=name,
        process_set=process_set,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    return [_like(o, t) for o, t in zip(outs, tensors, strict=True)]
