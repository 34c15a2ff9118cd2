"""Collectives on torch tensors (upstream's ``horovod.torch.mpi_ops``).

The adapter turns tensors into NumPy views of the same memory (no copy for CPU tensors;
bfloat16 and bool through a same-size integer view), calls the framework-free frontend, and
turns results back into tensors with ``torch.from_numpy`` (again no copy). CUDA tensors go
through host memory until a GPU data plane exists. Collectives are differentiable with the
backward passes upstream defines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from horovod import frontend as F
from horovod.common.dtypes import BFLOAT16
from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import ProcessSet, global_process_set

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product

_SUPPORTED = {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
}


# ------------------------------------------------------------------------------ tensor adapter
def _device(t: torch.Tensor) -> int:
    return t.device.index or 0 if t.device.type == "cuda" else -1


def _check(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED:
        raise ValueError(
            f"Tensor type {t.type()} is not supported ({what}); use one of "
            "uint8, int8, int16, int32, int64, float16, bfloat16, float32, "
            "float64, bool"
        )
    if t.is_sparse or not t.is_contiguous():
        raise ValueError(f"Tensor is required to be contiguous ({what}); call .contiguous()")
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (a host copy for CUDA tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[arg-type]
    return t.numpy()


def from_numpy(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(a)
    if like is not None and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def _write_back(dst: torch.Tensor, src_view: np.ndarray) -> None:
    """After an in-place op on a CUDA tensor's host copy, copy the result to the device."""
    if dst.device.type != "cpu":
        dst.copy_(from_numpy(src_view))


def _inplace_view(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t)


def _plain(t: Any, grad_ok: bool = False) -> bool:
    """May a synchronous call on ``t`` try the express way (``Engine.express``): a contiguous
    dense CPU tensor of a supported dtype, and (unless ``grad_ok``, for the in-place calls)
    no autograd graph to record? Anything else goes the usual way, with its checks."""
    return (
        type(t) is torch.Tensor
        and (grad_ok or not t.requires_grad)
        and t.device.type == "cpu"
        and t.dtype in _SUPPORTED
        and t.layout is torch.strided
        and t.is_contiguous()
    )


# ------------------------------------------------------------------------------ handles
def poll(handle: int) -> bool:
    return F.poll(handle)


def _sync(submit: Any, *args: Any, **kwargs: Any) -> Any:
    """``synchronize(submit(*args, **kwargs))``, telling the engine that this thread waits
    at once (it runs the engine itself instead of waking the engine thread)."""
    with F.waited():
        handle = submit(*args, **kwargs)
    return synchronize(handle)


def synchronize(handle: int) -> Any:
    try:
        return F.synchronize(handle)
    except HorovodInternalError:
        raise
    except RuntimeError as e:  # pragma: no cover - defensive
        raise HorovodInternalError(e) from None


# ------------------------------------------------------------------------------ allreduce
def _allreduce_async(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    grouped: bool,
    what: str,
) -> int:
    ins = [to_numpy(_check(t, what)) for t in tensors]
    # in place: hand the engine the very same array, so no copy is made
    outs = [
        a if o is t else _inplace_view(o) for a, t, o in zip(ins, tensors, outputs, strict=True)
    ]
    devices = {_device(t) for t in tensors}
    if len(devices) > 1:
        raise ValueError("Tensors in list must be on same device.")

    def finish(results: list) -> Any:
        for o, v in zip(outputs, outs, strict=True):
            _write_back(o, v)
        return list(outputs) if grouped else outputs[0]

    return F.submit_allreduce(
        ins,
        outs,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=grouped,
        device=devices.pop() if devices else -1,
        finish=finish,
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = F._reduce_op(op, average, "allreduce")
    out = torch.empty_like(_check(tensor, "allreduce"))
    return _allreduce_async(
        [tensor],
        [out],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
        what="allreduce",
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = F._reduce_op(op, average, "allreduce_")
    return _allreduce_async(
        [tensor],
        [tensor],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
        what="allreduce_",
    )


def allreduce_batch_async_(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    op: int,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place allreduces of several tensors, each under its own name, in one submission
    (used by DistributedOptimizer to amortise per-tensor overhead)."""
    arrays = [to_numpy(_check(t, "allreduce_")) for t in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        for t, a in zip(tensors, arrays, strict=True):
            _write_back(t, a)
        return list(tensors)

    return F.submit_allreduce_batch(
        arrays,
        names,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        device=_device(tensors[0]) if tensors else -1,
        finish=finish,
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    if _plain(tensor, grad_ok=True):
        a = to_numpy(tensor)
        got = F._express_allreduce(
            name, a, a, op, average, prescale_factor, postscale_factor, process_set
        )
        if got is not F.NOT_EXPRESS:
            return tensor
    return _sync(
        allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )


class HorovodAllreduce(torch.autograd.Function):
    """Backward: allreduce of the gradient with the same op, scaling and process set."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _sync(
            allreduce_async,
            tensor,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        op, pre, post, ps = ctx.args
        out = _sync(
            allreduce_async,
            grad.contiguous(),
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=ps,
        )
        return out, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the ranks of ``process_set`` (differentiable)."""
    from horovod.torch.compression import Compression

    compression = compression or Compression.none
    if compression is Compression.none and _plain(tensor):
        got = F._express_allreduce(
            name,
            to_numpy(tensor),
            None,
            op,
            average,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        if got is not F.NOT_EXPRESS:
            return from_numpy(got)
    op = F._reduce_op(op, average, "allreduce")
    compressed, cctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(
        compressed, name, op, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(out, cctx)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = F._reduce_op(op, average, "grouped_allreduce")
    outs = [torch.empty_like(_check(t, "grouped_allreduce")) for t in tensors]
    return _allreduce_async(
        tensors,
        outs,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        what="grouped_allreduce",
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    op = F._reduce_op(op, average, "grouped_allreduce_")
    return _allreduce_async(
        tensors,
        tensors,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        what="grouped_allreduce_",
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    return _sync(
        grouped_allreduce_async_,
        tensors,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):  # type: ignore[override]
        ctx.args = (op, pre, post, process_set)
        return tuple(
            _sync(
                grouped_allreduce_async,
                list(tensors),
                name=name,
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )
        )

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        op, pre, post, ps = ctx.args
        outs = _sync(
            grouped_allreduce_async,
            [g.contiguous() for g in grads],
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=ps,
        )
        return (None, None, None, None, None, *outs)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    from horovod.torch.compression import Compression

    compression = compression or Compression.none
    op = F._reduce_op(op, average, "grouped_allreduce")
    packed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(
        name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in packed]
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed, strict=True)]


# ------------------------------------------------------------------------------ allgather
def _gather_finish(like: Sequence[torch.Tensor], grouped: bool):
    def finish(results: list) -> Any:
        outs = [from_numpy(r, t) for r, t in zip(results, like, strict=True)]
        return outs if grouped else outs[0]

    return finish


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    a = to_numpy(_check(tensor, "allgather"))
    return F.submit_allgather(
        [a],
        name=name,
        process_set=process_set,
        grouped=False,
        device=_device(tensor),
        finish=_gather_finish([tensor], False),
    )


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    arrays = [to_numpy(_check(t, "grouped_allgather")) for t in tensors]
    return F.submit_allgather(
        arrays,
        name=name,
        process_set=process_set,
        grouped=True,
        device=_device(tensors[0]) if tensors else -1,
        finish=_gather_finish(tensors, True),
    )


class HorovodAllgather(torch.autograd.Function):
    """Backward: average-allreduce of the gradient, then this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):  # type: ignore[override]
        ctx.dim0 = tensor.shape[0]
        ctx.process_set = process_set
        return _sync(allgather_async, tensor, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _allgather_grads(ctx.process_set, [grad], [ctx.dim0])[0], None, None


def _allgather_grads(
    ps: ProcessSet, grads: Sequence[torch.Tensor], dim0s: Sequence[int]
) -> list[torch.Tensor]:
    """Upstream's allgather backward: average the output gradient over the ranks, then keep
    the rows this rank contributed."""
    averaged = _sync(
        grouped_allreduce_async, [g.contiguous() for g in grads], op=Average, process_set=ps
    )
    dims = _sync(allgather_async, torch.tensor([list(dim0s)]), process_set=ps).tolist()
    me = ps.rank() if ps is not global_process_set else F.rank()
    out = []
    for i, g in enumerate(averaged):
        start = sum(d[i] for d in dims[:me])
        out.append(g[start : start + dims[me][i]])
    return out


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):  # type: ignore[override]
        ctx.dim0s, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(
            _sync(grouped_allgather_async, list(tensors), name=name, process_set=process_set)
        )

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, *_allgather_grads(ctx.process_set, grads, ctx.dim0s))


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0, in rank order (differentiable)."""
    if _plain(tensor):
        got = F._express(F.ALLGATHER, "allgather.", name, to_numpy(tensor), None, process_set)
        if got is not F.NOT_EXPRESS:
            return from_numpy(got)
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather of several tensors in one submission (differentiable)."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ------------------------------------------------------------------------------ broadcast
def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    out = torch.empty_like(_check(tensor, "broadcast"))
    a, o = to_numpy(tensor), _inplace_view(out)

    def finish(results: list) -> torch.Tensor:
        _write_back(out, o)
        return out

    return F.submit_broadcast(
        a, o, root_rank, name=name, process_set=process_set, device=_device(tensor), finish=finish
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    a = to_numpy(_check(tensor, "broadcast_"))

    def finish(results: list) -> torch.Tensor:
        _write_back(tensor, a)
        return tensor

    return F.submit_broadcast(
        a, a, root_rank, name=name, process_set=process_set, device=_device(tensor), finish=finish
    )


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    if _plain(tensor, grad_ok=True):
        a = to_numpy(tensor)
        got = F._express(F.BROADCAST, "broadcast.", name, a, a, process_set, F.Sum, root_rank)
        if got is not F.NOT_EXPRESS:
            return tensor
    return _sync(broadcast_async_, tensor, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    """Backward: average-allreduce of the gradient, kept on the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _sync(broadcast_async, tensor, root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = _sync(allreduce_async, grad.contiguous(), op=Average, process_set=ctx.process_set)
        if F.rank() != ctx.root_rank:
            out = out * 0
        return out, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s tensor on every rank, as a new tensor (differentiable)."""
    if _plain(tensor):
        a = to_numpy(tensor)
        got = F._express(F.BROADCAST, "broadcast.", name, a, None, process_set, F.Sum, root_rank)
        if got is not F.NOT_EXPRESS:
            return from_numpy(got)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ------------------------------------------------------------------------------ alltoall
def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    a = to_numpy(_check(tensor, "alltoall"))
    sp = splits
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        if splits.dim() != 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        sp = splits.cpu().numpy()
    with_splits = splits is not None

    def finish(results: list) -> Any:
        out, received = results[0]
        t = from_numpy(out, tensor)
        return (t, torch.from_numpy(received)) if with_splits else t

    return F.submit_alltoall(
        a, sp, name=name, process_set=process_set, device=_device(tensor), finish=finish
    )


class HorovodAlltoall(torch.autograd.Function):
    """Backward: alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):  # type: ignore[override]
        out, received = _sync(
            alltoall_async,
            tensor,
            splits if splits is not None else _even_splits(tensor, process_set),
            name=name,
            process_set=process_set,
        )
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):  # type: ignore[override]
        out, _ = _sync(alltoall_async, grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return out, None, None, None


def _even_splits(tensor: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    n = process_set.size() if process_set is not global_process_set else F.size()
    assert n is not None
    if tensor.shape[0] % n:
        raise ValueError(
            "splits not provided, but first dimension of tensor is not an even "
            f"multiple of the number of workers ({tensor.shape[0]} rows, {n} ranks)"
        )
    return torch.full((n,), tensor.shape[0] // n, dtype=torch.int32)


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Rows ``splits[i]`` go to rank i; returns the output, or ``(output, received_splits)``
    when ``splits`` is given (differentiable)."""
    if splits is not None and not isinstance(splits, torch.Tensor):
        splits = torch.tensor(splits, dtype=torch.int32)
    out, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return (out, received) if splits is not None else out


# ------------------------------------------------------------------------------ reducescatter
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    op = F._reduce_op(op, None, "reducescatter")
    return F.submit_reducescatter(
        [to_numpy(_check(tensor, "reducescatter"))],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
        device=_device(tensor),
        finish=_gather_finish([tensor], False),
    )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    op = F._reduce_op(op, None, "grouped_reducescatter")
    arrays = [to_numpy(_check(t, "grouped_reducescatter")) for t in tensors]
    return F.submit_reducescatter(
        arrays,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        device=_device(tensors[0]) if tensors else -1,
        finish=_gather_finish(tensors, True),
    )


class HorovodReducescatter(torch.autograd.Function):
    """Backward: allgather of the gradient (times the set size for Sum), scaled alike."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):  # type: ignore[override]
        ctx.args = (op, process_set, pre, post)
        return _sync(
            reducescatter_async,
            tensor,
            name=name,
            op=op,
            process_set=process_set,
            prescale_factor=pre,
            postscale_factor=post,
        )

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reducescatter_grads(ctx.args, [grad])[0], None, None, None, None, None


def _reducescatter_grads(args: tuple, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream's reducescatter backward: allgather the gradient, times the set size for Sum,
    times the scale factors."""
    op, ps, pre, post = args
    gathered = _sync(grouped_allgather_async, [g.contiguous() for g in grads], process_set=ps)
    n = ps.size() if ps is not global_process_set else F.size()
    factor = (n if op == Sum else 1) * pre * post
    return [g * factor for g in gathered]


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):  # type: ignore[override]
        ctx.args = (op, process_set, pre, post)
        return tuple(
            _sync(grouped_reducescatter_async, list(tensors), name, op, process_set, pre, post)
        )

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None, None, None, *_reducescatter_grads(ctx.args, grads))


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    from horovod.torch.compression import Compression

    compression = compression or Compression.none
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(
        compressed, name, op, process_set, prescale_factor, postscale_factor
    )
    return compression.decompress(out, cctx)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    from horovod.torch.compression import Compression

    compression = compression or Compression.none
    packed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[p[0] for p in packed]
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed, strict=True)]


# ------------------------------------------------------------------------------ sparse
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Any:
    """Allreduce of a sparse COO tensor by allgathering its indices and values; returns a
    callable that waits and returns the (uncoalesced) sum, divided by the set size for Average."""
    t = tensor.coalesce()
    h_idx = allgather_async(
        t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set
    )
    h_val = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        indices = synchronize(h_idx)
        values = synchronize(h_val)
        if op == Average:
            n = process_set.size() if process_set is not global_process_set else F.size()
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, t.shape, check_invariants=True)

    return handle


# ------------------------------------------------------------------------------ misc
def join(device: int = -1) -> int:
    return F.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    F.barrier(process_set)


def is_homogeneous() -> bool:
    return F.is_homogeneous()
