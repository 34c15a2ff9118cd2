"""Process sets: collectives over a subset of ranks (upstream's ``horovod.common.process_sets``).

Must not touch: the engine's set table (registration goes through the frontend's collective
ops).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def _no_context() -> Any:
    return None


# Set by horovod.core.context (a higher layer) at import: returns the current Context or None.
context_lookup: Callable[[], Any] = _no_context


def _current() -> Any:
    return context_lookup()


def is_communicator(obj: Any) -> bool:
    """Is ``obj`` an mpi4py communicator (told without importing mpi4py)?"""
    mod = type(obj).__module__ or ""
    return mod.startswith("mpi4py") and hasattr(obj, "Get_group")


def translate(comm: Any, group: Any) -> list[int]:
    """The ranks in ``group`` of ``comm``'s processes, in ``comm``'s order; ValueError where
    one is not in ``group``."""
    import sys

    MPI = sys.modules["mpi4py.MPI"]
    mine = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), group)
    finally:
        mine.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError(
            "ProcessSet(comm): the communicator holds processes that are not in Horovod's "
            "job; a process set's communicator must be part of the one hvd.init runs on"
        )
    return [int(r) for r in ranks]


def world_ranks(comm: Any) -> list[int]:
    import sys

    world = sys.modules["mpi4py.MPI"].COMM_WORLD.Get_group()
    try:
        return translate(comm, world)
    finally:
        world.Free()


class ProcessSet:
    """A subset of ranks. Register it with ``hvd.init(process_sets=[...])`` or, with dynamic
    process sets enabled, ``hvd.add_process_set(...)``; then pass it as ``process_set=``."""

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm = None
        if is_communicator(ranks_or_comm):
            # The communicator's ranks in MPI_COMM_WORLD; hvd.init translates them to the
            # job's ranks when it runs on another communicator.
            self.mpi_comm = ranks_or_comm
            ranks = world_ranks(ranks_or_comm)
        else:
            try:
                ranks = list(ranks_or_comm)
            except TypeError:
                ranks = None
        if ranks is None or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks (ints) or an "
                f"mpi4py communicator, not {ranks_or_comm!r}"
            )
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        if any(r < 0 for r in ranks):
            raise ValueError(f"ProcessSet ranks must be >= 0, got {ranks}")
        self._ranks = sorted(ranks)

    @property
    def ranks(self) -> list[int]:
        return self._ranks

    def translate_to(self, group: Any) -> None:
        """A set made from a communicator: its ranks become those in ``group`` (the group of
        the communicator Horovod runs on)."""
        if self.mpi_comm is not None:
            self._ranks = sorted(translate(self.mpi_comm, group))

    def _registered(self) -> bool:
        ctx = _current()
        return (
            self.process_set_id is not None
            and ctx is not None
            and ctx.public_sets.get(self.process_set_id) is self
        )

    def size(self) -> int | None:
        return len(self.ranks) if self._registered() else None

    def rank(self) -> int | None:
        if not self._registered():
            return None
        me = _current().rank
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        ctx = _current()
        if ctx is None:
            return None
        return ctx.rank in self.ranks

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """All ranks; id 0. Its ranks are those of the job this thread initialised."""

    def __init__(self) -> None:
        self.process_set_id = 0
        self.mpi_comm = None
        self._ranks = []

    @property
    def ranks(self) -> list[int]:
        ctx = _current()
        return list(range(ctx.size)) if ctx is not None else []

    def _registered(self) -> bool:
        return _current() is not None


global_process_set: ProcessSet = _GlobalProcessSet()
