"""Allreduce on torch tensors: the plain, in-place, batched and grouped forms, their
asynchronous variants and their autograd functions (the backward of an allreduce is an
allreduce of the gradient with the same op and scaling).

Must not touch: other collectives (``mpi_ops``), optimizers (``optimizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.adapter import (
    check_tensor,
    device_of,
    from_numpy,
    inplace_view,
    is_plain,
    sync_call,
    to_numpy,
    write_back,
)

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product


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
    ins = [to_numpy(check_tensor(t, what)) for t in tensors]
    # in place: hand the engine the very same array, so no copy is made
    outs = [a if o is t else inplace_view(o) for a, t, o in zip(ins, tensors, outputs, strict=True)]
    devices = {device_of(t) for t in tensors}
    if len(devices) > 1:
        raise ValueError("Tensors in list must be on same device.")

    def finish(results: list) -> Any:
        for o, v in zip(outputs, outs, strict=True):
            write_back(o, v)
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
    op = F.resolve_op(op, average, "allreduce")
    out = torch.empty_like(check_tensor(tensor, "allreduce"))
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
    op = F.resolve_op(op, average, "allreduce_")
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
    arrays = [to_numpy(check_tensor(t, "allreduce_")) for t in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        for t, a in zip(tensors, arrays, strict=True):
            write_back(t, a)
        return list(tensors)

    return F.submit_allreduce_batch(
        arrays,
        names,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        device=device_of(tensors[0]) if tensors else -1,
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
    if is_plain(tensor, grad_ok=True):
        a = to_numpy(tensor)
        got = F.express_allreduce(
            name, a, a, op, average, prescale_factor, postscale_factor, process_set
        )
        if got is not F.NOT_EXPRESS:
            return tensor
    return sync_call(
        allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )


class HorovodAllreduce(torch.autograd.Function):
    """Backward: allreduce of the gradient with the same op, scaling and process set."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return sync_call(
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
        out = sync_call(
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
    if getattr(compression, "exchange", False):
        (out,) = F.exchange_reduce(
            compression,
            [to_numpy(tensor.detach())],
            name,
            op,
            average,
            prescale_factor,
            postscale_factor,
            process_set,
            "allreduce",
        )
        return from_numpy(out).to(tensor.dtype)
    if compression is Compression.none and is_plain(tensor):
        got = F.express_allreduce(
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
    op = F.resolve_op(op, average, "allreduce")
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
    op = F.resolve_op(op, average, "grouped_allreduce")
    outs = [torch.empty_like(check_tensor(t, "grouped_allreduce")) for t in tensors]
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
    op = F.resolve_op(op, average, "grouped_allreduce_")
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
    return sync_call(
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
            sync_call(
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
        outs = sync_call(
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
    if getattr(compression, "exchange", False):
        outs = F.exchange_reduce(
            compression,
            [to_numpy(t.detach()) for t in tensors],
            name,
            op,
            average,
            prescale_factor,
            postscale_factor,
            process_set,
            "grouped_allreduce",
        )
        return [from_numpy(o).to(t.dtype) for o, t in zip(outs, tensors, strict=True)]
    op = F.resolve_op(op, average, "grouped_allreduce")
    packed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(
        name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in packed]
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed, strict=True)]
