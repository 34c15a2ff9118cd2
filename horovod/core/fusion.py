"""Tensor Fusion's rules: which responses may share one fused buffer, and merging them into one.

Used by the coordinator's fusion planning and by plane rounds, so both fuse alike. Pure
functions of responses; nothing here knows ranks, transports or buffers.

Must not touch: buffers (it plans; the executor and ``ops`` copy).
"""

from __future__ import annotations

from horovod.core.messages import (
    Response,
)


def merge(parts: list[Response]) -> Response:
    if len(parts) == 1:
        return parts[0]
    head = parts[0]
    merged = Response.from_wire(head.wire())
    merged.names = [n for p in parts for n in p.names]
    merged.shapes = [s for p in parts for s in p.shapes]
    if head.dim0s is not None:
        merged.dim0s = [d for p in parts for d in (p.dim0s or [])]
    return merged


def fusible(head: Response, r: Response, disable_group_fusion: bool) -> bool:
    """Whether ``r`` may share a fused buffer with ``head`` (``disable_group_fusion``:
    ``HOROVOD_DISABLE_GROUP_FUSION``, only ops of one group fuse with each other)."""
    return (
        r.op == head.op
        and r.ps_id == head.ps_id
        and r.dtype == head.dtype
        and r.reduce_op == head.reduce_op
        and r.prescale == head.prescale
        and r.postscale == head.postscale
        and r.joined == head.joined
        and r.device == head.device
        and not r.error
        and (not disable_group_fusion or r.group == head.group)
    )
