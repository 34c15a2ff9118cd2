"""Worker side of ``horovod.run``: ``python -m horovod.runner.run_task <dir>``.

Loads the cloudpickled ``(func, args, kwargs)`` from ``<dir>/func.pkl``, calls it, and writes
``<dir>/result.<rank>``: ``("ok", value)`` or ``("error", exception, traceback text, time)``.
An exception is re-raised after it is recorded, so the rank fails and horovodrun stops the job
as for any failing worker.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import cloudpickle


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var, "").strip():
            return int(os.environ[var])
    return 0


def _write(path: str, value: object) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    (job_dir,) = argv
    rank = _rank()
    with open(os.path.join(job_dir, "func.pkl"), "rb") as f:
        func, args, kwargs = cloudpickle.load(f)
    out = os.path.join(job_dir, f"result.{rank}")
    try:
        value = func(*args, **kwargs)
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            _write(out, ("error", e, tb, time.time()))
        except Exception:  # the exception itself does not pickle: keep its text
            _write(out, ("error", RuntimeError(f"{type(e).__name__}: {e}"), tb, time.time()))
        print(f"User function raise error: {e}", file=sys.stderr)
        raise
    try:
        _write(out, ("ok", value))
    except Exception as e:
        raise RuntimeError(
            f"horovod.run: rank {rank}'s return value could not be pickled ({e}); return "
            "something cloudpickle can serialize"
        ) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
