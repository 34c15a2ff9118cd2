"""``horovodrun``: start a training job's worker processes.

    horovodrun -np 4 python train.py
    horovodrun -np 4 -H localhost:4 --fusion-threshold-mb 32 python train.py

The launcher never imports the training runtime. It hosts the rendezvous store, makes a fresh
secret for the job (handed to workers through their environment, never on a command line),
starts one process per slot with upstream's ``HOROVOD_*`` environment contract, prefixes their
output with ``[rank]<stdout>:``/``[rank]<stderr>:``, stops every worker on the first failure or
on Ctrl-C/SIGTERM, and prints the root cause last.

Must not touch: the training runtime (it starts processes with the ``HOROVOD_*`` environment).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence

from horovod import __version__
from horovod.common import util
from horovod.common.config import LOG_LEVELS, setting
from horovod.common.exceptions import ConfigError
from horovod.common.secret import make_secret
from horovod.rendezvous.server import RendezvousServer
from horovod.runner import mpi_run, ssh
from horovod.runner.config_file import parse_with_config
from horovod.runner.elastic.discovery import DiscoveryError, FixedHosts, ScriptDiscovery
from horovod.runner.elastic.launch import run_elastic
from horovod.runner.hosts import (
    assign_slots,
    is_local,
    lsf_hosts,
    parse_hostfile,
    parse_hosts,
)
from horovod.runner.interrupts import on_interrupt
from horovod.runner.procs import Command, Job


def _nonneg(kind: type):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
        return v

    return parse


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="horovodrun",
        allow_abbrev=False,  # options of the training command must not match ours
        description="Launch a Horovod training job (pyhorovod).",
        epilog="Example: horovodrun -np 2 python examples/numpy_digits.py",
    )
    p.add_argument("-v", "--version", action="version", version=f"pyhorovod {__version__}")
    p.add_argument(
        "-np", "--num-proc", dest="np", type=_nonneg(int), help="number of worker processes"
    )
    p.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show which frameworks, controllers and operations are available",
    )
    p.add_argument("--disable-cache", action="store_true", help="accepted for compatibility")
    p.add_argument(
        "--start-timeout",
        type=_nonneg(float),
        help="seconds every rank may take to reach hvd.init() (default: "
        "HOROVOD_START_TIMEOUT or 30)",
    )
    p.add_argument("--verbose", action="store_true", help="print what the launcher does")
    p.add_argument(
        "--config-file",
        help="YAML file with upstream's keys (params, autotune, timeline, stall_check, "
        "library_options, logging); overrides flags before it, overridden by flags after it",
    )
    p.add_argument(
        "--output-filename", help="also write each rank's output to DIR/rank.N/stdout and stderr"
    )
    p.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        action="store_true",
        help="prefix each output line with the time",
    )
    sp = p.add_argument_group("ssh (hosts other than this one)")
    sp.add_argument("-p", "--ssh-port", type=_port, help="ssh port on all hosts")
    sp.add_argument("-i", "--ssh-identity-file", help="ssh private key file")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", help="file of lines '<host> slots=<n>'")
    ctl = p.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", action="store_true", help="use the built-in TCP engine (default)")
    ctl.add_argument(
        "--mpi",
        action="store_true",
        help="start the workers with the installed mpirun and move data through MPI (docs/mpi.md)",
    )
    tun = p.add_argument_group("tunables")
    tun.add_argument(
        "--fusion-threshold-mb",
        type=_nonneg(int),
        help="Tensor Fusion buffer in MiB (default 128; 0 disables fusion)",
    )
    tun.add_argument(
        "--cycle-time-ms",
        type=_nonneg(float),
        help="minimum ms between negotiation rounds under load (default 1)",
    )
    tun.add_argument(
        "--cache-capacity",
        type=_nonneg(int),
        help="response cache entries (default 1024; 0 disables)",
    )
    for flag in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        g = tun.add_mutually_exclusive_group()
        dest = flag.replace("-", "_")
        g.add_argument(f"--{flag}", dest=dest, action="store_true", default=None)
        g.add_argument(f"--no-{flag}", dest=dest, action="store_false")
    at = p.add_argument_group("autotune")
    at.add_argument("--autotune", action="store_true", default=None)
    at.add_argument("--no-autotune", dest="autotune", action="store_false", help=argparse.SUPPRESS)
    at.add_argument("--autotune-log-file")
    at.add_argument("--autotune-warmup-samples", type=_nonneg(int))
    at.add_argument("--autotune-steps-per-sample", type=_nonneg(int))
    at.add_argument("--autotune-bayes-opt-max-samples", type=_nonneg(int))
    at.add_argument("--autotune-gaussian-process-noise", type=_nonneg(float))
    tl = p.add_argument_group("timeline")
    tl.add_argument("--timeline-filename")
    tl.add_argument("--timeline-mark-cycles", action="store_true", default=None)
    st = p.add_argument_group("stall check")
    st.add_argument("--no-stall-check", dest="stall_check", action="store_false", default=None)
    st.add_argument(
        "--stall-check", dest="stall_check", action="store_true", help=argparse.SUPPRESS
    )
    st.add_argument("--stall-check-warning-time-seconds", type=_nonneg(float))
    st.add_argument("--stall-check-shutdown-time-seconds", type=_nonneg(float))
    lib = p.add_argument_group("library")
    lib.add_argument(
        "--gloo-timeout-seconds",
        type=_nonneg(float),
        help="seconds allowed for connection set-up (default 30)",
    )
    lib.add_argument(
        "--network-interfaces",
        "--network-interface",
        dest="nics",
        action="append",
        help="interfaces for the job's traffic, comma-separated or repeated (e.g. eth0); each "
        "host uses the first of them it has. Default: the interface each host routes to the "
        "launcher through",
    )
    lib.add_argument("--mpi-threads-disable", action="store_true", default=None)
    lib.add_argument("--num-nccl-streams", type=_nonneg(int))
    lib.add_argument("--thread-affinity", type=_nonneg(int))
    lib.add_argument(
        "--tcp",
        action="store_true",
        help="--mpi: MPI over TCP only (no fabric transports); NCCL_IB_DISABLE=1 for NCCL",
    )
    lib.add_argument(
        "--mpi-args", help='--mpi: extra arguments for mpirun, e.g. "--mca btl_tcp_if_include eth0"'
    )
    lg = p.add_argument_group("logging")
    lg.add_argument("--log-level", choices=LOG_LEVELS, type=str.upper)
    lg.add_argument(
        "--log-without-timestamp",
        "--log-hide-timestamp",
        dest="log_hide_time",
        action="store_true",
        default=None,
    )
    el = p.add_argument_group(
        "elastic (docs/elastic.md): given --min-np or --host-discovery-script, the job survives "
        "lost workers and grows and shrinks with the hosts"
    )
    el.add_argument(
        "--min-np", "--min-num-proc", dest="min_np", type=_positive, help="fewest workers"
    )
    el.add_argument(
        "--max-np", "--max-num-proc", dest="max_np", type=_positive, help="most workers"
    )
    el.add_argument(
        "--host-discovery-script",
        help="executable printing the usable hosts, one 'host:slots' (or 'host') per line; "
        "run every second",
    )
    el.add_argument(
        "--slots",
        "--slots-per-host",
        dest="slots",
        type=_positive,
        help="slots of a host the discovery script prints without ':slots'",
    )
    el.add_argument("--reset-limit", type=_nonneg(int), help="fail the job after this many resets")
    el.add_argument(
        "--blacklist-cooldown-range",
        type=_nonneg(float),
        nargs=2,
        metavar=("MIN", "MAX"),
        help="a blacklisted host comes back after a cooldown between MIN and MAX seconds, "
        "doubling with each blacklisting (default: never)",
    )
    el.add_argument(
        "--elastic-timeout",
        type=_nonneg(float),
        help="seconds to wait for --min-np slots (default HOROVOD_ELASTIC_TIMEOUT or 600)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def _positive(text: str) -> int:
    v = _nonneg(int)(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return v


def env_from_args(a: argparse.Namespace) -> dict[str, str]:
    """Launcher flags -> worker HOROVOD_* variables (only for flags that were given)."""
    env: dict[str, str] = {}

    def put(var: str, value: object) -> None:
        if value is not None:
            env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)

    put(
        "HOROVOD_FUSION_THRESHOLD",
        None if a.fusion_threshold_mb is None else a.fusion_threshold_mb * 1024 * 1024,
    )
    put("HOROVOD_CYCLE_TIME", None if a.cycle_time_ms is None else float(a.cycle_time_ms))
    put("HOROVOD_CACHE_CAPACITY", a.cache_capacity)
    put("HOROVOD_HIERARCHICAL_ALLREDUCE", a.hierarchical_allreduce)
    put("HOROVOD_HIERARCHICAL_ALLGATHER", a.hierarchical_allgather)
    put("HOROVOD_TORUS_ALLREDUCE", a.torus_allreduce)
    if a.autotune:
        put("HOROVOD_AUTOTUNE", True)
        put("HOROVOD_AUTOTUNE_LOG", a.autotune_log_file)
        put("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", a.autotune_warmup_samples)
        put("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", a.autotune_steps_per_sample)
        put("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", a.autotune_bayes_opt_max_samples)
        put("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", a.autotune_gaussian_process_noise)
    if a.timeline_filename:
        put("HOROVOD_TIMELINE", a.timeline_filename)
        put("HOROVOD_TIMELINE_MARK_CYCLES", a.timeline_mark_cycles)
    if a.stall_check is not None:
        put("HOROVOD_STALL_CHECK_DISABLE", not a.stall_check)
    put("HOROVOD_STALL_CHECK_TIME_SECONDS", a.stall_check_warning_time_seconds)
    put("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", a.stall_check_shutdown_time_seconds)
    put("HOROVOD_GLOO_TIMEOUT_SECONDS", a.gloo_timeout_seconds)
    put("HOROVOD_START_TIMEOUT", a.start_timeout)
    put("HOROVOD_MPI_THREADS_DISABLE", a.mpi_threads_disable)
    put("HOROVOD_NUM_NCCL_STREAMS", a.num_nccl_streams)
    put("HOROVOD_THREAD_AFFINITY", a.thread_affinity)
    put("HOROVOD_LOG_LEVEL", a.log_level)
    put("HOROVOD_LOG_HIDE_TIME", a.log_hide_time)
    if a.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def check_build() -> str:
    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    def have(mod: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(mod) is not None

    frameworks = [
        ("TensorFlow", have("horovod.tensorflow") and have("tensorflow")),
        ("PyTorch", have("horovod.torch") and have("torch")),
        ("MXNet", have("horovod.mxnet") and have("mxnet")),
        ("NumPy", True),
    ]
    mpi_ops = util.mpi_built()
    nccl = util.nccl_built() > 0
    lines = [f"Horovod v{__version__} (pyhorovod):", "", "Available Frameworks:"]
    lines += [f"    {mark(ok)} {name}" for name, ok in frameworks]
    lines += [
        "",
        "Available Controllers:",
        f"    {mark(mpi_ops and shutil.which('mpirun') is not None)} MPI",
        f"    {mark(True)} Gloo",
        "",
        "Available Tensor Operations:",
    ]
    lines += [
        f"    {mark(n == 'Gloo' or (n == 'MPI' and mpi_ops) or (n == 'NCCL' and nccl))} {n}"
        for n in ("NCCL", "DDL", "CCL", "MPI", "Gloo")
    ]
    return "\n".join(lines)


def _error(msg: str) -> int:
    print(f"horovodrun: error: {msg}", file=sys.stderr)
    return 2


def main(
    argv: Sequence[str] | None = None,
    *,
    seed: dict[tuple[str, str], bytes] | None = None,
    harvest: Callable[[RendezvousServer], None] | None = None,
) -> int:
    """horovodrun. ``seed`` entries are put into the job's rendezvous store before any worker
    starts and ``harvest(server)`` reads it after all have exited (``horovod.run`` moves the
    function and its results this way, so they reach ranks on every host)."""
    parser = build_parser()
    a = parse_with_config(parser, list(sys.argv[1:] if argv is None else argv))
    if a.check_build:
        print(check_build())
        return 0
    try:
        lsf = None if (a.hosts or a.hostfile) else lsf_hosts(os.environ)
    except ValueError as e:
        return _error(str(e))
    elastic = a.host_discovery_script is not None or a.min_np is not None
    if a.np is None and elastic:
        a.np = a.min_np
    if a.np is None and lsf is not None:  # under LSF, -np defaults to the job's slots
        a.np = sum(h.slots for h in lsf)
    if a.np is None:
        return _error(
            "-np/--num-proc is required (the number of worker processes; for elastic jobs "
            "--min-np will do)"
        )
    if a.np == 0:
        return _error("-np must be at least 1")
    if elastic:
        a.min_np = a.min_np or a.np
        if a.min_np > a.np or (a.max_np is not None and a.max_np < a.np):
            return _error(
                f"elastic sizes must satisfy --min-np <= -np <= --max-np; got {a.min_np} <= "
                f"{a.np} <= {a.max_np}"
            )
        if a.host_discovery_script is not None and (a.hosts or a.hostfile):
            return _error("give either --host-discovery-script or -H/--hostfile, not both")
        cool = a.blacklist_cooldown_range
        if cool is not None and not (1 <= cool[0] <= cool[1] <= 3600):
            return _error(
                "--blacklist-cooldown-range MIN MAX needs 1 <= MIN <= MAX <= 3600 (seconds); "
                f"got {cool[0]:g} {cool[1]:g}"
            )
    elif a.max_np is not None or a.reset_limit is not None or a.blacklist_cooldown_range:
        return _error(
            "--max-np, --reset-limit and --blacklist-cooldown-range are for elastic jobs: "
            "add --min-np or --host-discovery-script"
        )
    command = list(a.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return _error("no training command given, e.g. horovodrun -np 2 python train.py")
    if a.mpi and elastic:
        return _error(
            "elastic jobs run on horovodrun's own launcher: drop --mpi (the built-in planes "
            "need no MPI)"
        )
    discovery: ScriptDiscovery | FixedHosts | None = None
    try:
        if a.host_discovery_script is not None:
            discovery = ScriptDiscovery(a.host_discovery_script, a.slots)
            hosts = discovery.find()
        else:
            hosts = (
                parse_hostfile(a.hostfile)
                if a.hostfile
                else parse_hosts(a.hosts)
                if a.hosts
                else lsf
                if lsf is not None
                else parse_hosts(f"localhost:{a.np}")
            )
            if elastic:
                discovery = FixedHosts(hosts)
        slots = [] if elastic else assign_slots(hosts, a.np)
    except (OSError, ValueError, DiscoveryError) as e:
        return _error(str(e))
    if a.mpi:
        return _run_mpi(a, hosts, command, seed, harvest)
    try:
        keepalive = setting("ssh_keepalive_seconds")
        grace = setting("stop_grace_seconds")
    except ConfigError as e:
        return _error(str(e))
    nics = [n.strip() for item in (a.nics or []) for n in item.split(",") if n.strip()]
    names = dict.fromkeys(h.hostname for h in hosts)  # each host resolved once, in order
    remote = [h for h in names if not is_local(h)]
    runs_here = elastic or any(s.hostname not in remote for s in slots)
    if runs_here and shutil.which(command[0]) is None and not os.path.exists(command[0]):
        return _error(f"command not found: {command[0]}")
    addr = "127.0.0.1"
    if remote:
        unreachable = ssh.check_reachable(remote, port=a.ssh_port, identity=a.ssh_identity_file)
        if unreachable:
            return _error(
                "cannot start workers over ssh on "
                + "; ".join(f"{h}: {why}" for h, why in unreachable.items())
                + " (horovodrun needs password-less ssh to every host: see -p/--ssh-port, "
                "-i/--ssh-identity-file and docs/multi-host.md)"
            )
        try:
            addr = ssh.launcher_address(remote, nics)
        except (OSError, ValueError) as e:
            return _error(f"cannot choose the address workers reach the launcher at: {e}")
    elif a.host_discovery_script is not None:
        # Hosts the script adds later may be other machines: every worker, local ones too,
        # must use an address they can reach.
        try:
            addr = ssh.routable_address(nics)
        except (OSError, ValueError) as e:
            return _error(f"cannot choose the address workers reach the launcher at: {e}")

    secret, server = _store(addr, seed)
    base = ssh.exportable(os.environ)
    base.update(env_from_args(a))
    base.update(
        {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_SECRET_KEY": secret,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if nics:
        base["HOROVOD_GLOO_IFACE"] = ",".join(nics)
        base["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    supervisor = ssh.supervisor_command()
    here = ssh.cwd()
    local_names: dict[str, bool] = {h: h not in remote for h in names}

    def make_command(host: str, rank: int, slot_env: dict[str, str]) -> Command:
        env = dict(base)
        env.update(slot_env)
        if host not in local_names:  # a host discovered later
            local_names[host] = is_local(host)
        if local_names[host]:
            # A local worker inherits what remote ones may not get (upstream's workers on the
            # launcher's host inherit its whole environment): CUDA_VISIBLE_DEVICES above all,
            # or local_rank would pick among GPUs the user hid.
            return Command(rank, host, command, {**ssh.host_only(os.environ), **env})
        argv = ssh.ssh_command(
            host,
            supervisor,
            port=a.ssh_port,
            identity=a.ssh_identity_file,
            keepalive_seconds=keepalive,
        )
        return Command(rank, host, argv, dict(os.environ), ssh.payload(command, env, here))

    if elastic:
        try:
            status = run_elastic(a, server, discovery, make_command, base, grace, secret)
            if harvest is not None:
                harvest(server)
            return status
        finally:
            server.stop()
    commands = [make_command(s.hostname, s.rank, s.env()) for s in slots]
    if a.verbose:
        print(
            f"horovodrun: {a.np} processes on {', '.join(f'{h.hostname}:{h.slots}' for h in hosts)}"
            f"; rendezvous on {addr}:{server.port}; command: {' '.join(command)}",
            file=sys.stderr,
        )
        for c in commands:
            if c.stdin is not None:
                print(f"horovodrun: rank {c.rank}: {' '.join(c.argv)}", file=sys.stderr)

    def failure_note(rank: int) -> tuple[str, str] | None:
        raw = server.get("job", f"failure.{rank}")
        if raw is None:
            return None
        kind, _, summary = raw.decode("utf-8", "replace").partition("\n")
        return kind, summary

    def diagnosis() -> tuple[int, str] | None:
        raw = server.get("job", "diagnosis")
        if raw is None:
            return None
        rank, _, text = raw.decode("utf-8", "replace").partition("\n")
        return int(rank), text

    job = Job(
        commands,
        timestamp=a.prefix_output_with_timestamp,
        output_dir=a.output_filename,
        grace_seconds=grace,
        failure_note=failure_note,
        diagnosis=diagnosis,
    )

    def on_signal(signum: int, _frame: object) -> None:
        job.interrupt(signal.Signals(signum).name)

    try:
        with on_interrupt(on_signal):
            job.start()
            status = job.wait()
            report = job.report()
            if harvest is not None:
                harvest(server)
    except RuntimeError as e:
        return _error(str(e))
    finally:
        server.stop()
        # Shared-memory segments are unlinked once every local rank has mapped them; a rank
        # killed during set-up can leave its own behind: remove this job's.
        from horovod.common.shm_names import cleanup_job

        cleanup_job(bytes.fromhex(secret))
    if report:
        print(report, file=sys.stderr)
    return status


def _store(addr: str, seed: dict[tuple[str, str], bytes] | None) -> tuple[str, RendezvousServer]:
    """The job's secret and the launcher's store (reached at ``addr``), holding ``seed``."""
    secret = make_secret()
    server = RendezvousServer(
        bytes.fromhex(secret), host="127.0.0.1" if addr == "127.0.0.1" else "0.0.0.0"
    ).start()
    for (scope, key), value in (seed or {}).items():
        server.put(scope, key, value)
    return secret, server


def _run_mpi(
    a: argparse.Namespace,
    hosts: list,
    command: list[str],
    seed: dict[tuple[str, str], bytes] | None = None,
    harvest: Callable[[RendezvousServer], None] | None = None,
) -> int:
    """``--mpi``: the installed mpirun starts the workers (``horovod.runner.mpi_run``). With
    ``seed``/``harvest`` (``horovod.run(use_mpi=True)``), a store of the launcher's for them, as
    on its own launcher (the ranks start up on rank 0's, as under any mpirun)."""
    try:
        mpirun = mpi_run.find_mpirun()
        impl = mpi_run.implementation(mpirun)
    except RuntimeError as e:
        return _error(str(e))
    nics = [n.strip() for item in (a.nics or []) for n in item.split(",") if n.strip()]
    env = mpi_run.worker_env(ssh.exportable(os.environ), env_from_args(a))
    server = None
    if seed is not None or harvest is not None:
        remote = [h for h in dict.fromkeys(h.hostname for h in hosts) if not is_local(h)]
        try:
            addr = ssh.launcher_address(remote, nics) if remote else "127.0.0.1"
        except (OSError, ValueError) as e:
            return _error(f"cannot choose the address workers reach the launcher at: {e}")
        secret, server = _store(addr, seed)
        # (run_task's store; rank 0 serves the job's rendezvous, with the same secret)
        env["HOROVOD_RUN_FUNC_STORE"] = f"{addr}:{server.port}"
        env["HOROVOD_SECRET_KEY"] = secret
    env_names = [k for k in env if not mpi_run.LAUNCHER_OWN.match(k)]
    env.update(mpi_run.launcher_env(impl, a.ssh_port, a.ssh_identity_file))
    hostfile = mpi_run.write_hostfile(hosts) if impl == mpi_run.MPICH else None
    try:
        argv = mpi_run.command(
            impl,
            mpirun=mpirun,
            np=a.np,
            hosts=hosts,
            env_names=env_names,
            train=command,
            mpi_args=a.mpi_args,
            nics=nics,
            ssh_port=a.ssh_port,
            ssh_identity=a.ssh_identity_file,
            tcp=a.tcp,
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            hostfile=hostfile,
        )
        status = mpi_run.run(
            argv, env, a.verbose, a.output_filename, a.np, a.prefix_output_with_timestamp
        )
        if server is not None and harvest is not None:
            harvest(server)
        return status
    finally:
        if hostfile is not None:
            os.unlink(hostfile)
        if server is not None:
            server.stop()


def run_commandline() -> None:  # upstream's entry point name
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
