"""Collectives on torch tensors (upstream's ``horovod.torch.mpi_ops``).

The adapter turns tensors into NumPy views of the same memory (no copy for CPU tensors;
bfloat16 and bool through a same-size integer view), calls the framework-free frontend, and
turns results back into tensors with ``torch.from_numpy`` (again no copy). CUDA tensors go
through host memory until a GPU data plane exists. Collectives are differentiable with the
backward passes upstream defines.

The tensor adapter is ``adapter``, allreduce ``allreduce_ops``; this module has the other
collectives and is the public face of all of them (upstream's module name).

Must not touch: the engine (everything goes through ``horovod.frontend``).
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
    make_device_plane,
    poll,  # noqa: F401  (upstream's name here)
    sync_call,
    synchronize,
    to_numpy,
    write_back,
)
from horovod.torch.allreduce_ops import (  # noqa: F401  (upstream's names here)
    HorovodAllreduce,
    HorovodGroupedAllreduce,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    allreduce_batch_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product

# Upstream's ``_basics`` object (user code calls ``_get_process_set_ids_and_ranks()`` on it).
_basics = F.BASICS


def _gather_finish(like: Sequence[torch.Tensor], grouped: bool):
    def finish(results: list) -> Any:
        outs = [from_numpy(r, t) for r, t in zip(results, like, strict=True)]
        return outs if grouped else outs[0]

    return finish


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    a = to_numpy(check_tensor(tensor, "allgather"))
    return F.submit_allgather(
        [a],
        name=name,
        process_set=process_set,
        grouped=False,
        device=device_of(tensor),
        finish=_gather_finish([tensor], False),
    )


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    arrays = [to_numpy(check_tensor(t, "grouped_allgather")) for t in tensors]
    return F.submit_allgather(
        arrays,
        name=name,
        process_set=process_set,
        grouped=True,
        device=device_of(tensors[0]) if tensors else -1,
        finish=_gather_finish(tensors, True),
    )


class HorovodAllgather(torch.autograd.Function):
    """Backward: average-allreduce of the gradient, then this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):  # type: ignore[override]
        ctx.dim0 = tensor.shape[0]
        ctx.process_set = process_set
        return sync_call(allgather_async, tensor, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _allgather_grads(ctx.process_set, [grad], [ctx.dim0])[0], None, None


def _allgather_grads(
    ps: ProcessSet, grads: Sequence[torch.Tensor], dim0s: Sequence[int]
) -> list[torch.Tensor]:
    """Upstream's allgather backward: average the output gradient over the ranks, then keep
    the rows this rank contributed."""
    averaged = sync_call(
        grouped_allreduce_async, [g.contiguous() for g in grads], op=Average, process_set=ps
    )
    dims = sync_call(allgather_async, torch.tensor([list(dim0s)]), process_set=ps).tolist()
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
            sync_call(grouped_allgather_async, list(tensors), name=name, process_set=process_set)
        )

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, *_allgather_grads(ctx.process_set, grads, ctx.dim0s))


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0, in rank order (differentiable)."""
    if is_plain(tensor):
        got = F.express(F.ALLGATHER, "allgather.", name, to_numpy(tensor), None, process_set)
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


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    out = torch.empty_like(check_tensor(tensor, "broadcast"))
    a, o = to_numpy(tensor), inplace_view(out)

    def finish(results: list) -> torch.Tensor:
        write_back(out, o)
        return out

    return F.submit_broadcast(
        a, o, root_rank, name=name, process_set=process_set, device=device_of(tensor), finish=finish
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    a = to_numpy(check_tensor(tensor, "broadcast_"))

    def finish(results: list) -> torch.Tensor:
        write_back(tensor, a)
        return tensor

    return F.submit_broadcast(
        a, a, root_rank, name=name, process_set=process_set, device=device_of(tensor), finish=finish
    )


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    if is_plain(tensor, grad_ok=True):
        a = to_numpy(tensor)
        got = F.express(F.BROADCAST, "broadcast.", name, a, a, process_set, F.Sum, root_rank)
        if got is not F.NOT_EXPRESS:
            return tensor
    return sync_call(broadcast_async_, tensor, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    """Backward: average-allreduce of the gradient, kept on the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return sync_call(broadcast_async, tensor, root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = sync_call(allreduce_async, grad.contiguous(), op=Average, process_set=ctx.process_set)
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
    if is_plain(tensor):
        a = to_numpy(tensor)
        got = F.express(F.BROADCAST, "broadcast.", name, a, None, process_set, F.Sum, root_rank)
        if got is not F.NOT_EXPRESS:
            return from_numpy(got)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    a = to_numpy(check_tensor(tensor, "alltoall"))
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
        a, sp, name=name, process_set=process_set, device=device_of(tensor), finish=finish
    )


class HorovodAlltoall(torch.autograd.Function):
    """Backward: alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):  # type: ignore[override]
        out, received = sync_call(
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
        out, _ = sync_call(
            alltoall_async, grad.contiguous(), ctx.received, process_set=ctx.process_set
        )
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


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    op = F.resolve_op(op, None, "reducescatter")
    return F.submit_reducescatter(
        [to_numpy(check_tensor(tensor, "reducescatter"))],
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=False,
        device=device_of(tensor),
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
    op = F.resolve_op(op, None, "grouped_reducescatter")
    arrays = [to_numpy(check_tensor(t, "grouped_reducescatter")) for t in tensors]
    return F.submit_reducescatter(
        arrays,
        name=name,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        grouped=True,
        device=device_of(tensors[0]) if tensors else -1,
        finish=_gather_finish(tensors, True),
    )


class HorovodReducescatter(torch.autograd.Function):
    """Backward: allgather of the gradient (times the set size for Sum), scaled alike."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):  # type: ignore[override]
        ctx.args = (op, process_set, pre, post)
        return sync_call(
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
    gathered = sync_call(grouped_allgather_async, [g.contiguous() for g in grads], process_set=ps)
    n = ps.size() if ps is not global_process_set else F.size()
    factor = (n if op == Sum else 1) * pre * post
    return [g * factor for g in gathered]


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):  # type: ignore[override]
        ctx.args = (op, process_set, pre, post)
        return tuple(
            sync_call(grouped_reducescatter_async, list(tensors), name, op, process_set, pre, post)
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


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Any:
    """Allreduce of a sparse COO tensor by allgathering its indices and values; returns a
    callable that waits and returns the sum (coalesced: one entry per index, as optimizers such
    as SparseAdam expect), divided by the set size for Average."""
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
        out = torch.sparse_coo_tensor(indices.t(), values, t.shape, check_invariants=True)
        return out.coalesce()

    return handle


def join(device: int = -1) -> int:
    # A joined rank contributes zeros to the others' allreduces, device ones included.
    F.use_device_plane(make_device_plane)
    return F.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    F.barrier(process_set)


def is_homogeneous() -> bool:
    return F.is_homogeneous()
