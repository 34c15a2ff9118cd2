"""The runtime Context: what ``hvd.init()`` builds (config, store, transport, engine, process
sets, handles) and ``hvd.shutdown()`` tears down.

There is no module-level runtime state besides *which* context is current: a process-wide
default for normal jobs (so framework threads such as data loaders see it too) and a
ContextVar override used by ``horovod.testing.run_ranks`` to run N ranks as N threads.

Must not touch: a transport's internals (it only creates and closes transports), framework
tensors, the launcher.
"""

from __future__ import annotations

import atexit
import contextvars
import faulthandler
import itertools
import logging
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from horovod.collectives import algorithms as alg
from horovod.common import log, scheduler
from horovod.common import process_sets as process_sets_module
from horovod.common.config import Config
from horovod.common.exceptions import ConfigError, HorovodInternalError
from horovod.common.net import crowded, machine_id
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core import membership, mpi_world, pool
from horovod.core.autotune import Autotuner, Params
from horovod.core.engine import Engine
from horovod.core.handles import Handle
from horovod.core.messages import decode, encode
from horovod.core.timeline import Timeline
from horovod.rendezvous.store import HTTPStoreClient, MemoryStore, Store
from horovod.transport.base import Transport
from horovod.transport.loopback import LoopbackWorld, SoloTransport

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
# Rendezvous stores served by rank 0 of scheduler-started jobs, by (port, key).
_SCHEDULED_SERVERS: dict[tuple[int, str], Any] = {}
FAILURE_SCOPE = "job"  # where workers record why they die (read by horovodrun)


@dataclass
class RankSpec:
    """How a rank thread of ``run_ranks`` joins its in-process world."""

    world: LoopbackWorld
    rank: int
    env: dict[str, str]
    hosts: list[str] | None = None
    rounds: itertools.count = field(default_factory=itertools.count)


_spec: contextvars.ContextVar[RankSpec | None] = contextvars.ContextVar(
    "horovod_rank_spec", default=None
)
_thread_ctx: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "horovod_context", default=None
)
_process_ctx: Context | None = None
_process_rounds = itertools.count()
_scope_rounds: Counter[str] = Counter()  # hvd.init() calls per HOROVOD_RENDEZVOUS_SCOPE
_lock = threading.Lock()
_atexit_registered = False


def current() -> Context | None:
    if _spec.get() is not None:
        return _thread_ctx.get()
    return _process_ctx


process_sets_module.context_lookup = current


def enter_rank(spec: RankSpec) -> None:
    """Make this thread one rank of a job of threads (``horovod.testing.run_ranks``)."""
    _spec.set(spec)


def bind(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, made to run in the caller's rank context when another thread calls it.
    Frameworks run graph ops on their own threads (TensorFlow's executor); with ranks as threads
    (``horovod.testing.run_ranks``) those threads would otherwise see no Horovod context. In a
    normal job (one rank per process) ``fn`` is returned unchanged."""
    spec = _spec.get()
    if spec is None:
        return fn
    ctx = _thread_ctx.get()

    def run(*args: Any, **kwargs: Any) -> Any:
        t_spec, t_ctx = _spec.set(spec), _thread_ctx.set(ctx)
        try:
            return fn(*args, **kwargs)
        finally:
            _thread_ctx.reset(t_ctx)
            _spec.reset(t_spec)

    return run


def require() -> Context:
    ctx = current()
    if ctx is None:
        raise ValueError(NOT_INITIALIZED)
    return ctx


def init(process_sets: Any = None, comm: Any = None) -> Context:
    global _process_ctx, _atexit_registered
    spec = _spec.get()
    if comm is not None and spec is not None:
        raise ValueError(
            "hvd.init(comm=...) is for processes started by mpirun; these ranks are threads "
            "of one process (run_ranks)"
        )
    ctx = current()
    if ctx is not None and not ctx.stopped:
        return ctx
    env: dict[str, str]
    scope: str | None = None
    rnd: membership.Round | None = None
    world: mpi_world.MpiWorld | None = None
    if spec is not None:
        env = spec.env
    else:
        env = os.environ  # type: ignore[assignment]
    static: list[ProcessSet] = []
    if process_sets == "dynamic":
        env["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    elif process_sets is not None:
        static = list(process_sets)
        for i, ps in enumerate(static):
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets entry number {i} is not a ProcessSet: {ps!r}")
            if any(
                ps is other or (ps.ranks == other.ranks and ps.mpi_comm is other.mpi_comm is None)
                for other in static[:i]
            ):
                raise ValueError(
                    f"Horovod could not be initialized because process_sets entry "
                    f"number {i} is a duplicate: {ps}"
                )
    if spec is not None:
        n = spec.world.size
        hosts = spec.hosts or ["localhost"] * n
        local = _local_layout(hosts)[spec.rank]
        cfg = Config.from_env(
            env,
            rank=spec.rank,
            size=n,
            hostname=hosts[spec.rank],
            local_rank=local[0],
            local_size=local[1],
            cross_rank=local[2],
            cross_size=local[3],
        )
    else:
        launch = scheduler.detect(env)
        if mpi_world.wanted(env, comm, launch.scheduler if launch is not None else None):
            if membership.elastic_requested(env):
                raise ConfigError(
                    "elastic jobs run on the built-in planes, not on MPI: drop --mpi, "
                    "HOROVOD_CPU_OPERATIONS=mpi or hvd.init(comm=...)"
                )
            world = mpi_world.connect(
                env,
                comm,
                launch.scheduler if launch else None,
                launch.env if launch else None,
            )
            env = {**env, **world.env}
            scope = world.scope
            try:
                static = world.assemble_sets(static)
            except BaseException:
                world.close()
                raise
            launch = None  # the world serves the rendezvous itself
        elif launch is not None:  # srun / mpirun started this worker, not horovodrun
            env = {**env, **launch.env}
        elif membership.elastic_requested(env):  # horovodrun's elastic driver seats us
            rnd, scope = membership.join(env)
        if world is None and any(ps.mpi_comm is not None for ps in static):
            raise ValueError(
                "ProcessSet(comm) needs an MPI job (started by mpirun or horovodrun --mpi); "
                "this one runs on horovodrun's own launcher: pass lists of ranks instead"
            )
        try:
            cfg = Config.from_env(env)
        except BaseException:
            if world is not None:
                world.close()
            raise
        log.configure(cfg.log_level, cfg.log_hide_time)
    new = Context(cfg, spec, static, env, launch if spec is None else None, scope, rnd, world)
    with _lock:
        if spec is not None:
            _thread_ctx.set(new)
        else:
            _process_ctx = new
            if not _atexit_registered:
                atexit.register(_shutdown_at_exit)
                sys.excepthook = _excepthook
                _atexit_registered = True
    return new


def _shutdown_at_exit() -> None:
    ctx = _process_ctx
    shutdown(why=ctx.exit_reason if ctx is not None and ctx.exit_reason else "exited")


_previous_excepthook = sys.excepthook


def _excepthook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
    """Record why this worker is about to die, before atexit shuts Horovod down: the other
    ranks then learn the real cause, and horovodrun can tell a root cause from the ranks that
    only failed because of it."""
    try:
        ctx = _process_ctx
        if ctx is not None and not ctx.stopped:
            ctx.record_failure(value)
    except Exception:
        pass
    _previous_excepthook(etype, value, tb)


def shutdown(why: str = "called shutdown()") -> None:
    global _process_ctx
    ctx = current()
    if ctx is None:
        return
    ctx.stop(why)
    if _spec.get() is not None:
        _thread_ctx.set(None)
    elif _process_ctx is ctx:
        _process_ctx = None


def _autotuner(cfg: Config, env: Mapping[str, str] | None) -> Autotuner:
    """Rank 0's tuner. Knobs the user set explicitly stay fixed, as upstream."""
    env = env or {}

    def given(name: str) -> bool:
        return bool(env.get(name, "").strip())

    def report(text: str) -> None:
        if log.logger.isEnabledFor(logging.INFO):
            log.logger.info(text)
        else:  # asked for with --autotune: worth showing at the default log level too
            print(f"[horovod] {text}", flush=True)

    return Autotuner(
        Params(cfg.fusion_threshold, cfg.cycle_time_ms, cfg.cache_capacity > 0),
        tune_fusion=not given("HOROVOD_FUSION_THRESHOLD"),
        tune_cycle=not given("HOROVOD_CYCLE_TIME"),
        tune_cache=cfg.cache_capacity > 0 and not given("HOROVOD_CACHE_CAPACITY"),
        warmup_samples=cfg.autotune_warmup_samples,
        steps_per_sample=cfg.autotune_steps_per_sample,
        max_samples=cfg.autotune_bayes_opt_max_samples,
        noise=cfg.autotune_gaussian_process_noise,
        log_file=cfg.autotune_log,
        report=report,
    )


def _register_stack_dump() -> bool:
    """Let SIGUSR1 dump this process's Python stacks to stderr (faulthandler works even while
    the interpreter is stuck in C code). Only when nobody else uses SIGUSR1."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
            return False
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        return True
    except (ValueError, OSError, AttributeError, RuntimeError):
        return False


def _data_plane_settings(cfg: Config) -> list[tuple[str, object]]:
    """Settings that every rank must share, or collectives would not match up."""
    from horovod.common.config import env_of

    return [
        (env_of(k), getattr(cfg, k))
        for k in (
            "ring_threshold_bytes",
            "shared_memory",
            "shm_chunk_bytes",
            "shm_slots",
            "shm_single_copy_bytes",
            "hierarchical_allreduce",
            "hierarchical_allreduce_pieces",
            "hierarchical_allgather",
        )
    ]


def _local_layout(hosts: list[str]) -> list[tuple[int, int, int, int]]:
    """(local_rank, local_size, cross_rank, cross_size) per rank, as upstream defines them."""
    counts = Counter(hosts)
    seen: Counter[str] = Counter()
    local_ranks = []
    for h in hosts:
        local_ranks.append(seen[h])
        seen[h] += 1
    host_order = list(dict.fromkeys(hosts))
    out = []
    for h, lr in zip(hosts, local_ranks, strict=False):
        with_lr = [x for x in host_order if counts[x] > lr]
        out.append((lr, counts[h], with_lr.index(h), len(with_lr)))
    return out


class Context:
    def __init__(
        self,
        cfg: Config,
        spec: RankSpec | None,
        static_sets: list[ProcessSet],
        env: Mapping[str, str] | None = None,
        launch: scheduler.Launch | None = None,
        scope: str | None = None,
        elastic_round: membership.Round | None = None,
        mpi: mpi_world.MpiWorld | None = None,
    ) -> None:
        self.config = cfg
        self.mpi = mpi  # the job's MPI world (hvd.mpi_enabled()), or None
        self.elastic_round = elastic_round  # the elastic membership round this context is
        self.rank, self.size = cfg.rank, cfg.size
        self.local_rank, self.local_size = cfg.local_rank, cfg.local_size
        self.cross_rank, self.cross_size = cfg.cross_rank, cfg.cross_size
        self.stopped = False
        self.exit_reason = ""
        self.handles: dict[int, Handle] = {}
        self._handle_ids = itertools.count(1)
        self.op_counters: Counter[str] = Counter()
        round_id = next(spec.rounds if spec is not None else _process_rounds)
        if not scope and cfg.rendezvous_scope:
            # A job's own scope: the ranks' processes may have served other jobs before
            # (so their own init counts differ); within the job they init alike.
            _scope_rounds[cfg.rendezvous_scope] += 1
            scope = f"{cfg.rendezvous_scope}.{_scope_rounds[cfg.rendezvous_scope]}"
        scope = scope or f"init{round_id}"
        for ps in static_sets:
            bad = [r for r in ps.ranks if r >= cfg.size]
            if bad:
                raise ValueError(
                    f"process set {ps.ranks} names ranks {bad} but the job has "
                    f"{cfg.size} ranks (0..{cfg.size - 1})"
                )
        self._rendezvous_server = None
        if launch is not None and cfg.size > 1:
            self._rendezvous_server = self._serve_rendezvous(cfg, launch)
        try:
            store, transport = self._connect(
                cfg,
                spec,
                scope,
                scheduled=launch is not None or mpi is not None,
                elastic_round=elastic_round,
            )
        except BaseException:
            if mpi is not None:
                mpi.close()
            raise
        self.store = store
        self.timeline: Timeline | None = None
        self.autotuner: Autotuner | None = None
        stall_on = not cfg.stall_check_disable and cfg.stall_check_time_seconds > 0
        dumps = spec is None and cfg.size > 1 and stall_on and _register_stack_dump()
        try:
            infos = self._exchange_info(store, scope, cfg, [ps.ranks for ps in static_sets], dumps)
            hosts = Counter(info[0] for info in infos)
            self.is_homogeneous = len(set(hosts.values())) == 1
            self.hostnames = [info[0] for info in infos]
            # (ranks of several host names may share one machine's cores: test hosts)
            self.crowded = crowded([info[9] for info in infos], cfg.rank)
            if launch is not None or mpi is not None:  # the launcher's local ranks are a
                # guess; hosts are facts
                layout = _local_layout(self.hostnames)[cfg.rank]
                self.local_rank, self.local_size, self.cross_rank, self.cross_size = layout
            alg.SMALL_BYTES = cfg.ring_threshold_bytes
            pool.POOL.capacity = cfg.output_pool_bytes if pool._refcounts_are_exact() else 0
            alg.HIERARCHICAL_ALLREDUCE = cfg.hierarchical_allreduce
            alg.HIERARCHICAL_PIECES = cfg.hierarchical_allreduce_pieces
            alg.HIERARCHICAL_ALLGATHER = cfg.hierarchical_allgather
            if mpi is not None and mpi.data_plane and cfg.size > 1:
                transport = self._with_mpi(cfg, store, scope, transport, mpi)
            elif spec is None and cfg.size > 1 and cfg.shared_memory:
                if cfg.tcp_polled_control and len(hosts) > 1:
                    # Several hosts: the thread running the engine reads the TCP control
                    # connections to the other hosts too (no reader threads, no hand-offs).
                    transport = self._with_polled_tcp(cfg, transport)
                transport = self._with_shared_memory(cfg, store, scope, transport)
            if spec is None and cfg.size > 1 and cfg.tcp_polled_control:
                transport = self._with_polled_tcp(cfg, transport)
            transport.hosts = list(self.hostnames)
            # Ranks on rank 0's host whose stacks can be dumped with SIGUSR1 (faulthandler),
            # for the hang doctor when a rank is too busy in C code to answer.
            signal_pids = {
                r: info[6]
                for r, info in enumerate(infos)
                if r > 0 and info[7] and info[0] == infos[0][0]
            }
            if cfg.rank == 0 and cfg.timeline and cfg.timeline.upper() != "DYNAMIC":
                self.timeline = Timeline(cfg.timeline, cfg.timeline_mark_cycles)
            self.autotuner = _autotuner(cfg, env) if cfg.autotune and cfg.rank == 0 else None
            self.engine = Engine(
                cfg.rank,
                cfg.size,
                transport,
                fusion_threshold=cfg.fusion_threshold,
                cycle_time_ms=cfg.cycle_time_ms,
                cache_capacity=cfg.cache_capacity,
                disable_group_fusion=cfg.disable_group_fusion,
                stall_check_seconds=0.0
                if cfg.stall_check_disable
                else cfg.stall_check_time_seconds,
                stall_shutdown_seconds=cfg.stall_shutdown_time_seconds,
                process_sets=[ps.ranks for ps in static_sets],
                main_ident=threading.get_ident(),
                other_threads=spec is None,
                stack_signal_pids=signal_pids,
                wait_summary_seconds=cfg.wait_summary_seconds,
                on_fatal_report=self._record_diagnosis,
                timeline=self.timeline,
                autotuner=self.autotuner,
                eager_bytes=cfg.eager_allreduce_bytes,
                peer_rounds=cfg.peer_rounds,
            )
            if spec is None and cfg.size > 1 and (launch is not None or mpi is not None):
                self._release_store(store, scope, cfg)
        except BaseException:
            transport.close()
            if mpi is not None:
                mpi.close()
            if self.timeline is not None:
                self.timeline.close()
            if self.autotuner is not None:
                self.autotuner.close()
            raise
        self.public_sets: dict[int, ProcessSet] = {0: global_process_set}
        for i, ps in enumerate(static_sets, start=1):
            ps.process_set_id = i
            self.public_sets[i] = ps
        self.engine.start()
        log.logger.info("Horovod initialized: rank %d of %d", cfg.rank, cfg.size)

    @staticmethod
    def _release_store(store: Store, scope: str, cfg: Config) -> None:
        """Where rank 0's process serves the job's rendezvous store (a job started by mpirun
        or a scheduler, not horovodrun), rank 0 leaves init only once every rank is done with
        the store: a rank still reading it when rank 0's script had already ended (a job with
        nothing after init, under load) found the server gone and failed its init."""
        store.set(scope, f"init.done.{cfg.rank}", b"1")
        if cfg.rank == 0:
            store.wait(scope, [f"init.done.{r}" for r in range(cfg.size)], cfg.timeout_seconds)

    @staticmethod
    def _serve_rendezvous(cfg: Config, launch: scheduler.Launch):
        """Without horovodrun, rank 0 serves the rendezvous store at the agreed address."""
        if not cfg.rendezvous_addr:
            raise ConfigError(
                f"this worker was started by {launch.scheduler} (rank {cfg.rank} of {cfg.size}) "
                "without horovodrun: set HOROVOD_GLOO_RENDEZVOUS_ADDR to the host name or address "
                "of rank 0's machine on every rank (e.g. `mpirun -x "
                "HOROVOD_GLOO_RENDEZVOUS_ADDR=$(hostname) ...`); rank 0 serves the rendezvous there"
            )
        if launch.derived_secret and cfg.rank == 0:
            log.logger.warning(
                "HOROVOD_SECRET_KEY is not set: the job's key was derived from the %s job id, "
                "which others on the network may know. Export a random one to every rank, e.g. "
                "`export HOROVOD_SECRET_KEY=$(openssl rand -hex 32)` before srun/mpirun.",
                launch.scheduler,
            )
        if cfg.rank != 0:
            return None
        from horovod.rendezvous.server import RendezvousServer

        key = (cfg.rendezvous_port, cfg.secret_key)
        if key in _SCHEDULED_SERVERS:  # hvd.init() again after shutdown(): the same store
            return _SCHEDULED_SERVERS[key]
        try:
            server = RendezvousServer(
                bytes.fromhex(cfg.secret_key), host="0.0.0.0", port=cfg.rendezvous_port
            ).start()
            _SCHEDULED_SERVERS[key] = server  # lives as long as the process
            return server
        except OSError as e:
            raise ConfigError(
                f"rank 0 cannot serve the rendezvous on port {cfg.rendezvous_port} "
                f"({e.strerror or e}); set HOROVOD_GLOO_RENDEZVOUS_PORT to a free port on every "
                "rank"
            ) from None

    @staticmethod
    def _connect(
        cfg: Config,
        spec: RankSpec | None,
        scope: str,
        scheduled: bool = False,
        elastic_round: membership.Round | None = None,
    ) -> tuple[Store, Transport]:
        if spec is not None:
            return spec.world.store, spec.world.transport(cfg.rank, int(scope[4:]))
        if cfg.size == 1:
            return MemoryStore(), SoloTransport(cfg.spin_microseconds / 1e6)
        if not cfg.rendezvous_addr or cfg.rendezvous_port <= 0:
            raise ConfigError(
                f"HOROVOD_SIZE={cfg.size} but HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT are not set: "
                "start the job with horovodrun (e.g. `horovodrun -np 2 python train.py`), or run "
                "a single process without HOROVOD_SIZE"
            )
        if not cfg.secret_key:
            raise ConfigError(
                "HOROVOD_SECRET_KEY is not set. horovodrun gives every worker the job's secret; "
                "when starting workers another way, set the same random hex value on every rank "
                "(e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)"
            )
        from horovod.transport.tcp import TcpTransport, interface_address, local_address_towards

        secret = bytes.fromhex(cfg.secret_key)
        # Under a scheduler rank 0 may start later than the others: retry for the start timeout.
        retries = 5 + int(cfg.start_timeout) if scheduled else 5
        store = HTTPStoreClient(cfg.rendezvous_addr, cfg.rendezvous_port, secret, retries=retries)
        if elastic_round is not None:
            store.abandon_if = membership.abandon_check(store, elastic_round.generation)
        advertise = (
            interface_address(cfg.iface)
            if cfg.iface
            else local_address_towards(cfg.rendezvous_addr)
        )
        transport = TcpTransport(
            cfg.rank,
            cfg.size,
            store=store,
            scope=scope,
            secret=secret,
            advertise=advertise,
            timeout=cfg.timeout_seconds,
        )
        return store, transport

    def _with_mpi(
        self,
        cfg: Config,
        store: Store,
        scope: str,
        transport: Transport,
        mpi: mpi_world.MpiWorld,
    ) -> Transport:
        """The MPI data plane (horovod.transport.mpi): on one host, MPI's collectives on the
        shared-memory transport (whose control and peer rounds keep small operations fast);
        across hosts, every byte through MPI and control through ``transport`` (TCP), read by
        the polling thread and with peer rounds over TCP where TCP's control is polled."""
        from horovod.transport import mpi as mpi_plane

        warn = 0.0 if cfg.stall_check_disable else cfg.stall_check_time_seconds
        stop = cfg.stall_shutdown_time_seconds
        comm = mpi.take_comm()
        if cfg.shared_memory and len(set(self.hostnames)) == 1:
            shm = self._with_shared_memory(cfg, store, scope, transport)
            plane = mpi_plane.MpiPlane(comm, lambda: getattr(shm, "aborted", None), warn, stop)
            return mpi_plane.attach(shm, plane)
        whole = mpi_plane.MpiTransport(comm, transport, warn, stop)
        if not cfg.tcp_polled_control:
            return whole
        return self._with_polled_tcp(cfg, transport, whole)

    def _with_shared_memory(
        self, cfg: Config, store: Store, scope: str, transport: Transport
    ) -> Transport:
        from horovod.transport.shm import ShmTransport

        return ShmTransport.create(
            transport,
            self.hostnames,
            store=store,
            scope=scope,
            secret=bytes.fromhex(cfg.secret_key),
            chunk=cfg.shm_chunk_bytes,
            slots=cfg.shm_slots,
            spin_us=cfg.spin_microseconds,
            timeout=cfg.timeout_seconds,
            single_copy=cfg.shm_single_copy_bytes,
            outputs=cfg.output_pool_bytes > 0 and pool._refcounts_are_exact(),
            crowded=self.crowded,
        )

    def _with_polled_tcp(
        self, cfg: Config, transport: Transport, mpi: Transport | None = None
    ) -> Transport:
        """TCP with its control connections read by the polling thread: TCP alone, the TCP
        plane under shared memory between hosts, or the control beside ``mpi`` (an
        ``MpiTransport``: every byte through MPI). Anything but a bare ``TcpTransport`` is
        not polled: ``mpi`` as it is where given, else ``transport``."""
        from horovod.transport.tcp import TcpTransport
        from horovod.transport.tcp_board import MAX_RANKS as TCP_BOARD_MAX_RANKS
        from horovod.transport.tcp_polled import PolledTcpTransport

        if type(transport) is not TcpTransport:
            return mpi if mpi is not None else transport
        per_host = Counter(self.hostnames)
        here = per_host[self.hostnames[cfg.rank]]
        # Peer rounds over TCP where the job is small enough for each rank to post to all
        # the others (a decision every rank makes the same: connecting is collective): over
        # TCP alone, or to the other hosts' ranks beside shared memory (``MixedBoard``).
        # (Whatever HOROVOD_PEER_ROUNDS says: a rank that posts none still answers.)
        board = cfg.size <= TCP_BOARD_MAX_RANKS
        spin_us = cfg.spin_microseconds
        oversubscribed = here > (os.cpu_count() or 1) or self.crowded
        board_timeout = cfg.timeout_seconds if board else None
        if mpi is not None:
            from horovod.transport.mpi import MpiPolledTransport, MpiTransport

            assert isinstance(mpi, MpiTransport)
            return MpiPolledTransport(mpi, transport, spin_us, oversubscribed, board_timeout)
        one_host = len(per_host) == 1
        return PolledTcpTransport(transport, spin_us, oversubscribed, board_timeout, one_host)

    @staticmethod
    def _exchange_info(
        store: Store, scope: str, cfg: Config, sets: list[list[int]], dumps: bool
    ) -> list[tuple]:
        mine = (
            cfg.hostname,
            cfg.local_rank,
            cfg.local_size,
            cfg.cross_rank,
            cfg.cross_size,
            sets,
            os.getpid(),
            dumps,
            _data_plane_settings(cfg),
            machine_id(),
        )
        if cfg.size == 1:
            return [mine]
        store.set(scope, f"info.{cfg.rank}", encode(("I",) + mine))
        raw = store.wait(
            scope,
            [f"info.{r}" for r in range(cfg.size)],
            max(cfg.start_timeout, cfg.timeout_seconds),
        )
        infos = [decode(b)[1:] for b in raw]
        for r, info in enumerate(infos):
            if info[8] != mine[8]:
                theirs = dict(info[8])
                diff = ", ".join(
                    f"{k}={v} here but {theirs.get(k)} on rank {r}"
                    for k, v in mine[8]
                    if theirs.get(k) != v
                )
                raise ConfigError(
                    f"ranks disagree on data-plane settings ({diff}); every rank must use the "
                    "same values (horovodrun passes the launching environment to all of them)"
                )
            if info[5] != sets:
                raise ValueError(
                    f"Different ranks tried to set up mismatching process sets: rank {cfg.rank} "
                    f"passed {sets} to hvd.init(process_sets=...) but rank {r} passed {info[5]}; "
                    "every rank must pass the same list in the same order"
                )
        return infos

    def _record_diagnosis(self, text: str) -> None:
        """A fatal stall report (the hang doctor's on rank 0, a peer round's or the coordinator
        watch's on another rank): horovodrun prints it as the job's root cause, with the rank
        that wrote it (first line)."""
        if self.size > 1:
            try:
                self.store.set(FAILURE_SCOPE, "diagnosis", f"{self.rank}\n{text}".encode())
            except Exception as e:  # the report is also in rank 0's log
                log.logger.debug("could not record the stall report: %s", e)

    # ------------------------------------------------------------------ timeline
    def start_timeline(self, path: str, mark_cycles: bool) -> None:
        if self.rank != 0:
            return  # only rank 0 writes, as upstream
        old = self.timeline
        new = Timeline(path, mark_cycles)
        self.timeline = self.engine.timeline = new
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        old, self.timeline = self.timeline, None
        self.engine.timeline = None
        if old is not None:
            old.close()

    def record_failure(self, exc: BaseException) -> None:
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        consequence = isinstance(exc, HorovodInternalError)
        if not consequence:
            self.exit_reason = f"exited after an uncaught {summary}"
        if self.size > 1:
            kind = "consequence" if consequence else "root"
            self.store.set(FAILURE_SCOPE, f"failure.{self.rank}", f"{kind}\n{summary}".encode())

    # ------------------------------------------------------------------ handles
    def new_handle(self) -> int:
        return next(self._handle_ids)

    def stop(self, why: str = "called shutdown()") -> None:
        if self.stopped:
            return
        self.stopped = True
        self.engine.stop(why, timeout=max(10.0, self.config.timeout_seconds))
        if self.mpi is not None:
            self.mpi.close()
        self.stop_timeline()
        if self.autotuner is not None:
            self.autotuner.close()
        for ps_id, ps in list(self.public_sets.items()):
            if ps_id != 0 and ps.process_set_id == ps_id:
                ps.process_set_id = None
        self.handles.clear()
