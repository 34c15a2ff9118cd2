import faulthandler
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from horovod.common.dtypes import BFLOAT16

SIZES = [1, 2, 3, 5]
LENGTHS = [0, 1, 17, 70_001]  # 70_001 float64 > the small-message switch: exercises the ring
NUMERIC = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]
ALL_DTYPES = NUMERIC + [np.bool_] + ([BFLOAT16] if BFLOAT16 is not None else [])
REPO = Path(__file__).resolve().parents[1]


def rank_data(rank: int, n: int, dtype, shape=None) -> np.ndarray:
    """Small rank-dependent values that are exact in every dtype (incl. float16/bfloat16)."""
    base = (np.arange(n) % 7 + rank + 1).astype(np.int64)
    return base.astype(dtype).reshape(shape if shape is not None else (n,))


# Script text for ``run_script`` (indented 8 spaces, as the tests' scripts are): ``ways(fn)``
# makes 4 cached calls of ``fn`` (after one, negotiated at rank 0) and says how they went:
# (data rounds, plane rounds, the last call's result).
WAYS = """
        import horovod.numpy as hvd
        from horovod.core.context import current
        def ways(fn):
            stats = current().engine.stats
            fn()
            data = plane = 0
            for _ in range(4):
                hvd.barrier()
                d, k = stats["data_rounds"], stats["rounds_run"]
                out = fn()
                data += stats["data_rounds"] - d
                plane += stats["rounds_run"] - k - (stats["data_rounds"] - d)
            return data, plane, out
"""


def run_script(
    script: str, np_: int = 2, *, args=(), env=None, timeout=60, launcher_args=(), raw=False
):
    """Run ``script`` (Python source) under the real horovodrun; returns CompletedProcess."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hvdtest-") as d:  # removed with the script
        path = os.path.join(d, "script.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(script))
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "horovod.runner.launch",
            "-np",
            str(np_),
            *launcher_args,
            sys.executable,
            path,
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=not raw, timeout=timeout, env=full_env)


def run_module(*args: str, timeout: float = 120):
    """``python -m <args>`` with this checkout importable; returns CompletedProcess (text)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def horovodrun_example(np_: int, example: str, *args: str, timeout: float = 180):
    """``horovodrun -np N python examples/<example> <args>``."""
    return run_module(
        "horovod.runner.launch",
        "-np",
        str(np_),
        sys.executable,
        str(REPO / "examples" / example),
        *args,
        timeout=timeout,
    )


@pytest.fixture(params=SIZES, ids=lambda n: f"np{n}")
def size(request):
    return request.param


# Where a crash of this process is reported: a copy of the real stderr taken before any test
# captures it (``pytest_configure``).
_CRASH_FD: list[int] = []


def pytest_configure(config):
    _CRASH_FD.append(os.dup(2))


@pytest.fixture(autouse=True, scope="module")
def _python_reports_crashes():
    """Python's fault handler, reinstalled for every test module. Ray's driver (test_ray)
    installs a handler of its own that writes to its session's log files: a segmentation
    fault later in one CI run killed pytest without a word about where."""
    if _CRASH_FD:
        faulthandler.disable()
        faulthandler.enable(file=_CRASH_FD[0], all_threads=True)
    yield
