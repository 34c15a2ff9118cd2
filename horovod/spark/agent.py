"""The Spark side of an elastic job (``horovod.spark.run_elastic``): agents and their workers.

Each Spark task of the job's agent stage runs ``agent_body``: it announces itself in the
driver's store (``agent.<partition>`` = ``<attempt> <host> <heartbeat>``, rewritten every
``BEAT_S``), then does what the driver asks through the store:

- ``launch.<partition>`` = a pickled ``(worker id, environment)``: start a worker, a fresh
  Python process (``worker_main``) with the task's ``sys.path`` and that
  environment, in its own process group, killed with the agent if the agent dies
  (``PR_SET_PDEATHSIG``). Its output goes to the task's stderr with a ``[worker id]`` prefix
  (the executor's log) and its last lines are kept;
- ``kill.<worker id>`` = a signal number: send it to the worker's process group (SIGKILL after
  ``STOP_GRACE_S`` if it is still there);
- when the worker ends: ``exit.<worker id>`` = ``<exit code>\\n<last lines>``;
- ``stop`` (any value): stop the worker if one runs, and end the task.

A worker process (``worker_main``) loads the job's function from the store (``fn``), runs it
and stores its pickled result as ``result.<worker id>``; an exception prints its traceback and
exits with status 1. Horovod is shut down when the process exits.

Must not touch: the driver's decisions (which agent runs which slot: ``horovod.spark.elastic``).
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import cloudpickle

SCOPE = "spark-elastic"
BEAT_S = 0.5
POLL_S = 0.05
STOP_WAIT_S = 5.0  # how long an agent told to stop waits for its killed worker to be gone
STOP_GRACE_S = 5.0
TAIL_LINES = 20
WORKER_MAIN = "import sys; from horovod.spark.agent import worker_main; sys.exit(worker_main())"


def _store(env: dict[str, str]) -> Any:
    from horovod.rendezvous.store import HTTPStoreClient

    return HTTPStoreClient(
        env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
        int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
        bytes.fromhex(env["HOROVOD_SECRET_KEY"]),
        retries=3,
    )


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Child:
    def __init__(self, wid: str, env: dict[str, str]) -> None:
        self.wid = wid
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_MAIN],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
        self.kill_at: float | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            print(f"[{self.wid}] {line}", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Kill the worker (and its process group) and wait until it is gone."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if self.kill_at is None:
            self.kill_at = time.monotonic() + (0 if sig == signal.SIGKILL else STOP_GRACE_S)


def agent_body(job_env: dict[str, str]) -> Any:
    """The function of the agents' Spark stage (``mapPartitions``)."""

    def body(_partition: Iterator[Any]) -> Iterator[tuple[int, int]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None, "the agent runs inside a Spark task"
        part, attempt = ctx.partitionId(), ctx.attemptNumber()
        yield part, _serve(job_env, part, attempt)

    return body


def _serve(job_env: dict[str, str], part: int, attempt: int) -> int:
    """The agent's loop, until the driver says ``stop``; returns its last heartbeat."""
    store = _store(job_env)
    host = socket.gethostname()
    child: _Child | None = None
    done: set[str] = set()
    beat, next_beat = 0, 0.0
    base = {**os.environ, **job_env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        while True:
            now = time.monotonic()
            if now >= next_beat:
                beat += 1
                store.set(SCOPE, f"agent.{part}", f"{attempt} {host} {beat}".encode())
                next_beat = now + BEAT_S
            if store.get(SCOPE, "stop"):
                # The driver waits for this before it returns: its caller must find no
                # worker of the job left running.
                if child is not None:
                    child.end()
                    child = None
                store.set(SCOPE, f"stopped.{part}", str(attempt).encode())
                return beat
            if child is None:
                raw = store.get(SCOPE, f"launch.{part}")
                if raw:
                    wid, env = pickle.loads(raw)
                    if wid not in done:
                        done.add(wid)
                        child = _Child(wid, {**base, **env})
            else:
                raw = None if child.kill_at is not None else store.get(SCOPE, f"kill.{child.wid}")
                if raw:
                    child.signal(int(raw))
                if child.kill_at is not None and now > child.kill_at:
                    child.signal(signal.SIGKILL)
                code = child.proc.poll()
                if code is not None:
                    child.reader.join(2)
                    code = 128 - code if code < 0 else code
                    report = f"{code}\n" + "\n".join(child.tail)
                    store.set(SCOPE, f"exit.{child.wid}", report.encode())
                    child = None
            time.sleep(POLL_S)
    finally:
        if child is not None:
            child.end()


def worker_main() -> int:
    """One worker process: the job's function, its result into the store."""
    env = dict(os.environ)
    store = _store(env)
    wid = env["HOROVOD_SPARK_WORKER_ID"]
    fn, args, kwargs = cloudpickle.loads(store.get(SCOPE, "fn") or b"")
    try:
        result = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported through the exit code and output
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    store.set(SCOPE, f"result.{wid}", cloudpickle.dumps(result))
    return 0
