"""Adasum's pairwise combination (``horovod.collectives.adasum.combine``): this checkout against
another (``--baseline``), in alternating processes.

    python -m horovod.benchmarks.adasum --baseline /tmp/base --repeats 3

Every rank of an Adasum allreduce combines the two groups' vectors at each level of the tree
(the dot product and squared norms per tensor, then the scaled sum), so its cost is the
collective's compute. Each process times ``combine`` over the layouts below (one tensor of a
size, or a fused buffer of many: what a Tensor Fusion buffer holds), best of 3 loops; processes
of this code and of the baseline alternate ``--repeats`` times, and the table gives each one's
median and the ratio (> 1: this code is faster).

Must not touch: anything but ``combine`` (pure computation, one process at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (label, float type, tensor sizes in elements)
LAYOUTS: list[tuple[str, str, list[int]]] = [
    ("one tensor of 100", "float32", [100]),
    ("one tensor of 1 Ki", "float32", [1 << 10]),
    ("one tensor of 16 Ki", "float32", [16 << 10]),
    ("one tensor of 256 Ki", "float32", [256 << 10]),
    ("one tensor of 4 Mi", "float32", [4 << 20]),
    ("one tensor of 2 Mi, float64", "float64", [2 << 20]),
    ("fused: 1000 tensors of 10", "float32", [10] * 1000),
    ("fused: 200 of 300", "float32", [300] * 200),
    ("fused: 50 of 3000", "float32", [3000] * 50),
    ("fused: a layer stack (weights and biases)", "float32", [65536, 256, 16384, 64, 640, 10] * 4),
]


def worker(out: str, quick: bool) -> None:
    import numpy as np

    from horovod.collectives.adasum import combine

    rng = np.random.default_rng(0)
    result = {}
    for label, dtype, counts in LAYOUTS:
        n = sum(counts)
        a = rng.standard_normal(n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
        res = np.empty_like(a)
        combine(a, b, counts, res)
        reps = 1 if quick else max(3, min(1000, int(2e6 // n)))
        best = float("inf")
        for _ in range(1 if quick else 3):
            t0 = time.perf_counter()
            for _ in range(reps):
                combine(a, b, counts, res)
            best = min(best, (time.perf_counter() - t0) / reps)
        result[label] = best
    with open(out, "w") as f:
        json.dump(result, f)


def run(path: str, quick: bool) -> dict[str, float]:
    """One process of the checkout whose ``horovod`` package lives in ``path``."""
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        # (this file by its path: a baseline checkout may not have it)
        args = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out.name]
        subprocess.run(args + (["--quick"] if quick else []), env=env, check=True)
        with open(out.name) as f:
            return json.load(f)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="another checkout (DIR holds its horovod package)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one call per layout (a smoke test)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.out, a.quick)
        return 0
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    checkouts = {"this": here}
    if a.baseline:
        checkouts["base"] = os.path.abspath(a.baseline)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in checkouts}
    for _ in range(a.repeats):
        for key, path in checkouts.items():
            runs[key].append(run(path, a.quick))
    heads = ["layout", *(f"{k} (median)" for k in checkouts)]
    if a.baseline:
        heads.append("base / this")
    print(f"\nAdasum combine, best of 3 loops per process, median of {a.repeats} processes each")
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for label, _, _ in LAYOUTS:
        med = {k: statistics.median(r[label] for r in runs[k]) for k in checkouts}
        cells = [label, *(f"{med[k] * 1e6:.1f} us" for k in checkouts)]
        if a.baseline:
            cells.append(f"{med['base'] / med['this']:.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
