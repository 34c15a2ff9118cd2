"""Data rounds against plane rounds, timed in one job: which way a cached op should go.

    python -m horovod.benchmarks.rounds                    # 2 ranks, shared memory
    python -m horovod.benchmarks.rounds --plane tcp        # TCP alone (HOROVOD_SHARED_MEMORY=0)
    python -m horovod.benchmarks.rounds --plane mpi        # under mpirun, MPI's collectives
    python -m horovod.benchmarks.rounds --np 3 --sizes 64K,256K

A cached op that is alone in flight takes a peer round: a *data* round carries its data on the
board and every rank computes the result from the posts; a *plane* round carries its id only,
and the op then runs on the data plane (or MPI). The engine picks by size: allgathers and
broadcasts whose posts fit the board's room, allreduces up to ``round_allreduce_budget``.
Whether that pick is right depends on the machine, and on this project's 2-CPU VM consecutive
benchmark jobs differ by 20% and more, more than the choice is worth. So each rank here
switches between the two ways every ``--calls`` calls (after a barrier, every rank at the same
call), ``--blocks`` times, and compares each block with its neighbour: the figures are the
medians of the block medians and of the paired ratios (plane time / data time, > 1: the data
round is faster), with their range. "engine" says which way the engine takes the op now.

Only sizes within the board's room can take a data round (a larger post would be malformed to
the peers); larger ones are skipped.

Must not touch: the runtime beyond switching the engine's size limits (``board_data``,
``round_budget``, ``round_broadcast``) between blocks, which every rank does at the same call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from horovod.benchmarks import launch
from horovod.benchmarks.collectives import human, parse_size

OPS = ("allreduce", "allgather", "broadcast")
PLANES = {
    "shm": ("horovodrun", {}),
    "tcp": ("horovodrun", {"HOROVOD_SHARED_MEMORY": "0"}),
    "mpi": ("mpirun", {"HOROVOD_CPU_OPERATIONS": "mpi"}),
}


def worker(sizes: list[int], blocks: int, calls: int) -> dict:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.testing import engine as running_engine

    hvd.init()
    engine = running_engine()
    n, me = hvd.size(), hvd.rank()
    room = engine.board_data  # (0: this job has no board)
    limits = {"data": (room, room, room), "plane": (0, 0, 0)}
    engine_pick = (engine.board_data, engine.round_budget, engine.round_broadcast)
    out: dict = {"room": room, "budget": engine.round_budget, "skipped": []}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        part = np.ones(nbytes // 4 // n, np.float32)
        posted = {"allreduce": x.nbytes, "allgather": part.nbytes, "broadcast": x.nbytes}
        runs = {
            "allreduce": lambda: hvd.allreduce_(x, op=hvd.Sum, name=f"r.ar{nbytes}"),
            "allgather": lambda: hvd.allgather(part, name=f"r.ag{nbytes}"),
            "broadcast": lambda: hvd.broadcast_(x, 0, name=f"r.bc{nbytes}"),
        }
        for op in OPS:
            if posted[op] > room:
                out["skipped"].append(f"{op} {nbytes}")
                continue
            fn = runs[op]
            fn()  # (negotiated by rank 0 once: cached from here)
            times: dict[str, list[float]] = {"data": [], "plane": []}
            asked = 0  # timed calls that went the way their block asked for
            stats = engine.stats
            for b in range(blocks):
                for way in ("data", "plane") if b % 2 == 0 else ("plane", "data"):
                    hvd.barrier()
                    engine.board_data, engine.round_budget, engine.round_broadcast = limits[way]
                    for _ in range(3):
                        fn()
                    ts = []
                    before = stats["data_rounds"]
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                    times[way].append(statistics.median(ts))
                    data_rounds = stats["data_rounds"] - before
                    asked += data_rounds if way == "data" else calls - data_rounds
            hvd.barrier()
            engine.board_data, engine.round_budget, engine.round_broadcast = engine_pick
            takes = posted[op] <= engine_pick[0] and (
                (op != "allreduce" or posted[op] <= engine_pick[1])
                and (op != "broadcast" or posted[op] <= engine_pick[2])
            )
            share = asked / (2 * blocks * calls)
            out[f"{op}:{nbytes}"] = (
                times["data"],
                times["plane"],
                "data" if takes else "plane",
                share,
            )
    hvd.shutdown()
    return out if me == 0 else {}


def table(data: dict, np_: int, plane: str) -> str:
    lines = [
        f"{np_} ranks, {plane} (board room {human(data['room'])}, data rounds for allreduces "
        f"up to {human(data['budget'])}); block medians, paired ratio plane/data (> 1: the "
        "data round is faster); as asked: the share of this rank's calls that went the way their "
        "block asked (a round whose posts differ falls back to rank 0 and counts as a plane round)",
        "| op | size | data round | plane round | plane/data (range) | engine | as asked |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, value in data.items():
        if ":" not in key:
            continue
        d, p, pick, share = value
        op, nbytes = key.split(":")
        ratios = [b / a for a, b in zip(d, p, strict=True)]
        lines.append(
            f"| {op} | {human(int(nbytes))} | {statistics.median(d) * 1e6:.0f} us "
            f"| {statistics.median(p) * 1e6:.0f} us | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {pick} | {share:.0%} |"
        )
    if data["skipped"]:
        lines.append(
            "skipped (a post beyond the board's room): "
            + ", ".join(f"{w.split()[0]} {human(int(w.split()[1]))}" for w in data["skipped"])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--plane", choices=sorted(PLANES), default="shm")
    ap.add_argument("--sizes", default="64K,256K,512K,1M")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per way (alternating)")
    ap.add_argument("--calls", type=int, default=40, help="timed calls per block")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.blocks < 1 or a.calls < 1:
        ap.error("--blocks and --calls must be at least 1")
    if a.worker:
        launch.report(a.out, worker(sizes, a.blocks, a.calls))
        return 0
    args = ["horovod.benchmarks.rounds", "--worker", "--sizes", a.sizes]
    args += ["--blocks", str(a.blocks), "--calls", str(a.calls)]
    launcher, env = PLANES[a.plane]
    try:
        data = launch.collect(launcher, a.np, args, extra_env=env)
    except launch.LaunchFailed as e:
        print(f"the {a.plane} job failed: {e}", file=sys.stderr)
        return 1
    print(table(data, a.np, a.plane))
    return 0


if __name__ == "__main__":
    sys.exit(main())
