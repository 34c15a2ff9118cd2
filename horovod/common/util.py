"""Upstream's ``horovod.common.util`` helpers that user code imports, answering for this
implementation: what it was built with (no compiled extensions: Gloo's role is played by
pyhorovod's own transports; MPI is there when mpi4py is installed; CUDA and NCCL when the
installed PyTorch is a CUDA build with PyPI's NCCL package, found without importing torch),
which framework frontends can be used, and small helpers (``env``, ``split_list``, version
comparison).

Must not touch: any layer above it (the frontend reads its build answers from here).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

# What upstream would have compiled in, as this implementation has it.
BUILT = {"gloo": True, "nccl": False, "ddl": False, "ccl": False, "cuda": False}


@functools.cache
def _torch_gpu_stack() -> tuple[bool, int]:
    """``(cuda, nccl_version)`` of the installed PyTorch: a CUDA build (a ``+cu`` version or
    PyPI's CUDA runtime package beside it), and the NCCL package that such builds load
    (upstream's version code, major*10000 + minor*100 + patch; 0: none)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False, 0
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    cuda = "+cu" in torch_version or any(n.startswith("nvidia-cuda-runtime") for n in names)
    if "+cpu" in torch_version or not cuda:
        return False, 0
    for n in sorted(names):
        if n.startswith("nvidia-nccl"):
            parts = [int(x) for x in re.findall(r"\d+", importlib.metadata.version(n))[:3]]
            major, minor, patch = (parts + [0, 0, 0])[:3]
            return True, major * 10000 + minor * 100 + patch
    return True, 0


# Frontend -> the framework it needs. Frontends not listed do not exist in this version.
_FRAMEWORKS = {
    "horovod.torch": "torch",
    "horovod.tensorflow": "tensorflow",
    "horovod.keras": "keras",
    "horovod.tensorflow.keras": "tensorflow",
    "horovod.numpy": "numpy",
}


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Can ``ext_base_name`` (for example ``"horovod.torch"``) be used here: this version has
    that frontend and its framework is installed."""
    framework = _FRAMEWORKS.get(ext_base_name)
    ok = framework is not None and importlib.util.find_spec(framework) is not None
    if verbose and not ok:
        why = "no such frontend in this version" if framework is None else f"{framework} missing"
        print(f"{ext_base_name}: not available ({why})")
    return ok


def gloo_built(verbose: bool = False) -> bool:
    return BUILT["gloo"]


def mpi_built(verbose: bool = False) -> bool:
    """MPI support is mpi4py (pip install 'pyhorovod[mpi]'): found without importing it, which
    would initialise MPI."""
    ok = importlib.util.find_spec("mpi4py") is not None
    if verbose and not ok:
        print("MPI: not available (pip install 'pyhorovod[mpi]' installs mpi4py and Open MPI)")
    return ok


def nccl_built(verbose: bool = False) -> int:
    """The NCCL version code the device plane can use (0: none; docs/gpu.md)."""
    return _torch_gpu_stack()[1]


def cuda_built() -> bool:
    return _torch_gpu_stack()[0]


def ddl_built(verbose: bool = False) -> bool:
    return BUILT["ddl"]


def ccl_built(verbose: bool = False) -> bool:
    return BUILT["ccl"]


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``ext_base_name`` can run on GPUs here (a CUDA build of its framework; only
    horovod.torch has the device plane)."""
    return (
        ext_base_name == "horovod.torch"
        and cuda_built()
        and extension_available(ext_base_name, verbose)
    )


@contextmanager
def env(**variables: Any) -> Iterator[None]:
    """Set environment variables for the duration of a ``with`` block (None values are
    skipped), then restore what was there."""
    variables = {k: str(v) for k, v in variables.items() if v is not None}
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _numbers(version: str) -> tuple[int, int, int]:
    parts = version.split(".")
    if len(parts) != 3:
        raise ValueError(
            f"version {version!r}: expected the form major.minor.patch (for example 2.13.0)"
        )
    out = []
    for part in parts:
        m = re.match(r"\d+", part)
        if m is None:
            raise ValueError(f"version {version!r}: {part!r} does not start with a number")
        out.append(int(m.group()))
    return out[0], out[1], out[2]


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target`` for versions written major.minor.patch (suffixes such as ``+cpu``
    or ``rc1`` are ignored)."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError("is_version_greater_equal_than takes two strings")
    return _numbers(ver) >= _numbers(target)


def split_list(items: Sequence[T], n: int) -> list[list[T]]:
    """``n`` nearly even contiguous chunks of ``items`` (the first ones one longer)."""
    k, m = divmod(len(items), n)
    return [list(items[i * k + min(i, m) : (i + 1) * k + min(i + 1, m)]) for i in range(n)]
