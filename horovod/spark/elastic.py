"""``horovod.spark.run_elastic``: an elastic Horovod job whose workers run inside Spark tasks
(upstream's ``horovod.spark.run_elastic``).

The elastic driver of ``horovodrun`` (``horovod.runner.elastic.driver``) runs the rounds. The
driver starts one Spark stage of ``max_num_proc`` long-running tasks (not barrier mode: a task
that ends must not end the others), each an **agent** (``horovod.spark.agent``) that
announces its host in the driver's store and starts and stops worker processes when told.

- **membership** (``AgentDiscovery``): every agent whose heartbeat is fresh is a slot on its
  host. An agent that stops beating for ``AGENT_LOST_S`` (its executor was lost, its task
  killed) takes its slot and its worker with it; a task Spark retries comes back as a new
  agent.
- **workers** (``AgentLauncher``): a slot's worker is started by an idle agent on its host (the
  one that ran the slot before, when it can), as a fresh process running the user's function;
  its exit code, last lines and result come back through the store. As under ``horovodrun``,
  a failed worker's host gets no new workers (for good, or for ``cooldown_range`` seconds)
  while the survivors go on from their last commit.

``run_elastic`` returns the results of the last round's workers by rank; a job that cannot go
on raises ``RuntimeError`` with the driver's report. When it returns or raises the agents are
told to stop (their stage is cancelled if they do not within ``AGENTS_STOP_S``) and no worker
is left.

Must not touch: the training runtime in the driver (it imports no framework).
"""

from __future__ import annotations

import itertools
import pickle
import queue
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from horovod.common.config import setting
from horovod.common.secret import make_secret
from horovod.common.shm_names import cleanup_job
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.launch import set_worker_defaults
from horovod.runner.elastic.workers import EngineWorker
from horovod.runner.hosts import HostInfo
from horovod.runner.procs import exit_description
from horovod.spark.agent import BEAT_S, SCOPE, agent_body
from horovod.spark.runner import _driver_address, job_environment, spark_context

AGENT_LOST_S = 10.0
AGENTS_STOP_S = 10.0
POLL_S = 0.05
SPARK_NAMES = {
    "label": "horovod.spark",
    "min_np": "min_num_proc",
    "elastic_timeout": "elastic_timeout",
    "reset_limit": "reset_limit",
    "cooldown": "cooldown_range",
    "add_hosts": "Give the Spark cluster more task slots (executors x spark.executor.cores)",
}


@dataclass
class Agent:
    part: int
    attempt: int
    host: str
    beat: int
    seen: float  # when its heartbeat last changed (driver's clock)


class AgentBook:
    """The agents the driver has heard from, read from the store."""

    def __init__(self, server: RendezvousServer, count: int) -> None:
        self.server, self.count = server, count
        self.agents: dict[int, Agent] = {}
        self.lock = threading.Lock()

    def refresh(self) -> None:
        now = time.monotonic()
        with self.lock:
            for part in range(self.count):
                raw = self.server.get(SCOPE, f"agent.{part}")
                if not raw:
                    continue
                attempt, host, beat = raw.decode().split(" ")
                a = self.agents.get(part)
                if a is None or (a.attempt, a.beat) != (int(attempt), int(beat)):
                    self.agents[part] = Agent(part, int(attempt), host, int(beat), now)

    def wait_stopped(self, timeout: float) -> None:
        """After the driver's ``stop``: wait (up to ``timeout``) until every live agent has
        said it stopped, its worker gone (so that nothing of the job outlives ``run_elastic``,
        even where the Spark stage failed and nobody waits for the agents' tasks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.refresh()
            now = time.monotonic()
            # (an agent whose heartbeat stopped for a few beats is gone: killed with its
            # task, and its worker with it, by the parent-death signal)
            waiting = [a for a in self.live() if now - a.seen < 4 * BEAT_S]
            if all(self.server.get(SCOPE, f"stopped.{a.part}") for a in waiting):
                return
            time.sleep(POLL_S)

    def live(self) -> list[Agent]:
        now = time.monotonic()
        with self.lock:
            return [a for a in self.agents.values() if now - a.seen < AGENT_LOST_S]


class AgentDiscovery:
    """Hosts and slots: the live agents on each host (module docstring)."""

    def __init__(self, book: AgentBook) -> None:
        self.book = book

    def find(self) -> list[HostInfo]:
        self.book.refresh()
        count: dict[str, int] = {}
        for a in sorted(self.book.live(), key=lambda a: a.part):
            count[a.host] = count.get(a.host, 0) + 1
        return [HostInfo(h, n) for h, n in count.items()]


@dataclass
class TaskWorker(EngineWorker):
    """The driver's handle of one worker run by an agent."""

    wid: str = ""
    agent: Agent = field(default_factory=lambda: Agent(-1, 0, "", 0, 0.0))


class AgentLauncher:
    """Workers started by the agents, watched through the store (module docstring)."""

    def __init__(self, server: RendezvousServer, book: AgentBook) -> None:
        self.server, self.book = server, book
        self.running: dict[int, TaskWorker] = {}  # agent's partition -> its worker
        self.started: list[TaskWorker] = []
        self.exits: queue.SimpleQueue | None = None
        self.wids = itertools.count()
        self.lock = threading.Lock()
        self.stage_error: str | None = None
        self._stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="spark-workers")
        self.watcher.start()

    def start(self, host: str, rank: int, env: dict[str, str], exits: queue.SimpleQueue) -> Any:
        self.exits = exits
        wid = f"w{next(self.wids)}"
        with self.lock:
            idle = [a for a in self.book.live() if a.host == host and a.part not in self.running]
            agent = idle[0] if idle else None
            w = TaskWorker(rank, host, wid=wid, agent=agent or Agent(-1, 0, host, 0, 0.0))
            self.started.append(w)
            if agent is None:  # the slot's agent went away meanwhile: a lost worker
                self._ended(w, 1, f"found no idle Spark task on {host} to run it")
                return w
            self.running[agent.part] = w
        env = {**env, "HOROVOD_SPARK_WORKER_ID": wid}
        self.server.put(SCOPE, f"launch.{agent.part}", pickle.dumps((wid, env)))
        return w

    def _ended(self, w: TaskWorker, code: int, why: str = "") -> None:
        w.exit_code, w.why, w.exit_time = code, why, time.time()
        if code == 0:
            raw = self.server.get(SCOPE, f"result.{w.wid}")
            w.result = cloudpickle.loads(raw) if raw is not None else None
        if self.exits is not None:
            self.exits.put(w)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.book.refresh()
            live = {(a.part, a.attempt) for a in self.book.live()}
            with self.lock:
                for part, w in list(self.running.items()):
                    raw = self.server.get(SCOPE, f"exit.{w.wid}")
                    if raw is not None:
                        code_text, _, tail = raw.decode("utf-8", "replace").partition("\n")
                        w.tail.extend(tail.splitlines())
                        del self.running[part]
                        code = int(code_text)
                        self._ended(w, code, exit_description(code))
                    elif (part, w.agent.attempt) not in live or self.stage_error is not None:
                        del self.running[part]
                        why = self.stage_error or f"no heartbeat for {AGENT_LOST_S:g} s"
                        self._ended(w, 1, f"lost its Spark task ({why})")

    def stop(self, workers: Sequence[Any], grace: float, sig: int = signal.SIGTERM) -> None:
        for w in workers:
            if w.exit_code is None and not w.stopped_by_us:
                w.stopped_by_us, w.stop_time = True, time.time()
                self.server.put(SCOPE, f"kill.{w.wid}", str(int(sig)).encode())

    def describe(self, worker: Any) -> str:
        return worker.why or "failed"

    def close(self) -> None:
        self.stop(self.started, 0.0, signal.SIGKILL)
        deadline = time.monotonic() + AGENTS_STOP_S
        while self.running and time.monotonic() < deadline and self.stage_error is None:
            time.sleep(POLL_S)
        self._stop.set()
        self.watcher.join(5)


def run_elastic(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    nics: Any = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
    cooldown_range: tuple[float, float] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark tasks: it starts with
    ``num_proc`` workers (default: the context's ``defaultParallelism``), goes on while at
    least ``min_num_proc`` are left (default ``num_proc``), and has at most ``max_num_proc``
    (default ``num_proc``). Returns the last round's results by rank."""
    if not callable(fn):
        raise TypeError(f"horovod.spark.run_elastic: fn must be callable, got {type(fn).__name__}")
    sc = spark_context()
    n = int(num_proc if num_proc is not None else sc.defaultParallelism)
    lo = min_np if min_np is not None else (min_num_proc if min_num_proc is not None else n)
    hi = max_np if max_np is not None else (max_num_proc if max_num_proc is not None else n)
    if not 1 <= lo <= n <= hi:
        raise ValueError(
            "horovod.spark.run_elastic: sizes must satisfy 1 <= min_num_proc <= num_proc <= "
            f"max_num_proc; got {lo} <= {n} <= {hi}"
        )
    secret = make_secret()
    addr, listen = _driver_address(sc)
    server = RendezvousServer(bytes.fromhex(secret), host=listen).start()
    job_env = job_environment(addr, server.port, secret, nics, env)
    timeout = setting("elastic_timeout", job_env) if elastic_timeout is None else elastic_timeout
    start_s = setting("spark_start_timeout") if start_timeout is None else start_timeout
    leave_timeout = set_worker_defaults(job_env, timeout)
    server.put(SCOPE, "fn", cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
    book = AgentBook(server, hi)
    launcher = AgentLauncher(server, book)
    group = f"horovod-elastic-{secrets.token_hex(4)}"
    driver = ElasticDriver(
        AgentDiscovery(book),
        server=server,
        launcher=launcher,
        np=n,
        min_np=lo,
        max_np=hi,
        reset_limit=reset_limit,
        cooldown=cooldown_range,
        elastic_timeout=timeout,
        start_timeout=start_s,
        leave_timeout=leave_timeout,
        grace=setting("stop_grace_seconds", job_env),
        verbose=verbose > 1,
        discover_every=setting("elastic_discovery_seconds", job_env),
        names=SPARK_NAMES,
    )
    stage = threading.Thread(
        target=_run_agents, args=(sc, group, job_env, hi, launcher, driver), daemon=True
    )
    stage.start()
    try:
        status = driver.run()
    except BaseException:
        driver.interrupt("KeyboardInterrupt")
        raise
    finally:
        launcher.close()
        server.put(SCOPE, "stop", b"1")
        book.wait_stopped(AGENTS_STOP_S)
        stage.join(AGENTS_STOP_S)
        if stage.is_alive():
            sc.cancelJobGroup(group)
            stage.join(AGENTS_STOP_S)
        server.stop()
        cleanup_job(bytes.fromhex(secret))
    if status != 0:
        raise RuntimeError(driver.report().strip())
    finished = sorted(
        (w for w in launcher.started if w.exit_code == 0 and not w.stopped_by_us),
        key=lambda w: w.rank,
    )
    return [w.result for w in finished]


def _run_agents(
    sc: Any,
    group: str,
    job_env: dict[str, str],
    count: int,
    launcher: AgentLauncher,
    driver: ElasticDriver,
) -> None:
    """The agents' stage, on its own thread (``collect`` blocks until the agents stop)."""
    sc.setJobGroup(group, f"horovod.spark.run_elastic: {count} agents", interruptOnCancel=True)
    try:
        sc.parallelize(range(count), count).mapPartitions(agent_body(job_env)).collect()
    except Exception as e:  # noqa: BLE001 - Spark's errors come as Py4J exceptions
        launcher.stage_error = stage_failure(str(e))
        driver.abort(f"the Spark stage running the workers failed: {launcher.stage_error}")


def stage_failure(text: str) -> str:
    """Spark's reason for failing a stage, in one line (not Py4J's wrapper around it)."""
    m = re.search(r"Job aborted due to stage failure: ([^\n]*)", text)
    if m is None:
        m = re.search(r"(?:SparkException|Exception): ([^\n]+)", text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (m.group(1) if m else (lines[0] if lines else "unknown error"))[:400]
