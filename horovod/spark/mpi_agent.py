"""mpirun's remote shell under ``horovod.spark.run(use_mpi=True)``:
``python -m horovod.spark.mpi_agent [ssh options] hvdspark-<i> <command words>``.

Where ``mpirun`` would ssh to a host to start its daemon there, it runs this instead (Open
MPI's ``plm_rsh_agent``, Hydra's ``-launcher-exec``). The agent hands the command to the
Spark task that serves host ``i`` through the driver's store (``horovod.spark.mpi_job``),
waits for its exit status and exits with it, so ``mpirun`` sees the daemon as if ssh had run
it. Told to stop (SIGTERM, SIGINT, SIGHUP: mpirun ending the job), it asks the task to end
the daemon.

Must not touch: anything but the store's ``spark-mpi`` keys of its host.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from horovod.spark.mpi_job import POLL_S, SCOPE, host_index, store_from_env


def main(argv: list[str]) -> int:
    at = next((k for k, word in enumerate(argv) if host_index(word) is not None), None)
    if at is None or at + 1 >= len(argv):
        print(
            f"horovod.spark.mpi_agent: no host of the job and command in {argv!r}",
            file=sys.stderr,
        )
        return 2
    i = host_index(argv[at])
    store = store_from_env(os.environ)

    def stop(signum: int, _frame: Any) -> None:
        store.set(SCOPE, f"stop.{i}", b"1")
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    parent = os.getppid()
    store.set(SCOPE, f"launch.{i}", json.dumps(argv[at + 1 :]).encode())
    delay = POLL_S / 4
    while True:
        raw = store.get(SCOPE, f"exit.{i}")
        if raw is not None:
            status, tail = json.loads(raw)
            if status != 0:
                lines = "\n".join(f"  {line}" for line in tail)
                print(
                    f"horovod.spark: mpirun's daemon in the Spark task of {argv[at]} exited with "
                    f"status {status}" + (f"; its last lines:\n{lines}" if lines else ""),
                    file=sys.stderr,
                )
            return 1 if status < 0 else int(status)
        if store.get(SCOPE, "failed") is not None:
            print(
                f"horovod.spark: the Spark stage failed: the task of {argv[at]} cannot run "
                "mpirun's daemon",
                file=sys.stderr,
            )
            return 1
        if os.getppid() != parent or store.get(SCOPE, "done") is not None:
            store.set(SCOPE, f"stop.{i}", b"1")  # (mpirun is gone: so is the job)
            return 1
        time.sleep(delay)
        delay = min(delay * 2, POLL_S * 5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
