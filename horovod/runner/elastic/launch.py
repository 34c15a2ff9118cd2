"""``horovodrun`` for elastic jobs (``--min-np`` or ``--host-discovery-script``): sets the
elastic defaults of the workers' environment, runs the driver, prints its report.

Frozen workers are found through the stall shutdown: in elastic jobs it defaults to 60 s
(``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, warnings from 30 s), after which a worker's peers give
up on it and the driver stops it; the driver itself stops a member that has not left a broken
round 10 s after that.

Must not touch: the training runtime.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable

from horovod.common.config import setting
from horovod.common.shm_names import cleanup_job
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.workers import ProcessLauncher
from horovod.runner.interrupts import on_interrupt
from horovod.runner.procs import Command, OutputSink

STALL_SHUTDOWN_DEFAULT_S = 60.0
LEAVE_MARGIN_S = 10.0


def set_worker_defaults(base: dict[str, str], elastic_timeout: float) -> float:
    """Put an elastic job's defaults into the workers' environment ``base`` (stall shutdown,
    elastic timeout); return how long a member may take to leave a broken round."""
    if "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in base:
        base["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = f"{STALL_SHUTDOWN_DEFAULT_S:g}"
        if "HOROVOD_STALL_CHECK_TIME_SECONDS" not in base:
            base["HOROVOD_STALL_CHECK_TIME_SECONDS"] = f"{STALL_SHUTDOWN_DEFAULT_S / 2:g}"
    base["HOROVOD_ELASTIC_TIMEOUT"] = f"{elastic_timeout:g}"
    shutdown_s = setting("stall_shutdown_time_seconds", base)
    return (shutdown_s or STALL_SHUTDOWN_DEFAULT_S) + LEAVE_MARGIN_S


def run_elastic(
    a: argparse.Namespace,
    server: RendezvousServer,
    discovery: object,
    make_command: Callable[[str, int, dict[str, str]], Command],
    base: dict[str, str],
    grace: float,
    secret: str,
) -> int:
    import sys

    elastic_timeout = (
        a.elastic_timeout if a.elastic_timeout is not None else setting("elastic_timeout", base)
    )
    start_timeout = (
        a.start_timeout if a.start_timeout is not None else setting("start_timeout", base)
    )
    leave_timeout = set_worker_defaults(base, elastic_timeout)
    cooldown = a.blacklist_cooldown_range
    max_np = (
        a.max_np if a.max_np is not None else (a.np if a.host_discovery_script is None else None)
    )
    driver = ElasticDriver(
        discovery,
        server=server,
        launcher=ProcessLauncher(
            make_command,
            OutputSink(a.prefix_output_with_timestamp, a.output_filename),
            max_np or 1000,
        ),
        np=a.np,
        min_np=a.min_np,
        max_np=max_np,
        reset_limit=a.reset_limit,
        cooldown=None if cooldown is None else (cooldown[0], cooldown[1]),
        elastic_timeout=elastic_timeout,
        start_timeout=start_timeout,
        leave_timeout=leave_timeout,
        grace=grace,
        verbose=a.verbose,
        discover_every=setting("elastic_discovery_seconds", base),
    )

    def on_signal(signum: int, _frame: object) -> None:
        driver.interrupt(signal.Signals(signum).name)

    try:
        with on_interrupt(on_signal):
            status = driver.run()
    finally:
        cleanup_job(bytes.fromhex(secret))
    report = driver.report()
    if report:
        print(report, file=sys.stderr)
    return status
