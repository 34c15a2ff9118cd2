"""Flat vs hierarchical allreduce/allgather across two hosts joined by a shaped link, and
Open MPI run the same way.

Builds two test hosts from network namespaces with their own sshd and host name
(``horovod.testing.netns``), shapes each host's link with ``tc netem`` (default: 1 Gbit/s and
0.2 ms each way), runs ``horovodrun -np 4 -H hostA:2,hostB:2`` over ssh with and without
``--hierarchical-allreduce --hierarchical-allgather``, then (where ``mpirun`` and mpi4py are
installed) ``mpirun -np 4 -H hostA:2,hostB:2`` over the same ssh with mpi4py's ``Allreduce``
and ``Allgather``: Open MPI's default (its hierarchical ``coll/han``, shared memory within a
host, TCP between them) and its flat ``coll/tuned`` (``--mca coll_han_priority 0``). Prints the
median times (the slowest rank's) and the ratios. Ranks on one host talk through shared memory,
the two hosts through TCP over the shaped link.

    sudo python -m horovod.benchmarks.multihost [--rate 1gbit] [--delay 0.2ms] [--iters 20]

Needs root, iproute2 (ip, tc) and openssh-server; results in docs/benchmarks.md.

Must not touch: the runtime's internals (it runs ``horovodrun`` on the test hosts like a user).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

from horovod.testing.netns import TestNetwork, unavailable

# The directory holding this horovod package: the test hosts' ranks import it from there.
REPO = Path(__file__).resolve().parents[2]

WORKER = """
    import json, sys, time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    iters = int(sys.argv[1])
    out = {}
    for nbytes in (4, 64 << 10, 1 << 20, 16 << 20):
        x = np.ones(max(1, nbytes // 4), np.float32)
        for op in ("allreduce", "allgather"):
            if op == "allgather" and nbytes > (4 << 20):
                continue
            fn = (lambda: hvd.allreduce(x, op=hvd.Sum, name=f"r{nbytes}")) if op == "allreduce" \\
                else (lambda: hvd.allgather(x, name=f"g{nbytes}"))
            for _ in range(3):
                fn()
            times = []
            n = iters if nbytes < (4 << 20) else max(5, iters // 4)
            for _ in range(n):
                hvd.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            times = hvd.allgather_object(sorted(times)[len(times) // 2])
            out[f"{op} {nbytes}"] = max(times)
    if hvd.rank() == 0:
        print("TIMES " + json.dumps(out), flush=True)
    hvd.shutdown()
"""


MPI_WORKER = """
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    iters = int(sys.argv[1])
    out = {}
    for nbytes in (4, 64 << 10, 1 << 20, 16 << 20):
        x = np.ones(max(1, nbytes // 4), np.float32)
        for op in ("allreduce", "allgather"):
            if op == "allgather" and nbytes > (4 << 20):
                continue
            y = np.empty(x.size * (1 if op == "allreduce" else comm.size), np.float32)
            fn = (lambda: comm.Allreduce(x, y)) if op == "allreduce" \\
                else (lambda: comm.Allgather(x, y))
            for _ in range(3):
                fn()
            times = []
            n = iters if nbytes < (4 << 20) else max(5, iters // 4)
            for _ in range(n):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[f"{op} {nbytes}"] = max(comm.allgather(sorted(times)[len(times) // 2]))
    if comm.rank == 0:
        print("TIMES " + json.dumps(out), flush=True)
"""

# (name, extra mpirun arguments): Open MPI's default and its flat collectives.
MPI_MODES: tuple[tuple[str, list[str]], ...] = (
    ("Open MPI", []),
    ("Open MPI flat", ["--mca", "coll_han_priority", "0"]),
)


def mpi_command(net: TestNetwork, mpirun: str, extra: list[str]) -> list[str]:
    """``mpirun`` on the two test hosts over the test network's ssh, TCP on their link only."""
    return [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "4",
        "-H",
        "hostA:2,hostB:2",
        # (two per host: with --oversubscribe its default mapping would put all four on the
        # first; unbound, as horovodrun's ranks are)
        "--map-by",
        "ppr:2:node",
        "--bind-to",
        "none",
        # (the test hosts' non-interactive ssh sessions find Open MPI's daemon through this)
        "--prefix",
        str(Path(mpirun).resolve().parent.parent),
        "--mca",
        "plm_rsh_args",
        " ".join(net.launcher_args()),
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        # (the two test hosts share this machine's cores: four ranks that poll without
        # yielding took 8-16 ms for a 4-byte allreduce; this is Open MPI's setting for it)
        "--mca",
        "mpi_yield_when_idle",
        "true",
        "-x",
        "PATH",
        *extra,
    ]


def run_times(net: TestNetwork, argv: list[str], work: Path, env: dict) -> dict:
    r = net.exec("hostA", argv, cwd=work, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    line = next(x for x in r.stdout.splitlines() if "TIMES " in x)
    return json.loads(line.split("TIMES ", 1)[1])  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--delay", default="0.2ms")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    net = TestNetwork(["hostA", "hostB"], hostnames=True)
    work = Path(tempfile.mkdtemp(prefix="hvd-bench-"))
    (work / "worker.py").write_text(textwrap.dedent(WORKER))
    (work / "mpi_worker.py").write_text(textwrap.dedent(MPI_WORKER))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    mpirun = shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpirun = None
    results: dict[str, dict] = {}
    try:
        shaped = "link " + net.shape(a.rate, a.delay)
        for mode, flags in (
            ("flat", []),
            ("hierarchical", ["--hierarchical-allreduce", "--hierarchical-allgather"]),
        ):
            argv = [sys.executable, "-m", "horovod.runner.launch", *net.launcher_args()]
            argv += ["-np", "4", "-H", "hostA:2,hostB:2", *flags]
            argv += [sys.executable, str(work / "worker.py"), str(a.iters)]
            results[mode] = run_times(net, argv, work, env)
        if mpirun is not None:
            for mode, extra in MPI_MODES:
                argv = mpi_command(net, mpirun, extra)
                argv += [sys.executable, str(work / "mpi_worker.py"), str(a.iters)]
                results[mode] = run_times(net, argv, work, env)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        net.close()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"4 ranks = 2 hosts x 2 (shared memory within a host), {shaped}; median of "
        f"{a.iters} per size, slowest rank"
        + ("" if mpirun else "; no mpirun/mpi4py here, so no Open MPI rows")
        + "\n"
    )
    mpi = [m for m, _ in MPI_MODES if m in results]
    cols = ["flat", "hierarchical", *mpi, "flat / hierarchical"]
    cols += [f"hierarchical / {m}" for m in mpi]
    print("| op | bytes per rank | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for key, flat in results["flat"].items():
        op, nbytes = key.split()
        hier = results["hierarchical"][key]
        cells = [f"{results[m][key] * 1e3:.2f} ms" for m in ("flat", "hierarchical", *mpi)]
        cells.append(f"{flat / hier:.2f}x")
        cells += [f"{results[m][key] / hier:.2f}x" for m in mpi]
        print(f"| {op} | {int(nbytes):,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
