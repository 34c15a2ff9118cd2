"""Worker side of ``horovod.run``: ``python -m horovod.runner.run_task``.

Fetches the cloudpickled ``(func, args, kwargs)`` from the job's rendezvous store (scope
``runfunc``, key ``func``), calls it, and stores ``("ok", value)`` or ``("error", exception,
traceback text, time)`` under scope ``runfunc_result``, key ``<rank>``. An exception is
re-raised after it is recorded, so the rank fails and horovodrun stops the job as for any
failing worker.

Must not touch: the launcher (it is the worker side).
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


def _store():
    from horovod.common.config import Config
    from horovod.rendezvous.store import HTTPStoreClient

    cfg = Config.from_env()
    if not cfg.rendezvous_addr or cfg.rendezvous_port <= 0 or not cfg.secret_key:
        raise SystemExit(
            "horovod.runner.run_task runs under horovod.run() (which starts horovodrun), not "
            "on its own"
        )
    return HTTPStoreClient(cfg.rendezvous_addr, cfg.rendezvous_port, bytes.fromhex(cfg.secret_key))


def main(argv: list[str]) -> int:
    from horovod.runner.run_func import FUNC_SCOPE, RESULT_SCOPE

    rank = _rank()
    store = _store()
    blob = store.get(FUNC_SCOPE, "func")
    if blob is None:
        raise SystemExit("horovod.run: the function is missing from the job's store")
    func, args, kwargs = cloudpickle.loads(blob)

    def _write(value: object) -> None:
        store.set(RESULT_SCOPE, str(rank), cloudpickle.dumps(value))

    try:
        value = func(*args, **kwargs)
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            _write(("error", e, tb, time.time()))
        except Exception:  # the exception itself does not pickle: keep its text
            _write(("error", RuntimeError(f"{type(e).__name__}: {e}"), tb, time.time()))
        print(f"User function raise error: {e}", file=sys.stderr)
        raise
    try:
        _write(("ok", value))
    except Exception as e:
        raise RuntimeError(
            f"horovod.run: rank {rank}'s return value could not be pickled ({e}); return "
            "something cloudpickle can serialize"
        ) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
