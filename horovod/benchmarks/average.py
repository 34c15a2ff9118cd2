"""Average allreduce: this checkout against another (``--baseline``), interleaved runs.

    python -m horovod.benchmarks.average --baseline /tmp/base --repeats 5

What an Average costs beyond a Sum is the division by the number of ranks (a correctly rounded
division, as upstream's frameworks divide). Each run is a ``horovodrun -np N`` job timing
``hvd.allreduce(x, op=hvd.Average)`` at a few sizes (best of 3 loops), with normal values and,
for the rows that say so, a third of them subnormal (what a gradient bucket can hold late in
training: scaling a subnormal costs x86 a microcode assist); runs of this code and of the
baseline alternate, and the table gives each one's median over the runs and their ratio
(> 1: this code is faster). ``--quick``: a few calls per row (a smoke test).

Must not touch: the runtime's internals (it uses ``horovod.numpy`` like a user).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from horovod.benchmarks import launch

# (bytes, whether a third of the values are subnormal): the rows of the table
ROWS = (
    (4, False),
    (64 << 10, False),
    (1 << 20, False),
    (1 << 20, True),
    (2400 << 10, False),
    (2400 << 10, True),
    (16 << 20, False),
    (16 << 20, True),
)


def label(nbytes: int, subnormal: bool) -> str:
    return f"{nbytes}" + (", a third subnormal" if subnormal else "")


def data(nbytes: int, subnormal: bool, rank: int):  # noqa: ANN201
    import numpy as np

    x = np.full(max(1, nbytes // 4), 1 + rank, np.float32)
    if subnormal:
        x[::3] = np.float32(2.0**-140)
    return x


def worker(out: str, quick: bool) -> None:
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    result = {}
    for nbytes, subnormal in ROWS:
        x = data(nbytes, subnormal, hvd.rank())
        name = f"average.{label(nbytes, subnormal)}"
        for _ in range(5):
            hvd.allreduce(x, op=hvd.Average, name=name)
        reps = 2000 if nbytes <= 64 << 10 else 200 if nbytes <= 1 << 20 else 30
        best = float("inf")
        for _ in range(1 if quick else 3):
            t0 = time.perf_counter()
            for _ in range(2 if quick else reps):
                hvd.allreduce(x, op=hvd.Average, name=name)
            best = min(best, (time.perf_counter() - t0) / (2 if quick else reps))
        got = hvd.allreduce(np.array([best]), op=hvd.Max, name="t")[0]
        result[label(nbytes, subnormal)] = float(got)
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run(np_: int, env: dict[str, str], quick: bool) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        # this file by its path: a baseline checkout older than it has no such module
        args = [os.path.abspath(__file__), "--out", out.name] + (["--quick"] if quick else [])
        launch.run("horovodrun", np_, args, env)
        with open(out.name) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="DIR", required=False)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few calls per row (a smoke test)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.out:
        worker(a.out, a.quick)
        return 0
    # (PYTHONSAFEPATH: the worker, run by its path, must not import from its own folder)
    peers: dict[str, dict[str, str]] = {"ours": {"PYTHONSAFEPATH": "1"}}
    if a.baseline:
        peers["base"] = launch.baseline_env(a.baseline)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in peers}
    for _ in range(a.repeats):
        for peer, env in peers.items():
            runs[peer].append(run(a.np, env, a.quick))
    print(f"Average allreduce, {a.np} ranks, float32; median of {a.repeats} interleaved runs\n")
    head = "| size | " + " | ".join(f"{p} (us)" for p in peers)
    print(head + (" | ours/base |" if a.baseline else " |"))
    print("|---" * (len(peers) + 1 + bool(a.baseline)) + "|")
    for nbytes, subnormal in ROWS:
        row = label(nbytes, subnormal)
        med = {p: statistics.median(r[row] for r in runs[p]) for p in peers}
        cells = " | ".join(f"{med[p] * 1e6:.1f}" for p in peers)
        ratio = f" | {med['base'] / med['ours']:.2f}x |" if a.baseline else " |"
        print(f"| {row} | {cells}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
