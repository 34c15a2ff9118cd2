"""Collectives benchmark: pyhorovod vs torch.distributed (Gloo) vs Open MPI (mpi4py).

    python -m horovod.benchmarks.collectives            # 2 ranks on this host, all peers found
    python -m horovod.benchmarks.collectives --np 4 --peers ours,gloo --max-bytes 16M

Peers: ``ours`` (pyhorovod as it runs by default: shared memory between ranks on one host),
``ours-tcp`` (the same with HOROVOD_SHARED_MEMORY=0, the path between hosts; compared with
``mpi-tcp``, Open MPI over TCP alone, and ``gloo`` in ratio columns of its own), ``ours-mpi``
(the same under mpirun with HOROVOD_CPU_OPERATIONS=mpi: the MPI data plane, compared with
``mpi`` in its own ratio column), ``gloo`` (torch.distributed), ``mpi`` (Open MPI through
mpi4py). A ``memcpy`` column gives one process
copying the same buffer, the physical reference. ``--baseline DIR`` adds ``base`` and
``base-tcp``: the same jobs run with the pyhorovod of another checkout (``DIR`` holds its
``horovod`` package, e.g. ``git worktree add /tmp/base <commit>``), interleaved with the
others, so a change is measured against the code before it in the same run. ``--sizes``
picks the message sizes (``4,64K,2.4M``); ``--cold`` evicts the caches before every timed
call, in every peer alike (64 MiB written, then a barrier), for the regime of a training step,
whose gradients are reduced after forward and backward have filled the caches with other data.

For each message size it prints the median latency and the bus bandwidth of allreduce,
allgather and broadcast for every implementation, measured in the same run, and our/peer
ratios (speed ratios: > 1 means pyhorovod is faster). Peers that are not installed are
skipped with a note. ``--repeats R`` (default 2) measures all peers R times, one pass over
every peer after the other, and keeps each figure's fastest pass: on a shared machine a slow
phase then hits every peer alike. Bus bandwidth follows nccl-tests: allreduce 2(n-1)/n * bytes / t,
allgather (n-1)/n * bytes / t (bytes = the gathered total), broadcast bytes / t.

Must not touch: the runtime's internals (it uses ``horovod.numpy`` like a user, and the peers'
own APIs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

from horovod.benchmarks import launch

OPS = ("allreduce", "allgather", "broadcast")
DEFAULT_SIZES = [4, 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20]


def parse_size(text: str) -> int:
    mult = {"K": 1024, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t)


def iterations(nbytes: int, budget_s: float) -> int:
    """More repetitions for small messages; at least 9 for 64 MiB."""
    est = 2e-4 + nbytes / 2e8  # a pessimistic guess of one op's time
    return int(max(9, min(300, budget_s / est)))


# ---------------------------------------------------------------------------- workers
# ``--cold``: the workers evict the caches before every timed call (set by ``main``; the
# workers learn it from the environment, so that a baseline checkout's older worker, which
# would not, is caught by the driver instead of measuring warm: ``COLD_KEY``).
COLD_ENV = "HVD_BENCH_COLD"
COLD_KEY = "_cold"  # a worker's result says whether it measured cold
COLD_BYTES = 64 << 20  # written before each cold call: twice this machine's L3
COLD_ITERATIONS = 40  # cold calls per figure at most (each costs a pass over COLD_BYTES)


def _cold() -> bool:
    return os.environ.get(COLD_ENV) == "1"


_junk: list = []


def _evict() -> None:
    """Write ``COLD_BYTES``: the caches then hold that instead of the op's data, buffers and
    code, as after a training step's forward and backward."""
    import numpy as np

    if not _junk:
        _junk.append(np.zeros(COLD_BYTES, np.uint8))
    _junk[0] += 1


def _measure(run, nbytes: int, budget: float, barrier) -> float:
    n_it = iterations(nbytes, budget)
    cold = _cold()
    # Warm up (caches, allocators, the response cache; every implementation alike) with a
    # quarter as many calls as are timed, at least 3. A count, not a time: every rank must
    # make the same number of calls.
    for _ in range(max(3, n_it // 4)):
        run()
    barrier()
    times = []
    for _ in range(min(n_it, COLD_ITERATIONS) if cold else n_it):
        if cold:  # (then the ranks line up again, so no rank's eviction is timed)
            _evict()
            barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_ours(sizes: list[int], budget: float) -> dict:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    out: dict = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = np.ones(count, np.float32)
        part = np.ones(max(1, count // n), np.float32)
        runs = {
            "allreduce": lambda: hvd.allreduce_(x, op=hvd.Sum, name="b.ar"),
            "allgather": lambda: hvd.allgather(part, name="b.ag"),
            "broadcast": lambda: hvd.broadcast_(x, 0, name="b.bc"),
        }
        for op in OPS:
            out[f"{op}:{nbytes}"] = _measure(runs[op], nbytes, budget, hvd.barrier)
    hvd.shutdown()
    return out if me == 0 else {}


def worker_gloo(sizes: list[int], budget: float) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n, me = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    out: dict = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = torch.ones(count)
        part = torch.ones(max(1, count // n))
        gathered = [torch.empty_like(part) for _ in range(n)]
        runs = {
            "allreduce": lambda: dist.all_reduce(x),
            "allgather": lambda: dist.all_gather(gathered, part),
            "broadcast": lambda: dist.broadcast(x, 0),
        }
        for op in OPS:
            out[f"{op}:{nbytes}"] = _measure(runs[op], nbytes, budget, dist.barrier)
    dist.destroy_process_group()
    return out if me == 0 else {}


def worker_mpi(sizes: list[int], budget: float) -> dict:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    out: dict = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = np.ones(count, np.float32)
        y = np.empty_like(x)
        part = np.ones(max(1, count // n), np.float32)
        gathered = np.empty(part.size * n, np.float32)
        runs = {
            "allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),
            "allgather": lambda: comm.Allgather(part, gathered),
            "broadcast": lambda: comm.Bcast(x, root=0),
        }
        for op in OPS:
            out[f"{op}:{nbytes}"] = _measure(runs[op], nbytes, budget, comm.Barrier)
    return out if me == 0 else {}


WORKERS = {"ours": worker_ours, "gloo": worker_gloo, "mpi": worker_mpi}


# ---------------------------------------------------------------------------- driver
# "ours" is pyhorovod as it runs by default (shared memory between ranks on one host);
# "ours-tcp" the same job with HOROVOD_SHARED_MEMORY=0 (what ranks on different hosts use).
PEERS = {
    "ours": ("horovodrun", "ours", {}),
    "ours-tcp": ("horovodrun", "ours", {"HOROVOD_SHARED_MEMORY": "0"}),
    # the MPI data plane: the same job under mpirun, data through MPI's collectives
    "ours-mpi": ("mpirun", "ours", {"HOROVOD_CPU_OPERATIONS": "mpi"}),
    "gloo": ("torchrun", "gloo", {}),
    "mpi": ("mpirun", "mpi", {}),
    # Open MPI over TCP alone (pml ob1, btl tcp,self): the reference for the TCP plane
    "mpi-tcp": ("mpirun-tcp", "mpi", {}),
}


def with_baseline(peers: list[str], baseline: str) -> list[str]:
    """``peers`` plus the baseline checkout's run of each ``ours`` peer (``base``,
    ``base-tcp``), registered in ``PEERS`` with the environment that imports ``baseline``."""
    extra = launch.baseline_env(baseline)
    out = list(peers)
    for peer in peers:
        if peer.startswith("ours"):
            base = "base" + peer[len("ours") :]
            launcher, worker, env = PEERS[peer]
            PEERS[base] = (launcher, worker, {**env, **extra})
            out.append(base)
    return out


def available(peer: str) -> str | None:
    """None if ``peer`` can run here, else why not."""
    import importlib.util

    if peer not in PEERS:
        return f"unknown peer (choose from {', '.join(PEERS)})"
    if peer == "gloo" and importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    if peer in ("mpi", "ours-mpi", "mpi-tcp"):
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py)"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin)"
    return None


def run_peer(peer: str, np_: int, sizes: list[int], budget: float) -> dict:
    launcher, worker, env = PEERS[peer]
    out_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    args = [
        "horovod.benchmarks.collectives",
        "--worker",
        worker,
        "--sizes",
        ",".join(map(str, sizes)),
        "--budget",
        str(budget),
        "--out",
        out_file,
    ]
    cold = _cold()
    launch.run(launcher, np_, args, extra_env=env)
    with open(out_file) as f:
        data = json.load(f)
    os.unlink(out_file)
    if data.pop(COLD_KEY, False) != cold:
        raise NotAsAsked(
            f"{peer}'s worker did not measure {'cold' if cold else 'warm'} as asked (a "
            "baseline checkout from before --cold cannot: copy this checkout's "
            "horovod/benchmarks/collectives.py over the baseline's)"
        )
    return data


class NotAsAsked(RuntimeError):
    """A peer's worker measured otherwise than asked: its figures would not compare."""


def best_of(runs: list[dict]) -> dict:
    """Per (op, size), the fastest of the medians measured in ``runs`` (passes of one peer).
    The passes of all peers alternate, so a slow phase of a shared machine lands on every
    peer alike instead of on whichever ran during it."""
    return {key: min(run[key] for run in runs) for key in runs[0]}


def memcpy_seconds(nbytes: int, budget: float) -> float:
    """The physical reference: one process copying a buffer of this size (median)."""
    import numpy as np

    src = np.ones(max(1, nbytes // 4), np.float32)
    dst = np.empty_like(src)
    return _measure(lambda: np.copyto(dst, src), nbytes, budget / 2, lambda: None)


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}[op]
    return factor * nbytes / seconds / 1e9


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1024)):
        if nbytes >= size:
            return (
                f"{nbytes // size} {unit}" if nbytes % size == 0 else f"{nbytes / size:.1f} {unit}"
            )
    return f"{nbytes} B"


def ratio_columns(peers: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) of each ratio column: ours against every other peer; with a
    baseline (``--baseline``), the baseline against the same peers, and each of our paths
    against the baseline's run of it (the change's own effect)."""
    mpi_cost = [("ours-mpi", "mpi")] if "ours-mpi" in peers and "mpi" in peers else []
    # the TCP plane against the peers that move bytes over TCP too
    mpi_cost += [("ours-tcp", p) for p in ("mpi-tcp", "gloo") if "ours-tcp" in peers and p in peers]
    if "ours" not in peers:
        return mpi_cost  # the MPI plane's cost over raw mpi4py
    mine = [p for p in peers if not p.startswith("base")]
    cols = [("ours", p) for p in mine if p != "ours"] + mpi_cost
    if "base" in peers:
        cols += [("base", p) for p in mine if not p.startswith("ours")]
        cols += [
            (p, "base" + p[4:]) for p in mine if p.startswith("ours") and "base" + p[4:] in peers
        ]
    return cols


def table(
    results: dict[str, dict], sizes: list[int], n: int, memcpy: dict[int, float] | None = None
) -> str:
    peers = list(results)
    cols = ratio_columns(peers)
    lines = []
    for op in OPS:
        head = ["size"] + [f"{p} latency" for p in peers] + [f"{p} busbw" for p in peers]
        if memcpy:
            head.append("memcpy")
        head += [f"{a}/{b}" for a, b in cols]
        lines.append(
            f"\n{op} ({n} ranks, float32 sum; ratio a/b = b's time / a's time, >1 means a is "
            "faster; memcpy = one process copying the same buffer, the physical reference)"
        )
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for nbytes in sizes:
            key = f"{op}:{nbytes}"
            t = {p: results[p][key] for p in peers}
            row = [human(nbytes)]
            row += [
                f"{t[p] * 1e6:.0f} us" if t[p] < 1e-2 else f"{t[p] * 1e3:.1f} ms" for p in peers
            ]
            row += [f"{busbw(op, nbytes, t[p], n):.3f} GB/s" for p in peers]
            if memcpy:
                row.append(f"{nbytes / memcpy[nbytes] / 1e9:.2f} GB/s")
            row += [f"{t[b] / t[a]:.2f}x" for a, b in cols]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--peers", default="ours,ours-tcp,ours-mpi,gloo,mpi")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument(
        "--sizes",
        help="message sizes to measure, comma-separated (e.g. 4,64K,2.4M); default: the "
        "standard set up to --max-bytes",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help=f"evict the caches before every timed call ({COLD_BYTES >> 20} MiB written, then "
        "a barrier): each op starts with its data, buffers and code out of cache, as after a "
        f"training step's compute (at most {COLD_ITERATIONS} calls per figure)",
    )
    ap.add_argument(
        "--budget", type=float, default=0.6, help="seconds of measurement per (op, size)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes over all peers, interleaved; each figure is the best pass's median",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run a checkout's pyhorovod (DIR holds its horovod package) as base, base-tcp",
    )
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        sizes = [int(s) for s in a.sizes.split(",")]
        data = WORKERS[a.worker](sizes, a.budget)
        if data:
            data[COLD_KEY] = _cold()
            with open(a.out, "w") as f:
                json.dump(data, f)
        return 0
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.sizes:
        try:
            sizes = sorted({parse_size(x) for x in a.sizes.split(",")})
        except (KeyError, ValueError):
            ap.error(f"--sizes takes sizes such as 4,64K,2.4M, got {a.sizes!r}")
        if not sizes or sizes[0] < 1:
            ap.error(f"--sizes must be at least 1 byte each, got {a.sizes!r}")
    else:
        limit = parse_size(a.max_bytes)
        sizes = [s for s in DEFAULT_SIZES if s <= limit]
    os.environ[COLD_ENV] = "1" if a.cold else "0"  # (the workers inherit it)
    wanted = a.peers.split(",")
    if a.baseline:
        wanted = with_baseline(wanted, a.baseline)
    peers = []
    for peer in wanted:
        why = available(peer)
        if why:
            print(f"skipping {peer}: {why}")
        else:
            peers.append(peer)
    runs: dict[str, list[dict]] = {peer: [] for peer in peers}
    failures: list[str] = []
    for rep in range(a.repeats):
        # One pass over every peer, then the next: interleaved. Every other pass runs them in
        # the reverse order, so that no peer is always first after a pause (measured: an A/A
        # run of one checkout against itself gave the first peer 5-15% slower small ops).
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        for peer in order:
            print(f"measuring {peer} (pass {rep + 1} of {a.repeats}) ...", flush=True)
            try:
                runs[peer].append(run_peer(peer, a.np, sizes, a.budget))
            except NotAsAsked as e:
                print(f"error: {e}")
                return 2
            except launch.LaunchFailed as e:  # recorded for this pass; the others go on
                print(f"{peer} failed in pass {rep + 1}: {e}")
                failures.append(f"{peer}, pass {rep + 1}: {e.summary()}")
                if peer == "ours":
                    return 1
    results = {peer: best_of(r) for peer, r in runs.items() if r}
    memcpy = {nbytes: memcpy_seconds(nbytes, a.budget) for nbytes in sizes}
    cpus = os.cpu_count() or 1
    over = f", {a.np} ranks on {cpus} CPUs: oversubscribed" if a.np > cpus else ""
    cold = "; cold: caches evicted before every timed call" if a.cold else ""
    print(
        f"\nhost: {socket.gethostname()}, {cpus} CPUs, python {sys.version.split()[0]}{over}; "
        f"best of {a.repeats} interleaved pass(es) per figure{cold}"
    )
    print(table(results, sizes, a.np, memcpy))
    if failures:
        print("\nRuns that failed (the figures above come from the passes that worked):")
        print("\n".join(f"- {line}" for line in failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
