"""Every HOROVOD_* knob, read in exactly one place.

``Config`` is a frozen dataclass; each field carries its environment variable, type, default
and help in its metadata. ``Config.from_env()`` parses them once (at ``hvd.init()``), with an
error that names the variable, the value and what is accepted. ``horovodrun`` maps its flags
onto these variables (``horovod.runner.launch``) and ``docs/configuration.md`` lists them;
``python -m horovod.common.config`` prints that table from this file.

Must not touch: the environment after ``from_env`` (no other module reads ``HOROVOD_*``), any
layer above.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from horovod.common.exceptions import ConfigError

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _knob(
    env: str,
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    choices: tuple[str, ...] | None = None,
    inert: bool = False,
) -> Any:
    meta = {"env": env, "help": help, "minimum": minimum, "choices": choices, "inert": inert}
    return field(default=default, metadata=meta)


def parse_bool(text: str) -> bool:
    """Upstream treats a number > 0 as true; words are accepted too."""
    t = text.strip().lower()
    if t in ("", "0", "false", "no", "off"):
        return False
    if t in ("true", "yes", "on"):
        return True
    try:
        return float(t) > 0
    except ValueError:
        raise ValueError("expected 1/0, true/false, yes/no or on/off") from None


@dataclass(frozen=True)
class Config:
    # --- engine ---------------------------------------------------------------------------
    fusion_threshold: int = _knob(
        "HOROVOD_FUSION_THRESHOLD",
        128 * 1024 * 1024,
        "Tensor Fusion buffer size in bytes; 0 disables fusion.",
        minimum=0,
    )
    cycle_time_ms: float = _knob(
        "HOROVOD_CYCLE_TIME",
        1.0,
        "Minimum time in ms between two negotiation rounds while work keeps arriving; "
        "an idle engine starts a round at once when a tensor is submitted.",
        minimum=0,
    )
    cache_capacity: int = _knob(
        "HOROVOD_CACHE_CAPACITY",
        1024,
        "Response cache entries per process set; 0 disables the cache.",
        minimum=0,
    )
    disable_group_fusion: bool = _knob(
        "HOROVOD_DISABLE_GROUP_FUSION",
        False,
        "Fuse the tensors of a grouped op only with each other.",
    )
    dynamic_process_sets: bool = _knob(
        "HOROVOD_DYNAMIC_PROCESS_SETS",
        False,
        "Allow hvd.add_process_set()/remove_process_set() after init.",
    )
    hierarchical_allreduce: bool = _knob(
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
        False,
        "Reduce within each host first, then across hosts (multi-host jobs only).",
    )
    hierarchical_allreduce_pieces: int = _knob(
        "HOROVOD_HIERARCHICAL_ALLREDUCE_PIECES",
        64,
        "Hierarchical allreduces of at least 1 MiB run as a pipeline over pieces of about 1 MiB "
        "(at least two), at most this many: the link between hosts carries some pieces while "
        "shared memory moves others (1: the three steps one after the other).",
        minimum=1,
    )
    hierarchical_allgather: bool = _knob(
        "HOROVOD_HIERARCHICAL_ALLGATHER",
        False,
        "Gather within each host first, then across hosts (multi-host jobs only).",
    )
    torus_allreduce: bool = _knob(
        "HOROVOD_TORUS_ALLREDUCE", False, "Accepted for compatibility; no effect.", inert=True
    )
    # --- diagnostics ----------------------------------------------------------------------
    timeline: str = _knob(
        "HOROVOD_TIMELINE",
        "",
        "Path of a Chrome-trace timeline written by rank 0, or DYNAMIC (hvd.start_timeline).",
    )
    timeline_mark_cycles: bool = _knob(
        "HOROVOD_TIMELINE_MARK_CYCLES",
        False,
        "Mark each coordinator round (CYCLE_START) in the timeline.",
    )
    stall_check_disable: bool = _knob(
        "HOROVOD_STALL_CHECK_DISABLE", False, "Disable the stall inspector."
    )
    stall_check_time_seconds: float = _knob(
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
        60.0,
        "Warn when a tensor has waited this long for some ranks.",
        minimum=0,
    )
    stall_shutdown_time_seconds: float = _knob(
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        0.0,
        "Abort the job when a tensor has waited this long (0: never).",
        minimum=0,
    )
    wait_summary_seconds: float = _knob(
        "HOROVOD_WAIT_SUMMARY_SECONDS",
        30.0,
        "Every this many seconds rank 0 logs (INFO) how long ranks waited for the slowest "
        "rank, and which rank that was (0: never).",
        minimum=0,
    )
    log_level: str = _knob(
        "HOROVOD_LOG_LEVEL", "WARNING", "Log level of the runtime.", choices=LOG_LEVELS
    )
    log_hide_time: bool = _knob(
        "HOROVOD_LOG_HIDE_TIME", False, "Leave timestamps out of log lines."
    )
    # --- autotune -------------------------------------------------------------------------
    autotune: bool = _knob(
        "HOROVOD_AUTOTUNE",
        False,
        "Tune fusion threshold, cycle time and response cache while training (rank 0 decides).",
    )
    autotune_log: str = _knob(
        "HOROVOD_AUTOTUNE_LOG", "", "CSV file with one row per configuration autotune scored."
    )
    autotune_warmup_samples: int = _knob(
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, "Autotune samples discarded at the start.", minimum=0
    )
    autotune_steps_per_sample: int = _knob(
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
        10,
        "Training steps (allreduces of one tensor) per autotune sample.",
        minimum=1,
    )
    autotune_bayes_opt_max_samples: int = _knob(
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        20,
        "Configurations the Bayesian optimisation scores.",
        minimum=1,
    )
    autotune_gaussian_process_noise: float = _knob(
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        0.8,
        "Observation noise of the Gaussian process (on standardised scores).",
        minimum=0,
    )
    # --- identity (the launcher contract) ---------------------------------------------------
    rank: int = _knob("HOROVOD_RANK", 0, "Global rank of this process.", minimum=0)
    size: int = _knob("HOROVOD_SIZE", 1, "Number of processes in the job.", minimum=1)
    local_rank: int = _knob("HOROVOD_LOCAL_RANK", 0, "Rank within this host.", minimum=0)
    local_size: int = _knob("HOROVOD_LOCAL_SIZE", 1, "Processes on this host.", minimum=1)
    cross_rank: int = _knob(
        "HOROVOD_CROSS_RANK", 0, "Index of this host among hosts with this local rank.", minimum=0
    )
    cross_size: int = _knob(
        "HOROVOD_CROSS_SIZE", 1, "Number of hosts with a process of this local rank.", minimum=1
    )
    hostname: str = _knob("HOROVOD_HOSTNAME", "", "Host name of this process (default: its own).")
    elastic: bool = _knob("HOROVOD_ELASTIC", False, "Elastic mode (set by the launcher).")
    elastic_timeout: float = _knob(
        "HOROVOD_ELASTIC_TIMEOUT",
        600.0,
        "Elastic: seconds to wait for enough slots (at least --min-np) before failing.",
        minimum=0,
    )
    elastic_slot: str = _knob(
        "HOROVOD_ELASTIC_SLOT", "", "Elastic: this worker's slot, host:index (set by horovodrun)."
    )
    elastic_round: int = _knob(
        "HOROVOD_ELASTIC_ROUND",
        0,
        "Elastic: the membership round a new worker was started for (set by horovodrun).",
        minimum=0,
    )
    elastic_worker_id: str = _knob(
        "HOROVOD_ELASTIC_WORKER_ID", "", "Elastic: this process's id (set by horovodrun)."
    )
    elastic_discovery_seconds: float = _knob(
        "HOROVOD_ELASTIC_DISCOVERY_SECONDS",
        1.0,
        "Elastic: how often horovodrun runs the host discovery script.",
        minimum=0.01,
    )
    elastic_poll_seconds: float = _knob(
        "HOROVOD_ELASTIC_POLL_SECONDS",
        1.0,
        "Elastic: how often a worker looks for host changes announced by horovodrun.",
        minimum=0.01,
    )
    # --- transport and rendezvous -----------------------------------------------------------
    controller: str = _knob(
        "HOROVOD_CONTROLLER",
        "gloo",
        "Controller: gloo (start-up through horovodrun's rendezvous) or mpi (start-up over "
        "MPI: the workers must be started by mpirun). Negotiation is pyhorovod's own either way.",
        choices=("gloo", "mpi"),
    )
    cpu_operations: str = _knob(
        "HOROVOD_CPU_OPERATIONS",
        "",
        "CPU data plane: mpi (MPI's collectives through mpi4py; set by horovodrun --mpi) or "
        "gloo (the built-in shared-memory and TCP planes). Unset: the built-in planes, or MPI "
        "for a job started with hvd.init(comm=...).",
        choices=("gloo", "mpi", "ccl"),
    )
    gpu_operations: str = _knob(
        "HOROVOD_GPU_OPERATIONS",
        "",
        "CUDA tensors: nccl (the device plane: NCCL on a stream of its own, where every rank "
        "of the process set has a GPU of its own and NCCL is present) or staged (through "
        "pinned host memory and the CPU data plane; mpi and gloo mean the same). Unset: nccl "
        "where it can run, staged elsewhere (docs/gpu.md).",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    gpu_allreduce: str = _knob(
        "HOROVOD_GPU_ALLREDUCE",
        "",
        "Overrides HOROVOD_GPU_OPERATIONS for allreduce on CUDA tensors.",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    gpu_allgather: str = _knob(
        "HOROVOD_GPU_ALLGATHER",
        "",
        "Overrides HOROVOD_GPU_OPERATIONS for allgather on CUDA tensors.",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    gpu_broadcast: str = _knob(
        "HOROVOD_GPU_BROADCAST",
        "",
        "Overrides HOROVOD_GPU_OPERATIONS for broadcast on CUDA tensors.",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    gpu_alltoall: str = _knob(
        "HOROVOD_GPU_ALLTOALL",
        "",
        "Overrides HOROVOD_GPU_OPERATIONS for alltoall on CUDA tensors.",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    gpu_reducescatter: str = _knob(
        "HOROVOD_GPU_REDUCESCATTER",
        "",
        "Overrides HOROVOD_GPU_OPERATIONS for reducescatter on CUDA tensors.",
        choices=("nccl", "staged", "mpi", "gloo"),
    )
    device_plane_test: str = _knob(
        "HOROVOD_DEVICE_PLANE_TEST",
        "",
        "Testing the device plane without a GPU: gloo treats CPU torch tensors as device "
        "tensors and runs the device plane's collectives with PyTorch's Gloo process group "
        "standing in for NCCL (streams become host stand-ins that check their ordering); "
        "shared does the same with every rank of a host on one stand-in device, so that "
        "allreduce, broadcast and allgather take the shared-GPU path through host shared "
        "memory.",
        choices=("gloo", "shared"),
    )
    shared_memory: bool = _knob(
        "HOROVOD_SHARED_MEMORY",
        True,
        "Move data between ranks on the same host through shared memory (TCP otherwise).",
    )
    tcp_polled_control: bool = _knob(
        "HOROVOD_TCP_POLLED_CONTROL",
        True,
        "Where ranks talk over TCP (alone, or between hosts under shared memory), the thread "
        "that waits for a result reads the control connections itself instead of reader "
        "threads handing messages to the engine thread (small operations pay no thread "
        "hand-offs); with TCP alone in jobs of up to 8 ranks, peer rounds run over board "
        "connections too. Every rank must agree.",
    )
    shm_chunk_bytes: int = _knob(
        "HOROVOD_SHM_CHUNK_BYTES",
        1024 * 1024,
        "Shared-memory slot size: large messages move in chunks of this size, pipelined.",
        minimum=4096,
    )
    shm_slots: int = _knob(
        "HOROVOD_SHM_SLOTS",
        4,
        "Shared-memory slots per pair of ranks (chunks in flight between two ranks).",
        minimum=1,
    )
    shm_single_copy_bytes: int = _knob(
        "HOROVOD_SHM_SINGLE_COPY_BYTES",
        2 * 1024 * 1024,
        "Messages between ranks of one host of more than one slot and at least this many "
        "bytes are read straight from the sender's memory (Linux cross-memory attach: one "
        "copy instead of two; a two-rank broadcast is split, the root writing half into the "
        "receiver while it reads the other half), where every rank of the host can; 0 turns "
        "it off.",
        minimum=0,
    )
    spin_microseconds: float = _knob(
        "HOROVOD_SPIN_MICROSECONDS",
        100.0,
        "Shared-memory and TCP jobs: how long a waiting rank polls (for a peer's data, or for "
        "the result a thread waits for while it runs the engine) before it sleeps until woken "
        "(0: sleep at once). Where ranks outnumber the machine's cores (every rank on the "
        "machine counts, whatever host name it has), polls yield the CPU and last ten times as "
        "long: a yielding poll holds no core a peer needs, and each sleep costs a wake-up.",
        minimum=0,
    )
    output_pool_bytes: int = _knob(
        "HOROVOD_OUTPUT_POOL_BYTES",
        256 * 1024 * 1024,
        "NumPy API: outputs of 1 MiB and more are reused from a pool of at most this many bytes "
        "once no view of them is alive (saves the page faults of fresh memory), and results of "
        "allgathers of 128 KiB to 1 MiB per rank between ranks of one host may live in shared "
        "memory (saves a copy); 0 disables both.",
        minimum=0,
    )
    eager_allreduce_bytes: int = _knob(
        "HOROVOD_EAGER_ALLREDUCE_BYTES",
        16 * 1024,
        "Allreduces of at most this many bytes per rank that hit the response cache travel "
        "with their request to the coordinator, which reduces them and sends the result with "
        "its response list: one message round instead of two (0 turns it off). Where peer "
        "rounds run (see HOROVOD_PEER_ROUNDS), allreduces go to a peer round instead, with "
        "their data, up to one post's room on the board (1 MiB in shared memory, 256 KiB "
        "over TCP) over the other ranks where all ranks share one host and the data plane is "
        "the project's own (or, with MPI's, there are 2 ranks), up to this value otherwise (0 "
        "turns that off too).",
        minimum=0,
    )
    peer_rounds: bool = _knob(
        "HOROVOD_PEER_ROUNDS",
        True,
        "When every rank shares one host (shared memory), or every rank talks over TCP alone "
        "in a job of at most 8 ranks, ops that hit the response cache (alone in flight on "
        "their rank) are posted to every peer and run by every rank itself once all of them "
        "posted the same, without a round through rank 0: small ones with their data on the "
        "board, the rest on the data plane (0 turns it off).",
    )
    gradient_bucket_bytes: int = _knob(
        "HOROVOD_GRADIENT_BUCKET_BYTES",
        8 * 1024 * 1024,
        "horovod.torch DistributedOptimizer: gradients are reduced in fixed buckets of up to "
        "this many bytes (parameters in reverse order, one dtype per bucket), each flattened "
        "into one tensor and reduced as one allreduce once all of its gradients are ready; "
        "0: one allreduce per gradient (submitted in batches), as upstream Horovod does.",
        minimum=0,
    )
    ring_threshold_bytes: int = _knob(
        "HOROVOD_RING_THRESHOLD_BYTES",
        128 * 1024,
        "Allreduce/allgather/broadcast payloads above this use the bandwidth-optimal ring or "
        "pipelined chain (allreduces over more than 2 ranks up to 512 KiB: the ordered "
        "reduction, which combines in rank order); at or below, latency-optimal direct "
        "exchange / recursive doubling / binomial tree.",
        minimum=0,
    )
    rendezvous_addr: str = _knob(
        "HOROVOD_GLOO_RENDEZVOUS_ADDR", "", "Address of the rendezvous store (set by horovodrun)."
    )
    rendezvous_port: int = _knob(
        "HOROVOD_GLOO_RENDEZVOUS_PORT", -1, "Port of the rendezvous store (set by horovodrun)."
    )
    run_func_store: str = _knob(
        "HOROVOD_RUN_FUNC_STORE",
        "",
        "host:port of the store horovod.run's function and results travel through, where it is "
        "not the job's rendezvous store (set by horovodrun for horovod.run(use_mpi=True), whose "
        "ranks start up on rank 0's store). Unset: the rendezvous store.",
    )
    rendezvous_scope: str = _knob(
        "HOROVOD_RENDEZVOUS_SCOPE",
        "",
        "The job's name in the rendezvous store, for workers that live longer than one job "
        "(Spark's reused Python workers; set by horovod.spark.run and horovod.ray). Unset: "
        "each process counts its own hvd.init() calls.",
    )
    iface: str = _knob(
        "HOROVOD_GLOO_IFACE",
        "",
        "Network interface(s) the data plane uses, comma-separated: the first this host has.",
    )
    timeout_seconds: float = _knob(
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
        30.0,
        "How long rendezvous and connection set-up may take.",
        minimum=0,
    )
    secret_key: str = _knob(
        "HOROVOD_SECRET_KEY",
        "",
        "The job's secret (hex); every rendezvous request and connection proves it. "
        "horovodrun creates it; never put it on a command line.",
    )
    start_timeout: float = _knob(
        "HOROVOD_START_TIMEOUT", 30.0, "Seconds horovodrun waits for workers to start.", minimum=0
    )
    spark_start_timeout: float = _knob(
        "HOROVOD_SPARK_START_TIMEOUT",
        600.0,
        "horovod.spark.run: seconds its tasks may take to find each other at hvd.init() "
        "(start_timeout= overrides it).",
        minimum=0,
    )
    ssh_keepalive_seconds: float = _knob(
        "HOROVOD_SSH_KEEPALIVE_SECONDS",
        5.0,
        "horovodrun: ssh keep-alive interval to other hosts; a host silent for 3 of them is "
        "lost and the job stops (0 = no keep-alives).",
        minimum=0,
    )
    stop_grace_seconds: float = _knob(
        "HOROVOD_STOP_GRACE_SECONDS",
        5.0,
        "horovodrun: seconds a stopped worker gets between SIGTERM and SIGKILL.",
        minimum=0,
    )
    # --- accepted for compatibility, no effect in a CPU/TCP build ---------------------------
    thread_affinity: str = _knob(
        "HOROVOD_THREAD_AFFINITY", "", "Accepted for compatibility; no effect.", inert=True
    )
    num_nccl_streams: int = _knob(
        "HOROVOD_NUM_NCCL_STREAMS", 1, "Accepted for compatibility; no effect.", inert=True
    )
    mpi_threads_disable: bool = _knob(
        "HOROVOD_MPI_THREADS_DISABLE",
        False,
        "MPI jobs: initialise MPI with MPI_THREAD_SERIALIZED instead of MPI_THREAD_MULTIPLE "
        "(where Horovod is the first to import mpi4py).",
    )
    enable_async_completion: bool = _knob(
        "HOROVOD_ENABLE_ASYNC_COMPLETION",
        False,
        "Accepted for compatibility; no effect.",
        inert=True,
    )

    # ------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"])
            if raw is None or raw.strip() == "":
                continue
            values[f.name] = _parse_field(f, raw)
        values.update(overrides)
        cfg = cls(**values)
        if not cfg.hostname:
            cfg = dataclasses.replace(cfg, hostname=socket.gethostname())
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{env_of(name)}={getattr(self, name)!r}: {why}")

        if self.rank >= self.size:
            raise bad("rank", f"must be smaller than HOROVOD_SIZE={self.size}")
        if self.local_rank >= self.local_size:
            raise bad("local_rank", f"must be smaller than HOROVOD_LOCAL_SIZE={self.local_size}")
        if self.cross_rank >= self.cross_size:
            raise bad("cross_rank", f"must be smaller than HOROVOD_CROSS_SIZE={self.cross_size}")
        if self.secret_key:
            try:
                bytes.fromhex(self.secret_key)
            except ValueError:
                raise bad("secret_key", "must be a hex string (horovodrun makes one)") from None

    @property
    def log_level_name(self) -> str:
        return self.log_level.upper()


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One knob (by field name) from the environment, parsed and checked as ``from_env`` does;
    for the launcher, which must not validate a worker's whole identity."""
    env = os.environ if environ is None else environ
    f = {f.name: f for f in dataclasses.fields(Config)}[name]
    raw = env.get(f.metadata["env"])
    if raw is None or raw.strip() == "":
        return f.default
    return _parse_field(f, raw)


def env_of(name: str) -> str:
    return {f.name: f.metadata["env"] for f in dataclasses.fields(Config)}[name]


def _parse_field(f: dataclasses.Field, raw: str) -> Any:
    env = f.metadata["env"]
    typ = type(f.default)
    try:
        if typ is bool:
            value: Any = parse_bool(raw)
        elif typ is int:
            value = int(raw.strip())
        elif typ is float:
            value = float(raw)
        else:
            value = raw.strip()
    except ValueError as e:
        kind = {bool: "a boolean", int: "an integer", float: "a number"}.get(typ, "a string")
        raise ConfigError(f"{env}={raw!r} is not {kind} ({e}); unset it or fix the value") from None
    choices = f.metadata["choices"]
    if choices is not None:
        if value.upper() in choices:
            value = value.upper()
        elif value.lower() in choices:
            value = value.lower()
        else:
            raise ConfigError(f"{env}={raw!r} is not one of {', '.join(choices)}")
    minimum = f.metadata["minimum"]
    if minimum is not None and value < minimum:
        raise ConfigError(f"{env}={raw!r} must be >= {minimum}")
    return value


def knob_table() -> list[tuple[str, str, str]]:
    """(variable, default, help) for every knob, for docs and ``--help`` texts."""
    rows = []
    for f in dataclasses.fields(Config):
        default = f.default
        shown = (
            "(unset)"
            if default == ""
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        rows.append((f.metadata["env"], shown, f.metadata["help"]))
    return rows


def env_names() -> frozenset[str]:
    return frozenset(f.metadata["env"] for f in dataclasses.fields(Config))


if __name__ == "__main__":  # pragma: no cover - documentation helper
    print("| variable | default | meaning |\n|---|---|---|")
    for env, default, help_ in knob_table():
        print(f"| `{env}` | {default} | {help_} |")


# Where a process launched by horovodrun, mpirun or another PMI launcher finds its rank and the
# job's size (upstream's ``horovod.runner.common.util.env.get_env_rank_and_size``), in order.
RANK_AND_SIZE_VARIABLES = (
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


def env_rank_and_size(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, size) from the first launcher's pair of variables that is set; (0, 1) when none
    is. RuntimeError when only one variable of a pair is set."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in RANK_AND_SIZE_VARIABLES:
        rank, size = env.get(rank_var), env.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(
                f"cannot tell this process's rank and the job's size: {rank_var if rank else size_var}"
                f" is set but {size_var if rank else rank_var} is not"
            )
    return 0, 1
