"""Registering and removing process sets while the job runs (``hvd.init(process_sets="dynamic")``).

Must not touch: the engine's set table (changes are collective ops the engine applies).
"""

from __future__ import annotations

from collections.abc import Sequence

from horovod.common.process_sets import ProcessSet
from horovod.core.messages import (
    PROCESS_SET_ADD,
    PROCESS_SET_REMOVE,
)
from horovod.frontend.arguments import require_context
from horovod.frontend.submission import blocking


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after init (needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or
    ``init(process_sets="dynamic")``). Every rank must call it, in the same order."""
    ctx = require_context()
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
    new_id = blocking(
        ctx, PROCESS_SET_ADD, f"process_set.add.{ctx.op_counters['ps']}", 0, tuple(ps.ranks)
    )
    ps.process_set_id = int(new_id)
    ctx.public_sets[ps.process_set_id] = ps
    ctx.op_counters.pop(f"noname.{new_id}", None)  # ids are reused: restart its auto-names
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a dynamic process set on every rank; False for the global or an unregistered
    set."""
    ctx = require_context()
    if not ctx.config.dynamic_process_sets:
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets "
            "after Horovod initialization."
        )
    ps_id = process_set.process_set_id
    if ps_id in (None, 0) or ctx.public_sets.get(ps_id) is not process_set:
        return False
    ctx.op_counters["ps"] += 1
    blocking(ctx, PROCESS_SET_REMOVE, f"process_set.remove.{ctx.op_counters['ps']}", 0, ps_id)
    ctx.public_sets.pop(ps_id, None)
    process_set.process_set_id = None
    return True
