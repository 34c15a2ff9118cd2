"""``RayExecutor``: a Horovod job whose ranks are Ray actors (upstream's ``horovod.ray``).

``start()`` reserves the workers' resources as one placement group (``num_workers``: a bundle
per worker, packed onto as few nodes as fit; ``num_hosts`` x ``num_workers_per_host``: a bundle
per host, strictly spread, the host's workers inside it), starts the rendezvous store in the
driver, creates one actor per rank, groups the ranks by the node they landed on (consecutive
ranks per node, as horovodrun places them) and gives each actor its ``HOROVOD_*``
environment; each actor then runs ``hvd.init()`` like any worker. ``run``/``execute`` call a
function on every rank and return the results by rank; ``execute_single`` on rank 0;
``run_remote`` returns Ray's object references. ``shutdown()`` stops Horovod in the actors,
kills them, removes the placement group and stops the store.

Failures: a function that raises on one rank, or an actor that dies, fails the call at once
with ``RuntimeError`` naming the first failing rank and its error (the other ranks, which may be
waiting for it inside a collective, are stopped: the executor is then unusable until
``shutdown()`` and ``start()``). A placement group that cannot be satisfied within
``placement_group_timeout_s`` fails ``start()`` with the resources asked for and those the
cluster has. Calls before ``start()`` say so.

Must not touch: the training runtime (it never imports torch, TensorFlow or ``horovod.core``:
the actors do, when the user's function imports them; ray #32332).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised where Ray is absent
    raise ImportError(
        "horovod.ray needs Ray: pip install 'pyhorovod[ray]' (or pip install 'ray>=2.9')"
    ) from e

from horovod.common.exceptions import HorovodInternalError
from horovod.common.secret import make_secret
from horovod.common.shm_names import cleanup_job
from horovod.ray.elastic import ElasticRayExecutor
from horovod.ray.worker import BaseHorovodWorker
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.hosts import HostInfo, assign_slots

ROOT_CAUSE_WAIT_S = 5.0  # after a failure, how long the other ranks may take to report theirs


@dataclass
class MiniSettings:
    """What ``RayExecutor.create_settings`` returns (upstream's fields)."""

    timeout_s: int = 30
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    placement_group_timeout_s: int = 100
    nics: set[str] | None = None
    verbose: int = 1
    elastic: bool = False


class RayExecutor:
    """Run a Horovod job on Ray actors (module docstring)."""

    @staticmethod
    def create_settings(
        timeout_s: int = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: int = 100,
        nics: set[str] | None = None,
    ) -> MiniSettings:
        """``timeout_s``: how long ranks wait for each other at ``hvd.init()``;
        ``placement_group_timeout_s``: how long ``start()`` waits for the resources. (ssh
        settings are accepted for upstream's signature: Ray starts the workers.)"""
        return MiniSettings(
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )

    def __init__(
        self,
        settings: MiniSettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        self.settings = settings or MiniSettings()
        self._elastic: ElasticRayExecutor | None = None
        self.workers: list[Any] = []  # actor handles in rank order
        self._pg: Any = None
        self._server: RendezvousServer | None = None
        self._secret: str | None = None
        self._failed: str | None = None
        if min_workers is not None or max_workers is not None:
            if num_workers is not None or num_hosts is not None:
                raise ValueError(
                    "RayExecutor: give num_workers/num_hosts (a job of fixed size) or "
                    "min_workers/max_workers (an elastic job), not both"
                )
            elastic = ElasticRayExecutor.create_settings(
                min_num_proc=min_workers if min_workers is not None else 1,
                max_num_proc=max_workers,
                reset_limit=reset_limit,
                elastic_timeout=elastic_timeout,
                timeout_s=self.settings.timeout_s,
                nics=self.settings.nics,
                cooldown_range=cooldown_range,
                verbose=self.settings.verbose,
            )
            self._elastic = ElasticRayExecutor(
                elastic,
                use_gpu=use_gpu,
                cpus_per_slot=cpus_per_worker,
                gpus_per_slot=gpus_per_worker,
                override_discovery=override_discovery,
            )
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(
                "RayExecutor needs exactly one of num_workers (workers placed where they fit) "
                "or num_hosts (with num_workers_per_host on each)"
            )
        for name, value in (
            ("num_workers", num_workers),
            ("num_hosts", num_hosts),
            ("num_workers_per_host", num_workers_per_host),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive int, got {value!r}")
        if cpus_per_worker < 0 or (gpus_per_worker is not None and gpus_per_worker < 0):
            raise ValueError("RayExecutor: cpus_per_worker and gpus_per_worker must be >= 0")
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        if num_workers is None:
            assert num_hosts is not None
            num_workers = num_hosts * num_workers_per_host
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (
            (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0
        )
        self.use_current_placement_group = use_current_placement_group

    # ------------------------------------------------------------------ start
    def _bundles(self) -> tuple[list[dict[str, float]], str, list[int]]:
        """(bundles, strategy, bundle index of each worker)."""
        one = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            one["GPU"] = float(self.gpus_per_worker)
        if self.num_hosts is None:
            return (
                [dict(one) for _ in range(self.num_workers)],
                "PACK",
                list(range(self.num_workers)),
            )
        per = self.num_workers_per_host
        host = {k: v * per for k, v in one.items()}
        index = [h for h in range(self.num_hosts) for _ in range(per)]
        return [dict(host) for _ in range(self.num_hosts)], "STRICT_SPREAD", index

    def start(
        self,
        executable_cls: Callable[..., Any] | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Reserve the resources, start the actors and give them their ranks. (Elastic: only
        connect to Ray; each ``run`` starts its own actors.)"""
        if self._elastic is not None:
            if executable_cls is not None:
                raise NotImplementedError(
                    "RayExecutor: elastic jobs (min_workers) run functions with run(); an "
                    "executable_cls cannot survive the loss of its actor"
                )
            self._elastic.env_vars.update(extra_env_vars or {})
            self._elastic.start()
            return
        if self.workers:
            raise RuntimeError("RayExecutor.start() was already called; shutdown() first")
        if not ray.is_initialized():
            ray.init()
        bundles, strategy, index = self._bundles()
        self._pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            self._pg = None
            have = ray.available_resources()
            raise RuntimeError(
                f"RayExecutor.start(): Ray could not reserve {len(bundles)} x {bundles[0]} "
                f"({strategy}) within placement_group_timeout_s="
                f"{self.settings.placement_group_timeout_s}; the cluster has "
                f"{ {k: v for k, v in have.items() if k in ('CPU', 'GPU')} } available. Ask "
                "for fewer workers or resources per worker, or add nodes"
            ) from None
        try:
            self._start_actors(
                index, executable_cls, executable_args, executable_kwargs, extra_env_vars
            )
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, index, executable_cls, executable_args, executable_kwargs, extra_env):
        remote = ray.remote(BaseHorovodWorker)
        actors = [
            remote.options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=index[i]
                ),
                name=None,
            ).remote(world_rank=i, world_size=self.num_workers)
            for i in range(self.num_workers)
        ]
        infos = ray.get([a.node_info.remote() for a in actors], timeout=self._timeout())
        # Consecutive ranks per node, nodes in the order their first worker appeared.
        nodes = list(dict.fromkeys(node for node, _, _ in infos))
        order = sorted(range(len(actors)), key=lambda i: (nodes.index(infos[i][0]), i))
        self.workers = [actors[i] for i in order]
        hosts = [HostInfo(n, sum(1 for x, _, _ in infos if x == n)) for n in nodes]
        slots = assign_slots(hosts, self.num_workers)
        self._secret = make_secret()
        driver_ip = ray.util.get_node_ip_address()
        on_driver = all(x == ray.get_runtime_context().get_node_id() for x in nodes)
        addr = "127.0.0.1" if on_driver else driver_ip
        self._server = RendezvousServer(
            bytes.fromhex(self._secret), host="127.0.0.1" if on_driver else "0.0.0.0"
        ).start()
        base = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self._server.port),
            "HOROVOD_SECRET_KEY": self._secret,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_START_TIMEOUT": str(self.settings.timeout_s),
            "HOROVOD_RENDEZVOUS_SCOPE": f"ray-{secrets.token_hex(6)}",
        }
        if self.settings.nics:
            base["HOROVOD_GLOO_IFACE"] = ",".join(sorted(self.settings.nics))
        base.update(extra_env or {})
        ray.get(
            [
                w.update_env_vars.remote({**base, **s.env()})
                for w, s in zip(self.workers, slots, strict=True)
            ],
            timeout=self._timeout(),
        )
        ray.get(
            [
                w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                for w in self.workers
            ]
        )

    def _timeout(self) -> float:
        return max(60.0, float(self.settings.timeout_s))

    # ------------------------------------------------------------------ calls
    def _ready(self, what: str) -> None:
        if self._elastic is not None:
            raise NotImplementedError(
                f"RayExecutor.{what}(): elastic jobs (min_workers) support run() only, whose "
                "function uses hvd.elastic.run to survive lost workers"
            )
        if self._failed is not None:
            raise RuntimeError(
                f"RayExecutor.{what}(): an earlier call failed ({self._failed}); call "
                "shutdown() and start() again"
            )
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}() before start(): call start() first")

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results by rank; at the first failure, stop every rank and raise the root cause."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception:  # noqa: BLE001 - any failure of a rank fails the job
                # The first failure may be a consequence (a rank whose peer died before Ray
                # reported the death): give the others a moment, then name the root.
                if pending:
                    ray.wait(pending, num_returns=len(pending), timeout=ROOT_CAUSE_WAIT_S)
                rank, why, error = root_cause(refs)
                self._failed = f"rank {rank}: {why}"
                self._stop_workers(graceful=False)
                raise RuntimeError(
                    f"Horovod on Ray: rank {rank} failed: {why}. The other ranks were stopped "
                    "(they may have been waiting for it in a collective)"
                ) from error
        return ray.get(refs)

    def run(
        self,
        fn: Callable[..., Any],
        args: list | tuple | None = None,
        kwargs: dict | None = None,
        callbacks: list[Callable] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank (elastic: those of the
        job's last round)."""
        if self._elastic is not None:
            return self._elastic.run(fn, args, kwargs, callbacks)
        self._ready("run")
        out = self._gather([w.run.remote(fn, args, kwargs) for w in self.workers])
        for cb in callbacks or []:
            cb(out)
        return out

    def execute(
        self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None
    ) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` built)."""
        self._ready("execute")
        out = self._gather([w.execute.remote(fn) for w in self.workers])
        for cb in callbacks or []:
            cb(out)
        return out

    def run_remote(
        self, fn: Callable[..., Any], args: list | tuple | None = None, kwargs: dict | None = None
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; Ray object references by rank."""
        self._ready("run_remote")
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._ready("execute_single")
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    # ------------------------------------------------------------------ shutdown
    def _stop_workers(self, graceful: bool) -> None:
        if graceful and self.workers:
            try:
                ray.get([w.stop_horovod.remote() for w in self.workers], timeout=30)
            except Exception:  # noqa: BLE001 - a dead or stuck actor: kill below
                pass
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []

    def shutdown(self) -> None:
        """Stop Horovod in the actors, kill them, remove the placement group and stop the
        store. Safe to call twice."""
        self._stop_workers(graceful=self._failed is None)
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._secret is not None:
            cleanup_job(bytes.fromhex(self._secret))  # segments a killed rank left here
            self._secret = None
        self._failed = None


def root_cause(refs: list[Any]) -> tuple[int, str, BaseException]:
    """(rank, description, error) of the failure to report: the first rank whose own error
    it was (the user's exception, a dead actor) rather than Horovod's consequence of another
    rank's failure."""
    failures = []
    for rank, ref in enumerate(refs):
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001
            cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else e
            consequence = isinstance(cause, HorovodInternalError)
            failures.append((consequence, rank, e))
    consequence, rank, error = min(failures, key=lambda f: (f[0], f[1]))
    return rank, _describe(error), error


def _describe(e: BaseException) -> str:
    """One line for a rank's failure: the user's exception, or how the actor died."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.as_instanceof_cause()
        inner = getattr(e, "cause", None) or cause
        return f"{type(inner).__name__}: {inner}".splitlines()[0][:400]
    if isinstance(e, ray.exceptions.RayActorError):
        return f"its actor died ({str(e).splitlines()[0][:300]})"
    return f"{type(e).__name__}: {e}".splitlines()[0][:400]
