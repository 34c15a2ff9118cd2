"""``horovod.spark.run(use_mpi=True)``: the job's ranks started by the installed ``mpirun``
inside the Spark tasks, with the data moving through MPI (as upstream's Spark MPI mode).

The driver runs one barrier stage of ``num_proc`` tasks that hold the cluster's slots for the
job. The tasks all-gather their host names; task 0 publishes how many tasks each host has.
The driver then runs ``mpirun -np num_proc -H hvdspark-0:N0,hvdspark-1:N1,...`` whose remote
shell is ``horovod.spark.mpi_agent`` (Open MPI's ``plm_rsh_agent``, Hydra's
``-launcher-exec``): where ``mpirun`` would ssh to host ``hvdspark-i`` to start its daemon,
the agent hands the daemon's command line to the first task on that host through the driver's
store, and that task runs it (``serve``). The daemon starts the host's ranks, which run
``horovod.runner.run_task``: they fetch ``fn`` from the same store and put their results
there, as under ``horovod.run(use_mpi=True)``. The other tasks of a host only hold their
slots until the driver says the job is done.

Store keys (scope ``SCOPE``): ``hosts`` (task 0: tasks per host, JSON), ``launch.<i>`` (the
agent: the daemon's command for host ``i``, JSON), ``exit.<i>`` (the task: its exit status
and last output lines), ``stop.<i>`` (the agent was told to stop: end the daemon), ``done``
(the driver, at the end: every task returns and ends what it still runs), ``failed`` (the
driver: the stage failed, agents give up).

Must not touch: the training runtime in the driver (the ranks import what ``fn`` imports).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from horovod.common.secret import make_secret
from horovod.common.shm_names import cleanup_job
from horovod.rendezvous.server import RendezvousServer
from horovod.rendezvous.store import HTTPStoreClient
from horovod.runner import mpi_run, ssh
from horovod.runner.hosts import HostInfo
from horovod.runner.run_func import FUNC_SCOPE, RESULT_SCOPE

SCOPE = "spark-mpi"
HOST_PREFIX = "hvdspark-"  # (names mpirun cannot take for this machine: it uses the agent)
POLL_S = 0.02
STOP_GRACE_S = 5.0  # a daemon asked to stop gets this long before SIGKILL
TAIL_LINES = 20


def host_name(index: int) -> str:
    return f"{HOST_PREFIX}{index}"


def host_index(name: str) -> int | None:
    """The index in a host name of ``host_name``'s, or None for any other word."""
    rest = name[len(HOST_PREFIX) :] if name.startswith(HOST_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def store_from_env(environ: Mapping[str, str]) -> HTTPStoreClient:
    """The driver's store, as the agent finds it in mpirun's environment (the ranks'
    ``HOROVOD_RUN_FUNC_STORE`` and job secret)."""
    from horovod.common.config import Config

    cfg = Config.from_env(environ)
    addr, _, port = cfg.run_func_store.rpartition(":")
    secret = cfg.secret_key
    if not addr or not port.isdigit() or not secret:
        raise SystemExit(
            "horovod.spark.mpi_agent is mpirun's remote shell under "
            "horovod.spark.run(use_mpi=True), not a command of its own"
        )
    return HTTPStoreClient(addr, int(port), bytes.fromhex(secret))


# ---------------------------------------------------------------------------- the driver
def run(
    sc: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: Mapping[str, Any],
    n: int,
    *,
    addr: str,
    listen: str,
    start_timeout: float,
    mpi_args: str | None,
    env: Mapping[str, str] | None,
    nics: Any,
    executable: str | None,
    verbose: int,
    timestamp: bool,
) -> list[Any]:
    """The values ``fn(*args, **kwargs)`` returned on ranks 0..n-1 (module docstring)."""
    try:
        mpirun = mpi_run.find_mpirun()
        impl = mpi_run.implementation(mpirun)
    except mpi_run.MpiNotFound:
        raise RuntimeError(
            "horovod.spark.run(use_mpi=True) needs an mpirun on the driver's PATH, and none was "
            "found. Install MPI with `pip install 'pyhorovod[mpi]'` (Open MPI and mpi4py from "
            "PyPI) on the driver and the executors, or your site's MPI, or leave use_mpi unset "
            "to run on the built-in planes"
        ) from None
    except RuntimeError as e:
        raise RuntimeError(f"horovod.spark.run(use_mpi=True): {e}") from None
    python = executable or sys.executable
    secret = make_secret()
    server = RendezvousServer(bytes.fromhex(secret), host=listen).start()
    server.put(FUNC_SCOPE, "func", cloudpickle.dumps((fn, tuple(args), dict(kwargs))))
    stage_error: list[BaseException] = []
    stage = threading.Thread(
        target=_run_stage, args=(sc, n, addr, server.port, secret, stage_error), daemon=True
    )
    agent = hostfile = None
    try:
        sc.setJobDescription(f"horovod.spark.run: {getattr(fn, '__name__', 'fn')} under mpirun")
        stage.start()
        counts = _await_hosts(server, start_timeout, stage, stage_error, n)
        hosts = [HostInfo(host_name(i), c) for i, c in enumerate(counts)]
        agent = _agent_script(python)
        nic_list = [nics] if isinstance(nics, str) else sorted(nics or [])
        settings = {
            **(env or {}),
            "HOROVOD_RUN_FUNC_STORE": f"{addr}:{server.port}",
            "HOROVOD_SECRET_KEY": secret,
        }
        run_env = mpi_run.worker_env(ssh.exportable(os.environ), settings)
        names = [k for k in run_env if not mpi_run.LAUNCHER_OWN.match(k)]
        if impl == mpi_run.OPEN_MPI:
            shell = f"--mca plm_rsh_agent {agent}"
        else:
            shell = f"-launcher ssh -launcher-exec {agent}"
            hostfile = mpi_run.write_hostfile(hosts)
        argv = mpi_run.command(
            impl,
            mpirun=mpirun,
            np=n,
            hosts=hosts,
            env_names=names,
            train=[python, "-m", "horovod.runner.run_task"],
            mpi_args=f"{shell} {mpi_args or ''}",
            nics=[w.strip() for item in nic_list for w in item.split(",") if w.strip()],
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            hostfile=hostfile,
        )
        status = mpi_run.run(
            argv, run_env, verbose >= 2, None, n, timestamp, label="horovod.spark.run"
        )
        if stage_error and status == 0:
            status = 1
    finally:
        server.put(SCOPE, "done", b"1")
        stage.join(STOP_GRACE_S + 30)
        results = {r: server.get(RESULT_SCOPE, str(r)) for r in range(n)}
        server.stop()
        cleanup_job(bytes.fromhex(secret))
        for path in (agent, hostfile):
            if path is not None:
                os.unlink(path)
    return _collect({r: cloudpickle.loads(v) for r, v in results.items() if v}, n, status)


def _run_stage(
    sc: Any, n: int, addr: str, port: int, secret: str, error: list[BaseException]
) -> None:
    try:
        task = _task(addr, port, secret)
        sc.parallelize(range(n), n).barrier().mapPartitions(task).collect()
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        error.append(e)


def _await_hosts(
    server: RendezvousServer,
    timeout: float,
    stage: threading.Thread,
    error: list[BaseException],
    n: int,
) -> list[int]:
    """Tasks per host, once task 0 has published them."""
    deadline = time.monotonic() + timeout
    while True:
        raw = server.get(SCOPE, "hosts")
        if raw is not None:
            return [int(c) for c in json.loads(raw)]
        if error or not stage.is_alive():
            why = str(error[0]).splitlines()[0][:400] if error else "it ended"
            server.put(SCOPE, "failed", b"1")
            raise RuntimeError(f"horovod.spark.run(use_mpi=True): the Spark stage failed: {why}")
        if time.monotonic() > deadline:
            server.put(SCOPE, "failed", b"1")
            raise RuntimeError(
                f"horovod.spark.run(use_mpi=True): the {n} Spark tasks did not all start within "
                f"{timeout:g} s (start_timeout)"
            )
        time.sleep(POLL_S)


def _agent_script(python: str) -> str:
    """An executable that runs the agent (Hydra takes one file, not a command line)."""
    fd, path = tempfile.mkstemp(prefix="horovod-spark-agent-", suffix=".sh")
    with os.fdopen(fd, "w") as f:
        f.write(f'#!/bin/sh\nexec {python} -m horovod.spark.mpi_agent "$@"\n')
    os.chmod(path, 0o755)
    return path


def _collect(results: dict[int, tuple], n: int, status: int) -> list[Any]:
    """Values by rank, or the first rank's failure as upstream's Spark runner reports it."""
    errors = sorted((r[3], rank, r[1]) for rank, r in results.items() if r[0] == "error")
    if errors:
        _, rank, exc = errors[0]
        raise RuntimeError(
            f"horovod.spark.run: rank {rank} failed: {type(exc).__name__}: {exc}"
        ) from exc
    missing = [r for r in range(n) if r not in results]
    if status != 0 or missing:
        raise RuntimeError(
            f"horovod.spark.run(use_mpi=True): mpirun exited with status {status}; ranks "
            f"{missing} returned nothing (mpirun's report above says why)"
        )
    return [results[r][1] for r in range(n)]


# ---------------------------------------------------------------------------- the tasks
def _task(addr: str, port: int, secret: str) -> Callable[[Any], Any]:
    def body(_partition: Any) -> Any:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        index = ctx.partitionId()
        hosts = ctx.allGather(socket.gethostname())
        names = list(dict.fromkeys(hosts))
        store = HTTPStoreClient(addr, port, bytes.fromhex(secret))
        if index == 0:
            store.set(SCOPE, "hosts", json.dumps([hosts.count(h) for h in names]).encode())
        if hosts.index(hosts[index]) == index:  # the first task on its host runs its daemon
            serve(store, names.index(hosts[index]))
        else:
            while store.get(SCOPE, "done") is None:
                time.sleep(POLL_S * 5)
        yield index

    return body


def serve(store: HTTPStoreClient, i: int) -> None:
    """Run the command the agent hands over for host ``i`` (mpirun's daemon), until it ends
    or the driver is done; record its status and last lines for the agent."""
    while True:
        raw = store.get(SCOPE, f"launch.{i}")
        if raw is not None:
            break
        if store.get(SCOPE, "done") is not None:
            return
        time.sleep(POLL_S)
    words = json.loads(raw)
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", " ".join(words)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # (its ranks too: ended together)
        )
        stopped = False
        while proc.poll() is None:
            if not stopped and (
                store.get(SCOPE, "done") is not None or store.get(SCOPE, f"stop.{i}") is not None
            ):
                stopped = True
                _end(proc)
            time.sleep(POLL_S * 5)
        out.seek(0)
        tail = out.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
    store.set(SCOPE, f"exit.{i}", json.dumps([proc.returncode, tail]).encode())


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the daemon's process group, SIGKILL after the grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
