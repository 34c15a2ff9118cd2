"""Collectives of picklable Python objects (``broadcast_object``, ``allgather_object``), built on
the array collectives with cloudpickle.

Must not touch: the engine (it uses the NumPy API of ``collectives``).
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import numpy as np

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend.arguments import require_context
from horovod.frontend.collectives import allgather, broadcast_


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``obj`` on every rank (serialised with cloudpickle)."""
    ctx = require_context()
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
