"""The job's life and what a rank knows about it: ``init``/``shutdown``, rank and size queries,
what this build supports (``mpi_built()``, ...), and starting and stopping the timeline.

Must not touch: the engine (it goes through ``horovod.core.context``), tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from horovod.common import util
from horovod.core import context as _context
from horovod.core.messages import DEVICE, wrong_device_code
from horovod.frontend.arguments import require_context


def init(process_sets: Any = None, comm: Any = None) -> None:
    """Start Horovod. ``process_sets``: a list of ``ProcessSet`` to register on every rank, or
    ``"dynamic"`` to allow ``add_process_set``/``remove_process_set`` later."""
    _context.init(process_sets=process_sets, comm=comm)


def shutdown() -> None:
    """Stop Horovod on this rank (every rank stops after the collectives already decided);
    ``init()`` may be called again afterwards."""
    _context.shutdown()


def is_initialized() -> bool:
    return _context.current() is not None


def size() -> int:
    return require_context().size


def rank() -> int:
    return require_context().rank


def local_size() -> int:
    return require_context().local_size


def local_rank() -> int:
    return require_context().local_rank


def cross_size() -> int:
    return require_context().cross_size


def cross_rank() -> int:
    return require_context().cross_rank


def is_homogeneous() -> bool:
    return require_context().is_homogeneous


def mpi_threads_supported() -> bool:
    """Was MPI initialised with ``MPI_THREAD_MULTIPLE`` (the user's threads may call MPI
    beside Horovod's)? Only for MPI jobs, as upstream."""
    ctx = require_context()
    if ctx.mpi is None:
        raise ValueError(
            "Horovod MPI is not enabled: this job runs on the built-in planes. Start it with "
            "horovodrun --mpi (or mpirun) to use MPI"
        )
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """Did this job start over MPI (mpirun, ``hvd.init(comm=...)``, ``--mpi``)?"""
    ctx = _context.current()
    return ctx is not None and ctx.mpi is not None


def mpi_built() -> bool:
    return util.mpi_built()


def gloo_enabled() -> bool:
    """Does this job start through the rendezvous of horovodrun (upstream's Gloo
    controller) rather than over MPI?"""
    ctx = _context.current()
    return ctx is not None and ctx.mpi is None


def gloo_built() -> bool:
    return util.gloo_built()


def nccl_built() -> int:
    return int(util.nccl_built())


def ddl_built() -> bool:
    return util.ddl_built()


def ccl_built() -> bool:
    return util.ccl_built()


def cuda_built() -> bool:
    return util.cuda_built()


def rocm_built() -> bool:
    return False


def device_standin() -> bool:
    """Do framework CPU tensors stand in for device tensors (``HOROVOD_DEVICE_PLANE_TEST``,
    for testing the device plane without a GPU)?"""
    ctx = _context.current()
    return ctx is not None and bool(ctx.config.device_plane_test)


def device_code(index: int, visible: int) -> int:
    """What a request says about a tensor on GPU ``index`` of ``visible``: a device tensor,
    or one on a GPU other than the one this rank's device plane works on (its local rank
    modulo the visible GPUs), which the coordinator refuses on every rank."""
    expected = local_rank() % max(1, visible)
    return DEVICE if index == expected else wrong_device_code(index, expected)


def use_device_plane(make: Callable[[Any, int], Any]) -> None:
    """Give this rank's engine the maker of its device data plane, ``make(config,
    local_rank)`` (called on the first device response; a framework package with device
    tensors installs it before submitting one)."""
    ctx = require_context()
    engine = ctx.engine
    if engine.device_factory is None:
        cfg, local = ctx.config, ctx.local_rank
        engine.device_factory = lambda: make(cfg, local)


def device_paths() -> dict[str, int]:
    """How many device responses this rank ran on each path of the device data plane
    (``{"device": n, "shared": k, "staged": m}``; zeros before the first one)."""
    plane = require_context().engine.device_plane
    if plane is None:
        return {"device": 0, "shared": 0, "staged": 0}
    return dict(plane.path_counts)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (rank 0 writes; other ranks return at once).
    A timeline already being written is closed first. Works whether or not HOROVOD_TIMELINE
    was set (upstream required HOROVOD_TIMELINE=DYNAMIC)."""
    ctx = require_context()
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise ValueError(f"start_timeline: file_path must be a non-empty path, got {file_path!r}")
    try:
        ctx.start_timeline(os.fspath(file_path), bool(mark_cycles))
    except OSError as e:
        raise ValueError(f"start_timeline: cannot write {file_path!r}: {e.strerror or e}") from None


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (a no-op when none is being written)."""
    require_context().stop_timeline()


class Basics:
    """Upstream's ``mpi_ops._basics`` (a ``HorovodBasics``): the functions above as methods,
    and ``_get_process_set_ids_and_ranks``, which user code and tools call."""

    init = staticmethod(init)
    shutdown = staticmethod(shutdown)
    is_initialized = staticmethod(is_initialized)
    size = staticmethod(size)
    rank = staticmethod(rank)
    local_size = staticmethod(local_size)
    local_rank = staticmethod(local_rank)
    cross_size = staticmethod(cross_size)
    cross_rank = staticmethod(cross_rank)
    is_homogeneous = staticmethod(is_homogeneous)
    mpi_threads_supported = staticmethod(mpi_threads_supported)
    mpi_enabled = staticmethod(mpi_enabled)
    mpi_built = staticmethod(mpi_built)
    gloo_enabled = staticmethod(gloo_enabled)
    gloo_built = staticmethod(gloo_built)
    nccl_built = staticmethod(nccl_built)
    ddl_built = staticmethod(ddl_built)
    ccl_built = staticmethod(ccl_built)
    cuda_built = staticmethod(cuda_built)
    rocm_built = staticmethod(rocm_built)
    start_timeline = staticmethod(start_timeline)
    stop_timeline = staticmethod(stop_timeline)

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """Every process set this rank knows: id -> its global ranks (0 is the global set)."""
        ctx = require_context()
        return {ps_id: list(ps.ranks) for ps_id, ps in sorted(ctx.public_sets.items())}


BASICS = Basics()
