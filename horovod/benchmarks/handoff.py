"""The machine's own price for handing a buffer from one process to another through shared
memory, with nothing of Horovod around it: the floor under a data round's broadcast.

    python -m horovod.benchmarks.handoff                     # 512 KiB, 8 jobs
    python -m horovod.benchmarks.handoff --sizes 128K,1M --jobs 12

Each job is a fresh pair of processes and a fresh shared-memory segment with two slots, used
the way the engine's board uses them: the writer copies its buffer into one slot and publishes
the round; the reader, which announced the round first, copies the slot out; meanwhile the
writer fills the other slot for the next round (it may run one round ahead). Timed per job, as
medians over ``--rounds`` rounds: the writer's copy in and the reader's copy out in that
pattern, and the writer's copy alone (no reader copying, so the slot's lines never leave its
core).

On this project's VM (2 vCPUs of an AMD EPYC) about one job in four ran its copies 2.5-6x
slower than the others for its whole life (512 KiB: the writer 230-300 us instead of 30-50,
the reader 70 instead of 28), while the writer alone never did: what slows is moving cache
lines between the two cores, and a job keeps the memory it was given. A benchmark job of
Horovod or Open MPI draws the same lot, which is one reason to compare their best of several
jobs (``--repeats``) rather than one job each (docs/benchmarks.md, stop 58).

Must not touch: Horovod (plain processes, NumPy and ``mmap`` only).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

from horovod.benchmarks.collectives import human, parse_size

SLOW = 2.0  # a job whose handed-over copy takes this many times the fastest job's is "slow"


def _segment(nbytes: int) -> mmap.mmap:
    """A fresh shared mapping (a file in /dev/shm where there is one), unlinked at once."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="hvd-handoff-", dir=d)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)


def job(nbytes: int, rounds: int) -> dict[str, float]:
    """One pair of processes: medians (seconds) of the writer's copy with a reader and alone,
    and of the reader's copy."""
    import numpy as np

    slot = (nbytes + 4095) // 4096 * 4096
    seg = _segment(4096 + 2 * slot)
    words = np.frombuffer(seg, np.int64, 16, 0)  # [0]: the writer's round, [8]: the reader's
    view = memoryview(seg)

    def at(n: int) -> slice:
        return slice(4096 + (n % 2) * slot, 4096 + (n % 2) * slot + nbytes)

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        try:
            os.close(rfd)
            dst = np.empty(nbytes, np.uint8).data
            took = []
            for n in range(1, rounds + 1):
                words[8] = n
                while words[0] < n:
                    pass
                t0 = time.perf_counter()
                dst[:] = view[at(n)]
                took.append(time.perf_counter() - t0)
            os.write(wfd, repr(statistics.median(took)).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    src = np.ones(nbytes, np.uint8).data
    handed = []
    for n in range(1, rounds + 1):
        t0 = time.perf_counter()
        view[at(n)] = src
        handed.append(time.perf_counter() - t0)
        words[0] = n
        while words[8] < n:
            pass
    reader = float(os.read(rfd, 64).decode())
    os.close(rfd)
    os.waitpid(pid, 0)
    alone = []
    for n in range(rounds):
        t0 = time.perf_counter()
        view[at(n)] = src
        alone.append(time.perf_counter() - t0)
    del view, words
    seg.close()
    return {
        "writer": statistics.median(handed),
        "reader": reader,
        "alone": statistics.median(alone),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512K")
    ap.add_argument("--jobs", type=int, default=8, help="fresh process pairs per size")
    ap.add_argument("--rounds", type=int, default=2000, help="rounds per job (medians)")
    a = ap.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
    except (ValueError, IndexError):
        ap.error(f"--sizes: cannot read {a.sizes!r} (e.g. 128K,1M)")
    if not hasattr(os, "fork"):
        ap.error("needs os.fork (Linux or macOS)")
    if a.jobs < 1 or a.rounds < 1 or any(s < 1 for s in sizes):
        ap.error("--jobs, --rounds and every size must be 1 or more")
    print(f"{os.cpu_count()} CPUs; medians of {a.rounds} rounds per job, in microseconds")
    print("| size | job | writer, handing over | reader | writer alone |")
    print("|---|---|---|---|---|")
    for nbytes in sizes:
        runs = [job(nbytes, a.rounds) for _ in range(a.jobs)]
        fastest = min(r["writer"] for r in runs)
        for k, r in enumerate(runs, 1):
            mark = " (slow)" if r["writer"] >= SLOW * fastest else ""
            print(
                f"| {human(nbytes)} | {k} | {r['writer'] * 1e6:.1f}{mark} "
                f"| {r['reader'] * 1e6:.1f} | {r['alone'] * 1e6:.1f} |"
            )
        slow = sum(r["writer"] >= SLOW * fastest for r in runs)
        print(
            f"\n{human(nbytes)}: {slow} of {a.jobs} jobs slow (writer {SLOW:.0f}x the fastest "
            "job's or more)\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
