"""Worker side of ``horovod.run``: ``python -m horovod.runner.run_task``.

Fetches the cloudpickled ``(func, args, kwargs)`` from the job's rendezvous store (scope
``runfunc``, key ``func``), calls it, and stores ``("ok", value, elastic round, size)`` or
``("error", exception, traceback text, time)`` under scope ``runfunc_result``, key ``<rank>``
(the rank after the call: in elastic jobs, the rank of the last round). An exception is
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
    """This process's rank (horovodrun's, an MPI or PMI launcher's variables)."""
    from horovod.common.config import env_rank_and_size

    return env_rank_and_size()[0]


def _round() -> int:
    """The elastic round this worker last joined (0 outside elastic jobs)."""
    from horovod.common.config import setting

    return int(setting("elastic_round", os.environ))


def _size() -> int:
    from horovod.common.config import env_rank_and_size

    return env_rank_and_size()[1]


def _store():
    from horovod.common.config import Config
    from horovod.rendezvous.store import HTTPStoreClient

    cfg = Config.from_env()
    addr, port = cfg.rendezvous_addr, cfg.rendezvous_port
    if cfg.run_func_store:  # (under mpirun: the launcher's store, beside rank 0's rendezvous)
        addr, _, at = cfg.run_func_store.rpartition(":")
        port = int(at) if at.isdigit() else -1
    if not addr or port <= 0 or not cfg.secret_key:
        raise SystemExit(
            "horovod.runner.run_task runs under horovod.run() (which starts horovodrun), not "
            "on its own"
        )
    return HTTPStoreClient(addr, port, bytes.fromhex(cfg.secret_key))


def main(argv: list[str]) -> int:
    from horovod.runner.run_func import FUNC_SCOPE, RESULT_SCOPE

    store = _store()
    blob = store.get(FUNC_SCOPE, "func")
    if blob is None:
        raise SystemExit("horovod.run: the function is missing from the job's store")
    func, args, kwargs = cloudpickle.loads(blob)

    def _write(value: object) -> None:
        # (the rank after the call: an elastic worker gets its rank, again at every reset,
        # when its function calls hvd.init())
        store.set(RESULT_SCOPE, str(_rank()), cloudpickle.dumps(value))

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
        _write(("ok", value, _round(), _size()))
    except Exception as e:
        raise RuntimeError(
            f"horovod.run: rank {_rank()}'s return value could not be pickled ({e}); return "
            "something cloudpickle can serialize"
        ) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
