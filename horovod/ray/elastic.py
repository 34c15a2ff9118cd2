"""Elastic Horovod jobs on Ray: ``ElasticRayExecutor`` and ``RayExecutor(min_workers=...)``.

The elastic driver of ``horovodrun`` (``horovod.runner.elastic.driver``) runs the rounds; here
its hosts are the cluster's live Ray nodes and its workers are actors:

- **membership** (``RayHostDiscovery``): every live node of the cluster is a host, named by its
  node id, with ``total CPUs // cpus_per_slot`` slots (with GPUs: the fewer of that and
  ``GPUs // gpus_per_slot``). A node that joins the cluster adds slots; a node that leaves it
  (or dies) removes them: its actors die with it and count as lost workers.
- **workers** (``ActorLauncher``): one fresh actor per worker, pinned to its slot's node
  (``NodeAffinitySchedulingStrategy``), given the worker's ``HOROVOD_*`` environment; it runs
  the user's function, which calls ``hvd.init()`` and ``hvd.elastic.run`` as under
  ``horovodrun``. A function that returns ends the worker with status 0, one that raises or an
  actor that dies (``os._exit``, OOM, a lost node) is a failed worker: as in elastic Horovod,
  its host gets no new workers (for ``cooldown_range`` seconds, or for good) while the
  survivors go on. Stopping a worker kills its actor.

``run(fn)`` returns the results of the last round's workers by rank; a job that fails (too
few slots within ``elastic_timeout``, more than ``reset_limit`` resets, every worker lost)
raises ``RuntimeError`` with the driver's report (each failure with its last lines). Nothing
is left behind: every actor it started is killed when ``run`` returns or raises.

Must not touch: the training runtime (actors import it, through the user's function).
"""

from __future__ import annotations

import queue
import re
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod.common.config import setting
from horovod.common.secret import make_secret
from horovod.common.shm_names import cleanup_job
from horovod.ray.worker import BaseHorovodWorker
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.launch import set_worker_defaults
from horovod.runner.elastic.workers import EngineWorker
from horovod.runner.hosts import HostInfo

TAIL_LINES = 20
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_NAMES = {
    "label": "horovod.ray",
    "min_np": "min_workers",
    "elastic_timeout": "elastic_timeout",
    "reset_limit": "reset_limit",
    "cooldown": "cooldown_range",
    "add_hosts": "Add nodes to the Ray cluster (or free their CPUs/GPUs)",
}


class RayHostDiscovery:
    """The live nodes of the Ray cluster and their slots (module docstring)."""

    def __init__(
        self, cpus_per_slot: float = 1, use_gpu: bool = False, gpus_per_slot: float = 1
    ) -> None:
        self.cpus_per_slot = cpus_per_slot
        self.use_gpu = use_gpu
        self.gpus_per_slot = gpus_per_slot

    def find(self) -> list[HostInfo]:
        hosts = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            slots = int(have.get("CPU", 0) // self.cpus_per_slot) if self.cpus_per_slot else 1024
            if self.use_gpu:
                slots = min(slots, int(have.get("GPU", 0) // (self.gpus_per_slot or 1)))
            if slots > 0:
                hosts.append(HostInfo(node["NodeID"], slots))
        return hosts


@dataclass
class ActorWorker(EngineWorker):
    """The driver's handle of one worker running in an actor."""

    actor: Any = None


class ActorLauncher:
    """Workers as Ray actors pinned to their slot's node (module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        base_env: dict[str, str],
        cpus_per_worker: float,
        gpus_per_worker: float,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs)
        self.base_env = base_env
        self.remote: Any = ray.remote(BaseHorovodWorker)
        self.resources = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker}
        self.started: list[ActorWorker] = []

    def start(
        self, host: str, rank: int, env: dict[str, str], exits: queue.SimpleQueue
    ) -> ActorWorker:
        actor = self.remote.options(
            **self.resources,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=host, soft=False),
        ).remote(world_rank=rank, world_size=0)
        w = ActorWorker(rank, host, actor=actor)
        ref = actor.run_elastic.remote(self.fn, self.args, self.kwargs, {**self.base_env, **env})

        def wait() -> None:
            try:
                w.result = ray.get(ref)
                w.exit_code = 0
            except Exception as e:  # noqa: BLE001 - any failure of the worker is its exit
                w.exit_code = 1
                w.why, lines = describe(e)
                w.tail.extend(lines)
            w.exit_time = time.time()
            exits.put(w)

        t = threading.Thread(target=wait, daemon=True, name=f"ray-worker-{rank}")
        t.start()
        w.threads.append(t)
        self.started.append(w)
        return w

    def stop(self, workers: Sequence[Any], grace: float, sig: int = signal.SIGTERM) -> None:
        for w in workers:
            if w.exit_code is None and not w.stopped_by_us:
                w.stopped_by_us = True
                w.stop_time = time.time()
                try:
                    ray.kill(w.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass

    def describe(self, worker: Any) -> str:
        return worker.why or "failed"

    def close(self) -> None:
        self.stop(self.started, 0.0)
        for w in self.started:  # also the finished ones: their processes hold CPUs
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


def describe(e: BaseException) -> tuple[str, list[str]]:
    """(a few words, the last lines of the traceback) for a worker's failure."""
    if isinstance(e, ray.exceptions.RayTaskError):
        inner = getattr(e, "cause", None) or e.as_instanceof_cause()
        text = ANSI.sub("", str(e)).splitlines()
        return f"raised {type(inner).__name__}: {str(inner).splitlines()[0][:300]}", text[
            -TAIL_LINES:
        ]
    if isinstance(e, ray.exceptions.RayActorError):
        return f"lost its actor ({str(e).splitlines()[0][:300]})", []
    return f"failed: {type(e).__name__}: {e}"[:400], traceback.format_exception(e)[-TAIL_LINES:]


@dataclass
class ElasticSettings:
    """What ``ElasticRayExecutor.create_settings`` returns (upstream's fields)."""

    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    cooldown_range: tuple[float, float] | None = None
    nics: set[str] | None = None
    verbose: int = 1
    ssh_identity_file: str | None = None


class ElasticRayExecutor:
    """An elastic Horovod job on the actors of a Ray cluster (module docstring)."""

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: set[str] | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        verbose: int = 1,
    ) -> ElasticSettings:
        """``min_num_proc``/``max_num_proc``: the job's size bounds; ``timeout_s``: how long a
        new actor may take to reach ``hvd.init()``; ``elastic_timeout``: how long to wait for
        ``min_num_proc`` slots. (``min_np``/``max_np`` are upstream's older names.)"""
        s = ElasticSettings(
            min_np=min_np if min_np is not None else min_num_proc,
            max_np=max_np if max_np is not None else max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            timeout_s=timeout_s,
            cooldown_range=cooldown_range,
            nics=nics,
            verbose=verbose,
            ssh_identity_file=ssh_identity_file,
        )
        check_sizes(s.min_np, s.max_np, "min_num_proc", "max_num_proc")
        return s

    def __init__(
        self,
        settings: ElasticSettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: dict[str, str] | None = None,
        override_discovery: bool = True,
    ) -> None:
        if cpus_per_slot < 0 or (gpus_per_slot is not None and gpus_per_slot < 0):
            raise ValueError("ElasticRayExecutor: cpus_per_slot and gpus_per_slot must be >= 0")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot if gpus_per_slot is not None else 1) if use_gpu else 0
        self.env_vars = dict(env_vars or {})
        self.discovery: Any = None  # set by start(); tests may replace it
        self.override_discovery = override_discovery
        self.driver: ElasticDriver | None = None

    def start(self) -> None:
        """Connect to Ray (``ray.init()`` if it is not yet) and watch the cluster's nodes."""
        if not ray.is_initialized():
            ray.init()
        if self.discovery is None or self.override_discovery:
            self.discovery = RayHostDiscovery(self.cpus_per_slot, self.use_gpu, self.gpus_per_slot)

    def run(
        self,
        worker_fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: list[Callable] | None = None,
    ) -> list[Any]:
        """Run ``worker_fn(*args, **kwargs)`` as an elastic job; the results of its last
        round by rank."""
        if self.discovery is None:
            raise RuntimeError("ElasticRayExecutor.run() before start(): call start() first")
        s = self.settings
        secret = make_secret()
        addr = ray.util.get_node_ip_address()
        server = RendezvousServer(
            bytes.fromhex(secret), host="127.0.0.1" if addr.startswith("127.") else "0.0.0.0"
        ).start()
        base = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port),
            "HOROVOD_SECRET_KEY": secret,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_RENDEZVOUS_SCOPE": f"ray-{secrets.token_hex(6)}",
            "PYTHONUNBUFFERED": "1",
        }
        if s.nics:
            base["HOROVOD_GLOO_IFACE"] = ",".join(sorted(s.nics))
        base.update(self.env_vars)
        leave_timeout = set_worker_defaults(base, s.elastic_timeout)
        launcher = ActorLauncher(
            worker_fn,
            args or (),
            kwargs or {},
            base,
            self.cpus_per_slot,
            self.gpus_per_slot,
        )
        self.driver = driver = ElasticDriver(
            self.discovery,
            server=server,
            launcher=launcher,
            np=s.min_np,
            min_np=s.min_np,
            max_np=s.max_np,
            reset_limit=s.reset_limit,
            cooldown=s.cooldown_range,
            elastic_timeout=s.elastic_timeout,
            start_timeout=s.timeout_s,
            leave_timeout=leave_timeout,
            grace=setting("stop_grace_seconds", base),
            verbose=bool(s.verbose and s.verbose > 1),
            discover_every=setting("elastic_discovery_seconds", base),
            names=RAY_NAMES,
        )
        try:
            status = driver.run()
        except BaseException:
            driver.interrupt("KeyboardInterrupt")
            raise
        finally:
            launcher.close()
            server.stop()
            cleanup_job(bytes.fromhex(secret))
        if status != 0:
            raise RuntimeError(driver.report().strip())
        finished = sorted(
            (w for w in launcher.started if w.exit_code == 0 and not w.stopped_by_us),
            key=lambda w: w.rank,
        )
        out = [w.result for w in finished]
        for cb in callbacks or []:
            cb(out)
        return out


def check_sizes(min_np: int, max_np: int | None, min_name: str, max_name: str) -> None:
    if not isinstance(min_np, int) or min_np < 1:
        raise ValueError(f"{min_name} must be a positive int, got {min_np!r}")
    if max_np is not None and (not isinstance(max_np, int) or max_np < min_np):
        raise ValueError(f"{max_name} must be an int >= {min_name} ({min_np}), got {max_np!r}")
