"""``horovod.run``: run a Python function on every rank and collect what it returns.

The function and its arguments are cloudpickled into the job's rendezvous store (every request
authenticated with the job secret, so ranks on other hosts need no shared file system);
horovodrun starts ``python -m horovod.runner.run_task`` on every slot; each rank fetches the
function, calls it and stores its result. The caller gets the list of return values in rank
order, or the first failure re-raised: the rank's own exception, chained to a
``RemoteTraceback`` that carries the rank's traceback text (as ``concurrent.futures`` does for
process pools). ``use_mpi=True`` (or ``mpi_args``) starts the ranks with the installed mpirun
instead (``horovodrun --mpi``), the launcher still serving the store.

Must not touch: the training runtime in this process (the function runs in the workers).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

FUNC_SCOPE, RESULT_SCOPE = "runfunc", "runfunc_result"  # upstream's scope names


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank of ``horovod.run``."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} raised:\n{text}")
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return self.args[0]


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interfaces: str | Sequence[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    network_interface: str | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    elastic_timeout: float | None = None,
    host_discovery_script: str | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    **unknown: Any,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks (``hosts``/``hostfile`` as for
    horovodrun, default all on this host) and return the values in rank order.

    Elastic (``min_num_proc`` or ``host_discovery_script``, with ``max_num_proc``, ``slots``,
    ``reset_limit``, ``cooldown_range``, ``elastic_timeout`` as horovodrun's flags): ``func``
    runs under the elastic driver (it should use ``hvd.elastic.run`` to recover), and the values
    are those of the ranks of the last round, in rank order."""
    if unknown:
        raise TypeError(f"horovod.run: unexpected arguments {', '.join(sorted(unknown))}")
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc", DeprecationWarning, stacklevel=2)
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc", DeprecationWarning, stacklevel=2)
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
    if np is not None:
        warnings.warn("np is deprecated, use num_proc", DeprecationWarning, stacklevel=2)
        num_proc = num_proc if num_proc is not None else np
    if network_interface is not None:
        warnings.warn(
            "network_interface is deprecated, use network_interfaces",
            DeprecationWarning,
            stacklevel=2,
        )
        network_interfaces = network_interfaces or network_interface
    if hosts and hostfile:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    elastic = min_num_proc is not None or host_discovery_script is not None
    if (use_mpi or mpi_args) and elastic:
        raise ValueError(
            "horovod.run: elastic jobs run on horovodrun's own launcher, not under mpirun: "
            "leave use_mpi/mpi_args unset"
        )
    if num_proc is None:
        num_proc = min_num_proc if elastic and min_num_proc is not None else 1
    if not callable(func):
        raise TypeError(f"horovod.run: func must be callable, got {type(func).__name__}")
    argv = ["-np", str(num_proc)]
    if use_mpi or mpi_args:  # (the installed mpirun starts the ranks: horovodrun --mpi)
        argv += ["--mpi"] + ([f"--mpi-args={mpi_args}"] if mpi_args else [])
    if hosts:
        argv += ["-H", hosts]
    if hostfile:
        argv += ["-hostfile", hostfile]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["-i", ssh_identity_file]
    if start_timeout is not None:
        argv += ["--start-timeout", str(int(start_timeout))]
    if output_filename:
        argv += ["--output-filename", output_filename]
    if verbose:
        argv += ["--verbose"]
    if network_interfaces:
        nics = network_interfaces
        argv += ["--network-interfaces", nics if isinstance(nics, str) else ",".join(nics)]
    for flag, value in (
        ("--min-np", min_num_proc),
        ("--max-np", max_num_proc),
        ("--slots", slots),
        ("--reset-limit", reset_limit),
        ("--elastic-timeout", elastic_timeout),
        ("--host-discovery-script", host_discovery_script),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if cooldown_range is not None:
        argv += ["--blacklist-cooldown-range", str(cooldown_range[0]), str(cooldown_range[1])]
    argv += [executable or sys.executable, "-m", "horovod.runner.run_task"]
    from horovod.runner.launch import main

    # The function and the results travel through the job's rendezvous store (authenticated
    # with the job secret), so ranks on other hosts need no shared file system.
    func_blob = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    results: dict[int, tuple] = {}

    most = max(num_proc, max_num_proc or 0) if not elastic or max_num_proc else None

    def harvest(server) -> None:
        rank = 0
        while most is None or rank < most:  # (elastic without a maximum: up to the first gap)
            raw = server.get(RESULT_SCOPE, str(rank))
            if raw is not None:
                results[rank] = cloudpickle.loads(raw)
            elif most is None:
                break
            rank += 1

    status = main(argv, seed={(FUNC_SCOPE, "func"): func_blob}, harvest=harvest)
    if elastic:
        return _collect_elastic(results, status)
    return _collect(results, num_proc, status)


def _collect_elastic(results: dict[int, tuple], status: int) -> list[Any]:
    """The values of the ranks of the last round that returned (each ``ok`` result records
    its round and size); a failure of the job, or of that round's ranks, as ``_collect``."""
    ok = [r for r in results.values() if r[0] == "ok"]
    if status == 0 and ok:
        last = max(r[2] for r in ok)
        final = {rank: r for rank, r in results.items() if r[0] == "ok" and r[2] == last}
        size = next(iter(final.values()))[3]
        if sorted(final) == list(range(size)):
            return [final[rank][1] for rank in range(size)]
    return _collect(results, max(results, default=-1) + 1, status)


def _collect(results: dict[int, tuple], n: int, status: int) -> list[Any]:
    errors = sorted(
        ((r[3], rank, r[1], r[2]) for rank, r in results.items() if r[0] == "error"),
        key=lambda e: (e[0], e[1]),
    )
    if errors:
        _, rank, exc, tb = errors[0]
        raise exc from RemoteTraceback(rank, tb)
    missing = [rank for rank in range(n) if rank not in results]
    if status != 0 or missing:
        raise RuntimeError(
            f"horovod.run: the job failed (exit status {status}); ranks {missing} returned "
            "nothing (see horovodrun's report above)"
        )
    return [results[rank][1] for rank in range(n)]
