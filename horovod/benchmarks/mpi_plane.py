"""The MPI data plane's cost over mpi4py, measured in the same processes on the same buffers.

    python -m horovod.benchmarks.mpi_plane               # 2 ranks under mpirun
    python -m horovod.benchmarks.mpi_plane --np 4 --sizes 1M,16M,64M

For each size and operation (allreduce in place, allgather, broadcast) every rank alternates,
``--repeats`` times: Horovod's operation on the MPI plane (``HOROVOD_CPU_OPERATIONS=mpi``), then
the MPI call mpi4py makes for it on the same buffer (``Allreduce``/``Allgatherv`` in place,
``Bcast``), so both see the same memory, the same MPI and the same phase of the machine. It
prints the medians: of the calls, of their time inside MPI, of the Python before the first
MPI call on the slowest rank (the other ranks wait for it inside MPI; 0 where the engine's
peer rounds answered without MPI), ``mpi4py / horovod`` of the best alternations (1.0: no
cost; the issue's target is 0.9 or more from 1 MiB up), and the same ratio paired: the median
(and range) over the alternations of each one's mpi4py median over its horovod median, which
the machine's drift between alternations moves less. The collectives benchmark compares
against mpi4py in separate processes (``--peers ours-mpi,mpi``).

On one host the engine leaves large operations to its shared-memory algorithms where they
are faster than MPI's (``horovod.transport.mpi.OWN_FROM``): "ran on" says which way each
went ("own": no MPI call, a data round of the engine's or a shared-memory algorithm).
``--all-mpi`` (``HOROVOD_SHARED_MEMORY=0``) sends every byte through MPI, which is what the
plane alone costs.

Must not touch: the runtime's internals beyond counting the plane's MPI time (it wraps
``MpiPlane.call``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from horovod.benchmarks import launch
from horovod.benchmarks.collectives import human, parse_size

OPS = ("allreduce", "allgather", "broadcast")


def worker(sizes: list[int], iters: int, repeats: int) -> dict:
    import numpy as np
    from mpi4py import MPI

    import horovod.numpy as hvd
    from horovod.transport import mpi as plane

    inside: list[float] = []
    began = [0.0]  # when the timed call began
    entered: list[float] = []  # its Python before its first MPI call
    real_call = plane.MpiPlane.call

    def timed_call(self, what, fn, *args, **kwargs):  # noqa: ANN001
        t0 = time.perf_counter()
        if began[0]:
            entered.append(t0 - began[0])
            began[0] = 0.0
        real_call(self, what, fn, *args, **kwargs)
        inside.append(time.perf_counter() - t0)

    plane.MpiPlane.call = timed_call  # type: ignore[method-assign]
    hvd.init()
    comm = MPI.COMM_WORLD
    n = hvd.size()
    out: dict = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        part = np.ones(nbytes // 4 // n, np.float32)
        gathered = np.empty(part.size * n, np.float32)
        counts = [part.size] * n
        displs = [k * part.size for k in range(n)]
        ours = {
            "allreduce": lambda: hvd.allreduce_(x, op=hvd.Sum, name="p.ar"),
            "allgather": lambda: hvd.allgather(part, name="p.ag"),
            "broadcast": lambda: hvd.broadcast_(x, 0, name="p.bc"),
        }

        def gather_direct() -> None:
            gathered[displs[comm.rank] : displs[comm.rank] + part.size] = part
            comm.Allgatherv(MPI.IN_PLACE, [gathered, (counts, displs), MPI.FLOAT])

        direct = {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
            "allgather": gather_direct,
            "broadcast": lambda: comm.Bcast(x, root=0),
        }
        for op in OPS:
            for _ in range(3):  # warm-up: caches, the response cache, the output pool
                ours[op]()
                direct[op]()
            t_ours: list[float] = []
            t_direct: list[float] = []
            t_inside: list[float] = []
            t_before: list[float] = []
            for _ in range(repeats):
                for fn, into in ((ours[op], t_ours), (direct[op], t_direct)):
                    times = []
                    in_mpi = []  # per call: its time in MPI calls (0: none)
                    entered.clear()
                    for _ in range(iters):
                        comm.Barrier()
                        inside.clear()
                        t0 = time.perf_counter()
                        if fn is ours[op]:
                            began[0] = t0
                        fn()
                        times.append(time.perf_counter() - t0)
                        began[0] = 0.0
                        in_mpi.append(sum(inside))
                    into.append(statistics.median(times))
                    if fn is ours[op]:
                        t_inside.append(statistics.median(in_mpi))
                    if fn is ours[op] and entered:
                        t_before.append(statistics.median(entered))
            # (the slowest rank's Python before MPI: the others wait for it in MPI)
            before = max(comm.allgather(min(t_before or [0.0])))
            paired = sorted(d / o for d, o in zip(t_direct, t_ours, strict=True))
            out[f"{op}:{nbytes}"] = (
                min(t_ours),
                min(t_direct),
                min(t_inside or [0.0]),
                before,
                statistics.median(paired),
                paired[0],
                paired[-1],
            )
    hvd.shutdown()
    return out if comm.rank == 0 else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--iters", type=int, default=15, help="timed calls per median")
    ap.add_argument(
        "--repeats", type=int, default=5, help="alternations (the best, and the paired ratios)"
    )
    ap.add_argument(
        "--all-mpi",
        action="store_true",
        help="every byte through MPI (HOROVOD_SHARED_MEMORY=0): no shared-memory algorithms",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.worker:
        launch.report(a.out, worker(sizes, a.iters, a.repeats))
        return 0
    args = ["horovod.benchmarks.mpi_plane", "--worker", "--sizes", a.sizes]
    args += ["--iters", str(a.iters), "--repeats", str(a.repeats)]
    env = {"HOROVOD_CPU_OPERATIONS": "mpi"}
    if a.all_mpi:
        env["HOROVOD_SHARED_MEMORY"] = "0"
    data = launch.collect("mpirun", a.np, args, extra_env=env)
    print(
        f"\n{a.np} ranks, {os.cpu_count()} CPUs; best of {a.repeats} alternations; "
        + ("every byte through MPI" if a.all_mpi else "shared memory where faster")
    )
    print(
        "| op | size | horovod (MPI plane) | ran on | of which in MPI | Python before MPI, "
        "slowest rank | mpi4py, same buffer | mpi4py/horovod | paired (range) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for op in OPS:
        for nbytes in sizes:
            ours, direct, inside, before, mid, lo, hi = data[f"{op}:{nbytes}"]
            way = "MPI" if inside > 0 else "own"  # (a data round, or shared memory's algorithm)
            print(
                f"| {op} | {human(nbytes)} | {ours * 1e6:.0f} us | {way} | {inside * 1e6:.0f} us "
                f"| {before * 1e6:.0f} us | {direct * 1e6:.0f} us | {direct / ours:.2f} "
                f"| {mid:.2f} ({lo:.2f}-{hi:.2f}) |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
