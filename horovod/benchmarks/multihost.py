"""Flat vs hierarchical allreduce/allgather across two hosts joined by a shaped link.

Builds two test hosts from network namespaces with their own sshd (``horovod.testing.netns``),
shapes each host's link with ``tc netem`` (default: 1 Gbit/s and 0.2 ms each way), runs
``horovodrun -np 4 -H hostA:2,hostB:2`` over ssh with and without
``--hierarchical-allreduce --hierarchical-allgather``, and prints median times and the ratio.
Ranks on one host talk through shared memory, the two hosts through TCP over the shaped link.

    sudo python -m horovod.benchmarks.multihost [--rate 1gbit] [--delay 0.2ms] [--iters 20]

Needs root, iproute2 (ip, tc) and openssh-server; results in docs/benchmarks.md.

Must not touch: the runtime's internals (it runs ``horovodrun`` on the test hosts like a user).
"""

from __future__ import annotations

import argparse
import json
import os
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
    net = TestNetwork(["hostA", "hostB"])
    work = Path(tempfile.mkdtemp(prefix="hvd-bench-"))
    (work / "worker.py").write_text(textwrap.dedent(WORKER))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        shaped = "link " + net.shape(a.rate, a.delay)
        results = {}
        for mode, flags in (
            ("flat", []),
            ("hierarchical", ["--hierarchical-allreduce", "--hierarchical-allgather"]),
        ):
            r = net.exec(
                "hostA",
                [
                    sys.executable,
                    "-m",
                    "horovod.runner.launch",
                    *net.launcher_args(),
                    "-np",
                    "4",
                    "-H",
                    "hostA:2,hostB:2",
                    *flags,
                    sys.executable,
                    str(work / "worker.py"),
                    str(a.iters),
                ],
                cwd=work,
                env=env,
                timeout=900,
            )
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
                return 1
            line = next(x for x in r.stdout.splitlines() if "TIMES " in x)
            results[mode] = json.loads(line.split("TIMES ", 1)[1])
    finally:
        net.close()
    print(
        f"4 ranks = 2 hosts x 2 (shared memory within a host), {shaped}; median of "
        f"{a.iters} per size, slowest rank\n"
    )
    print("| op | bytes per rank | flat | hierarchical | flat / hierarchical |")
    print("|---|---:|---:|---:|---:|")
    for key, flat in results["flat"].items():
        op, nbytes = key.split()
        hier = results["hierarchical"][key]
        print(
            f"| {op} | {int(nbytes):,} | {flat * 1e3:.2f} ms | {hier * 1e3:.2f} ms | "
            f"{flat / hier:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
