"""Upstream's ``horovod.runner.common.util.env``: a process's rank and the job's size from
the variables its launcher set.

Must not touch: the environment beyond reading it (``horovod.common.config`` reads it).
"""

from __future__ import annotations

from horovod.common.config import env_rank_and_size


def get_env_rank_and_size() -> tuple[int, int]:
    """(rank, size) from horovodrun's, Open MPI's or a PMI launcher's variables, (0, 1) if
    none are set; RuntimeError if only one of a pair is."""
    return env_rank_and_size()
