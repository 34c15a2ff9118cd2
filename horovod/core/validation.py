"""Validation of cross-rank requests: do the ranks that submitted one name agree?

Compares every rank's request with the first (collective, dtype, shape or row shape, reduce
op, scale factors, root, device, process-set arguments) and turns the first disagreement into
an error response naming the tensor, both ranks, both values, where each called it, and the
fix. Also checks what no rank may do alone (collectives needing data while ranks have joined,
scalars where a dimension is needed). Pure: it reads requests and process sets, never changes
the coordinator's state.

Must not touch: the coordinator's tables (it only reads requests and returns an error text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from horovod.common.dtypes import NAME_OF_CODE
from horovod.core.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    CPU_DEVICE,
    ERROR,
    OP_NAMES,
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
    REDUCE_NAMES,
    REDUCESCATTER,
    WRONG_DEVICE_BASE,
    Request,
    Response,
    display_name,
    wrong_device,
)
from horovod.core.pending import Pending
from horovod.core.set_state import SetState

# Collectives that need every rank's data: refused while ranks of the global set have joined.
REFUSED_WHILE_JOINED = frozenset((ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER))


def fmt_shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape)).replace(",)", ")")


def validate(
    ss: SetState,
    name: str,
    p: Pending,
    joined: tuple[int, ...],
    sets: Mapping[int, SetState],
) -> Response:

    reqs = sorted(p.reqs.items())
    r0, q0 = reqs[0]
    what = display_name(q0.op, name)

    def err(text: str) -> Response:
        return Response(ERROR, ss.id, [name], error=text)

    def at(q: Request) -> str:
        return f" ({q.site})" if q.site else ""

    def mismatch(field: str, a: object, r: int, b: object, fix: str) -> Response:
        q = p.reqs[r]
        return err(f"{what}: {field} {a} on rank {r0}{at(q0)} but {b} on rank {r}{at(q)}; {fix}")

    for r, q in reqs[1:]:
        if q.op != q0.op:
            return err(
                f"tensor '{name}': rank {r0} called {OP_NAMES.get(q0.op)}{at(q0)} but rank {r} "
                f"called {OP_NAMES.get(q.op)}{at(q)}; every rank must call the same collective "
                "for the same name"
            )
    op = q0.op
    for r, q in reqs:
        if q.device <= WRONG_DEVICE_BASE:
            index, expected = wrong_device(q.device)
            return err(
                f"{what}: rank {r}{at(q)} has the tensor on GPU {index}, but that rank's "
                f"device plane works on GPU {expected} (its local rank modulo the GPUs it "
                "sees); call torch.cuda.set_device(hvd.local_rank()) before creating tensors, "
                "or give each rank one GPU with CUDA_VISIBLE_DEVICES"
            )
    for r, q in reqs[1:]:
        if q.dtype != q0.dtype:
            return mismatch(
                "dtype",
                NAME_OF_CODE[q0.dtype],
                r,
                NAME_OF_CODE[q.dtype],
                "every rank must submit the same dtype",
            )
        if op in (ALLREDUCE, BROADCAST, REDUCESCATTER) and q.shape != q0.shape:
            return mismatch(
                "shape",
                fmt_shape(q0.shape),
                r,
                fmt_shape(q.shape),
                "every rank must submit the same shape",
            )
        if op in (ALLGATHER, ALLTOALL):
            if len(q.shape) != len(q0.shape):
                return mismatch(
                    "number of dimensions",
                    len(q0.shape),
                    r,
                    len(q.shape),
                    "every rank must submit tensors of the same rank",
                )
            if q.shape[1:] != q0.shape[1:]:
                return mismatch(
                    "shape",
                    fmt_shape(q0.shape),
                    r,
                    fmt_shape(q.shape),
                    "only the first dimension may differ between ranks",
                )
        if q.reduce_op != q0.reduce_op and op in (ALLREDUCE, REDUCESCATTER):
            return mismatch(
                "reduce op",
                REDUCE_NAMES.get(q0.reduce_op),
                r,
                REDUCE_NAMES.get(q.reduce_op),
                "every rank must pass the same op=",
            )
        if (q.prescale, q.postscale) != (q0.prescale, q0.postscale):
            return mismatch(
                "(prescale_factor, postscale_factor)",
                (q0.prescale, q0.postscale),
                r,
                (q.prescale, q.postscale),
                "every rank must pass the same factors",
            )
        if op == BROADCAST and q.root != q0.root:
            return mismatch(
                "root_rank", q0.root, r, q.root, "every rank must pass the same root_rank"
            )
        if q.device != q0.device:
            return mismatch(
                "device",
                "CPU" if q0.device == CPU_DEVICE else "GPU",
                r,
                "CPU" if q.device == CPU_DEVICE else "GPU",
                "every rank must keep this tensor on the same kind of device",
            )
        if q.extra != q0.extra:
            return mismatch(
                "argument",
                q0.extra,
                r,
                q.extra,
                "every rank must pass the same arguments, in the same order",
            )
    if joined and op in REFUSED_WHILE_JOINED:
        return err(
            f"{what}: not possible while ranks {list(joined)} have called join(); only "
            "allreduce and barrier run with joined ranks"
        )
    if op in (ALLGATHER, ALLTOALL, REDUCESCATTER) and len(q0.shape) == 0:
        return err(f"{what}: needs a tensor with at least one dimension, got a scalar")
    if op == PROCESS_SET_ADD:
        ranks = tuple(cast(Sequence[int], q0.extra))
        for other in sets.values():
            if tuple(other.ranks) == ranks:
                return err(
                    f"add_process_set: a process set with ranks {list(ranks)} already "
                    f"exists (id {other.id})"
                )
        # The coordinator gives the new set its id (``extra``: the id, the ranks).
        return Response(PROCESS_SET_ADD, 0, [name], extra=(None, list(ranks)))
    if op == PROCESS_SET_REMOVE:
        ps_id = cast(int, q0.extra)
        if ps_id == 0 or ps_id not in sets:
            return err(f"remove_process_set: process set {ps_id} does not exist")
        return Response(PROCESS_SET_REMOVE, 0, [name], extra=ps_id)
    resp = Response(
        op,
        ss.id,
        [name],
        q0.dtype,
        [q0.shape],
        q0.reduce_op,
        q0.root,
        q0.prescale,
        q0.postscale,
        joined=joined,
        group=q0.group,
        device=q0.device,
    )
    if op == ALLGATHER:
        by_rank = dict(reqs)
        resp.dim0s = [[by_rank[r].shape[0] for r in ss.ranks]]
    if op == BARRIER:
        resp.shapes = [()]
    return resp
