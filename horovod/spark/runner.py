"""``horovod.spark.run``: a function on ``num_proc`` Spark tasks, as Horovod ranks (upstream's
``horovod.spark.run``).

The driver starts the rendezvous store, then runs one stage of ``num_proc`` tasks in barrier
mode (Spark starts them together or not at all). Each task: its rank is its partition id; the
tasks all-gather their host names through the barrier (``BarrierTaskContext.allGather``) to
compute local and cross ranks as horovodrun places them; the task sets the rank's ``HOROVOD_*``
environment, calls ``fn(*args, **kwargs)`` (which runs ``hvd.init()`` like any worker), shuts
Horovod down in that Python worker whatever happened (Spark reuses Python workers), restores
the environment, and returns the pickled result. The driver returns the results by rank.

Failures: an exception in ``fn`` on any rank fails the stage (barrier mode stops the others,
and the failing rank's Horovod shutdown ends the collectives they wait in), and ``run`` raises
``RuntimeError`` naming the rank and the exception. A cluster with fewer free task slots than
``num_proc`` cannot start a barrier stage; Spark refuses it at once, and ``run`` says so.

``use_mpi=True`` (or ``extra_mpi_args``): the ranks start under the installed mpirun inside
the tasks instead (``horovod.spark.mpi_job``).

Must not touch: the training runtime in the driver (it imports no framework; the tasks import
what ``fn`` imports).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from horovod.common.config import setting
from horovod.common.secret import make_secret
from horovod.common.shm_names import cleanup_job
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.hosts import HostInfo, assign_slots

FAILURE_SCOPE = "job"  # where tasks record why they failed (as horovodrun's workers do)


def spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError as e:
        raise ImportError(
            "horovod.spark needs PySpark: pip install 'pyhorovod[spark]' (and a Java runtime)"
        ) from e
    sc = SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(
            "horovod.spark.run needs an active Spark session: create one first, e.g. "
            "SparkSession.builder.master('local[2]').getOrCreate()"
        )
    return sc


def _driver_address(sc: Any) -> tuple[str, str]:
    """(address the tasks reach the driver's store at, address to listen on)."""
    master = sc.master or ""
    if master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = host
    return addr, "0.0.0.0"


def job_environment(
    addr: str, port: int, secret: str, nics: Any, env: Mapping[str, str] | None
) -> dict[str, str]:
    """What every task of a job gets: the driver's store, the job's key and scope, Gloo."""
    job_env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_SECRET_KEY": secret,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        # Spark reuses its Python workers: the job names its own scope in the store
        "HOROVOD_RENDEZVOUS_SCOPE": f"spark-{secrets.token_hex(6)}",
        "PYTHONUNBUFFERED": "1",
    }
    if nics:
        job_env["HOROVOD_GLOO_IFACE"] = nics if isinstance(nics, str) else ",".join(sorted(nics))
    job_env.update(env or {})
    return job_env


def run(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    nics: Any = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: the context's
    ``defaultParallelism``) as one Horovod job; the return values by rank."""
    mpi = bool(use_mpi or extra_mpi_args)
    if mpi and use_gloo:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if not callable(fn):
        raise TypeError(f"horovod.spark.run: fn must be callable, got {type(fn).__name__}")
    sc = spark_context()
    n = int(num_proc if num_proc is not None else sc.defaultParallelism)
    if n < 1:
        raise ValueError(f"horovod.spark.run: num_proc must be at least 1, got {n}")
    slots = _free_slots(sc)
    if n > slots:
        # Spark would retry a barrier stage it cannot place for minutes before failing.
        raise RuntimeError(
            f"horovod.spark.run: num_proc={n} but this Spark cluster runs {slots} tasks at "
            "once, and a barrier stage needs them all together: ask for at most "
            f"{slots} or give the cluster more cores (executors x spark.executor.cores)"
        )
    timeout = setting("spark_start_timeout") if start_timeout is None else start_timeout
    addr, listen = _driver_address(sc)
    if mpi:  # (the ranks under the installed mpirun, inside the tasks: ``mpi_job``)
        from horovod.spark import mpi_job

        return mpi_job.run(
            sc,
            fn,
            tuple(args),
            dict(kwargs or {}),
            n,
            addr=addr,
            listen=listen,
            start_timeout=timeout,
            mpi_args=extra_mpi_args,
            env=env,
            nics=nics,
            executable=executable,
            verbose=verbose,
            timestamp=prefix_output_with_timestamp,
        )
    secret = make_secret()
    server = RendezvousServer(bytes.fromhex(secret), host=listen).start()
    job_env = job_environment(addr, server.port, secret, nics, env)
    job_env["HOROVOD_START_TIMEOUT"] = str(int(timeout))
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    task = _task(payload, job_env, n)
    try:
        rdd = sc.parallelize(range(n), n).barrier().mapPartitions(task)
        sc.setJobDescription(f"horovod.spark.run: {getattr(fn, '__name__', 'fn')} on {n} ranks")
        try:
            pairs = rdd.collect()
        except Exception as e:  # noqa: BLE001 - Spark's errors come as Py4J exceptions
            raise RuntimeError(_recorded_cause(server, n) or _root_cause(e, n)) from None
    finally:
        server.stop()
        cleanup_job(bytes.fromhex(secret))  # segments a killed local task left behind
    by_rank = dict(pairs)
    return [cloudpickle.loads(by_rank[r]) for r in range(n)]


def _task(payload: bytes, job_env: dict[str, str], n: int) -> Callable[[Any], Any]:
    def body(_partition: Any) -> Any:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        hosts = ctx.allGather(socket.gethostname())
        names = list(dict.fromkeys(hosts))
        slots = assign_slots([HostInfo(h, hosts.count(h)) for h in names], n)
        # Ranks as Spark numbered the tasks; local ranks in rank order on each host.
        local = [r for r in range(n) if hosts[r] == hosts[rank]].index(rank)
        mine = next(s for s in slots if s.hostname == hosts[rank] and s.local_rank == local)
        env = {**job_env, **mine.env(), "HOROVOD_RANK": str(rank)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                _record_failure(job_env, rank, e)
                raise
            finally:
                ctx_mod = sys.modules.get("horovod.core.context")
                if ctx_mod is not None and ctx_mod.current() is not None:
                    ctx_mod.shutdown("the Spark task's function returned")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield rank, cloudpickle.dumps(result)

    return body


def _record_failure(job_env: Mapping[str, str], rank: int, e: BaseException) -> None:
    """Tell the driver why this rank failed: its own error ("root") or one caused by another
    rank's failure ("consequence": Horovod's errors), as horovodrun's workers do."""
    from horovod.common.exceptions import HorovodInternalError
    from horovod.rendezvous.store import HTTPStoreClient

    kind = "consequence" if isinstance(e, HorovodInternalError) else "root"
    summary = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    try:
        store = HTTPStoreClient(
            job_env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
            int(job_env["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
            bytes.fromhex(job_env["HOROVOD_SECRET_KEY"]),
            retries=1,
        )
        store.set(FAILURE_SCOPE, f"failure.{rank}", f"{kind}\n{summary}".encode())
    except Exception:  # noqa: BLE001 - the driver falls back to Spark's own report
        pass


def _recorded_cause(server: RendezvousServer, n: int) -> str | None:
    """The first rank's own error the tasks recorded, else the first consequence."""
    notes = []
    for r in range(n):
        raw = server.get(FAILURE_SCOPE, f"failure.{r}")
        if raw is not None:
            kind, _, summary = raw.decode("utf-8", "replace").partition("\n")
            notes.append((kind != "root", r, summary))
    if not notes:
        return None
    _, rank, summary = min(notes)
    return f"horovod.spark.run: rank {rank} failed: {summary}"


def _root_cause(e: BaseException, n: int) -> str:
    """One message from Spark's error: the task's own Python exception where there is one
    (not the consequences on the ranks that were waiting for it)."""
    text = str(e)
    partition = re.search(r"ResultTask\(\d+, (\d+)\)|Task (\d+)(?:\.\d+)? in stage", text)
    causes: list[str] = []
    in_traceback = False
    for line in text.splitlines():
        if "Traceback (most recent call last)" in line:
            in_traceback = True
            continue
        if in_traceback and line and not line[0].isspace():
            causes.append(line.strip())
            in_traceback = False
    own = [c for c in causes if "HorovodInternalError" not in c] or causes
    cause = own[0] if own else (text.splitlines() or [type(e).__name__])[0]
    where = f"rank {partition.group(1) or partition.group(2)}" if partition else "a rank"
    return f"horovod.spark.run: {where} failed: {cause[:400]}"


def _free_slots(sc: Any) -> int:
    """How many tasks the cluster can run at once (a barrier stage needs one per rank)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an older Spark: its default parallelism is the guess
        return int(sc.defaultParallelism)
