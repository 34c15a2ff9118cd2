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
    if ps.mpi_comm is not None:
        if ctx.mpi is None:
            raise ValueError(
                "add_process_set(ProcessSet(comm)) needs an MPI job (mpirun or horovodrun "
                "--mpi); pass a list of ranks instead"
            )
        ps.translate_to(ctx.mpi.group)
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


def get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered process set's id and ranks (the global set is id 0)."""
    ctx = require_context()
    return {ps_id: list(ps.ranks) for ps_id, ps in sorted(ctx.public_sets.items())}


def comm_process_set_id(comm: object) -> int:
    """The id of the registered process set whose processes are those of mpi4py
    communicator ``comm`` (0 for a communicator of the whole job)."""
    ctx = require_context()
    if ctx.mpi is None:
        raise ValueError("comm_process_set_id needs an MPI job (mpirun or horovodrun --mpi)")
    probe = ProcessSet(comm)
    probe.translate_to(ctx.mpi.group)
    for ps_id, ranks in get_process_set_ids_and_ranks().items():
        if list(ranks) == probe.ranks:
            return ps_id
    raise ValueError(
        f"no registered process set has the ranks of this communicator ({probe.ranks}); "
        "register one with hvd.init(process_sets=[...]) or hvd.add_process_set"
    )
