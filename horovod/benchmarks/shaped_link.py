"""Time to accuracy on a slow link: the communication playbook's methods side by side.

Builds two test hosts from network namespaces (``horovod.testing.netns``), shapes each host's
link with ``tc`` (default 100 Mbit/s and 2 ms each way), and trains the same PyTorch model (an
MLP on scikit-learn's digits, hidden layers wide enough that a gradient is ~1.2 MB) with
``horovodrun -np 2 -H hostA:1,hostB:1`` once per method, the same epochs and seed each:

    none, priority (PriorityDistributedOptimizer), fp16, int8, topk (2%, 10 exact steps),
    powersgd (rank 4), localsgd (H=8),
    diloco (H=8, outer lr 0.7, outer momentum 0.5: this run has only ~60 outer steps)

``--methods`` picks some, with settings after colons: ``topk:0.01``, ``powersgd:2``,
``localsgd:16``, ``diloco:0.7:0.9:8`` (outer lr, outer momentum, H).

Rank 0 evaluates the test split after every epoch (outside the timed training). The table gives
each method's final accuracy, the training time, the time until it first reached the plain
run's final accuracy minus one point (the issue's target), its speed-up over the plain run on
that, and the bytes that crossed the link (the hosts' interface counters).

    sudo python -m horovod.benchmarks.shaped_link [--rate 100mbit] [--delay 2ms] [--epochs 12]

Needs root, iproute2 (ip, tc), openssh-server and torch; results in docs/communication.md.

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

REPO = Path(__file__).resolve().parents[2]
METHODS = ("none", "priority", "fp16", "int8", "topk", "powersgd", "localsgd", "diloco")

WORKER = """
    import json, sys, time
    import numpy as np
    import torch
    import horovod.torch as hvd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    spec, epochs, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    method, *knobs = spec.split(":")  # e.g. topk:0.02, diloco:0.7:0.5, localsgd:16
    knobs = [float(k) for k in knobs]
    hvd.init()
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=0)
    xtr, xte = torch.tensor(xtr, dtype=torch.float32), torch.tensor(xte, dtype=torch.float32)
    ytr, yte = torch.tensor(ytr), torch.tensor(yte)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = model.named_parameters()
    C = hvd.Compression
    if method in ("none", "fp16", "int8", "topk", "powersgd"):
        comp = {"none": lambda: C.none, "fp16": lambda: C.fp16, "int8": lambda: C.int8,
                "topk": lambda: C.topk(knobs[0] if knobs else 0.02, warmup_steps=10),
                "powersgd": lambda: C.powersgd(rank=int(knobs[0]) if knobs else 4)}[method]()
        opt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
    elif method == "priority":
        opt = hvd.PriorityDistributedOptimizer(opt, model)
    elif method == "localsgd":
        opt = hvd.LocalSGD(opt, sync_every=int(knobs[0]) if knobs else 8)
    else:
        lr, mu = (knobs + [0.7, 0.5][len(knobs):])[:2] if len(knobs) < 3 else knobs[:2]
        opt = hvd.DiLoCo(opt, sync_every=int(knobs[2]) if len(knobs) > 2 else 8,
                         outer_lr=lr, outer_momentum=mu)
    mine = torch.arange(hvd.rank(), len(ytr), hvd.size())
    trained, curve, steps = 0.0, [], 0
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(epoch)
        order = mine[torch.randperm(len(mine), generator=g)]
        hvd.barrier()
        t0 = time.perf_counter()
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            steps += 1
        if method in ("localsgd", "diloco") and epoch == epochs - 1:
            opt.sync()
        if method == "priority":
            opt.synchronize()  # the last step's updates (the next forward would apply them)
        hvd.barrier()
        trained += time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        curve.append((trained, acc))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"curve": curve, "steps": steps}), flush=True)
    hvd.shutdown()
"""


def link_bytes(net: TestNetwork) -> int:
    total = 0
    for h in net.hosts:
        r = net.exec(h, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=True)
        total += int(r.stdout.strip())
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--delay", default="2ms")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--methods", default=",".join(METHODS))
    a = p.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = sorted({m.split(":")[0] for m in methods} - set(METHODS))
    if unknown or "none" not in methods:
        print(f"--methods: give some of {', '.join(METHODS)}, including none", file=sys.stderr)
        return 2
    net = TestNetwork(["hostA", "hostB"])
    work = Path(tempfile.mkdtemp(prefix="hvd-shaped-"))
    (work / "worker.py").write_text(textwrap.dedent(WORKER))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    results: dict[str, dict] = {}
    try:
        shaped = net.shape(a.rate, a.delay)
        for method in methods:
            before = link_bytes(net)
            r = net.exec(
                "hostA",
                [
                    sys.executable,
                    "-m",
                    "horovod.runner.launch",
                    *net.launcher_args(),
                    "-np",
                    "2",
                    "-H",
                    "hostA:1,hostB:1",
                    sys.executable,
                    str(work / "worker.py"),
                    method,
                    str(a.epochs),
                    str(a.hidden),
                ],
                cwd=work,
                env=env,
                timeout=1800,
            )
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
                return 1
            line = next(x for x in r.stdout.splitlines() if "RESULT " in x)
            results[method] = json.loads(line.split("RESULT ", 1)[1])
            results[method]["bytes"] = link_bytes(net) - before
            print(f"{method}: done", file=sys.stderr, flush=True)
    finally:
        net.close()
    print(report(results, shaped, a))
    return 0


def report(results: dict[str, dict], shaped: str, a: argparse.Namespace) -> str:
    plain = results["none"]
    target = plain["curve"][-1][1] - 0.01
    t_plain = reached(plain["curve"], target)
    lines = [
        f"2 hosts x 1 rank, link {shaped}; MLP 64-{a.hidden}-{a.hidden}-10 on digits, "
        f"{a.epochs} epochs, batch 32 per rank; target = plain final accuracy - 1 point "
        f"= {target:.3f}",
        "",
        "| method | final accuracy | training time | time to target | speed-up to target "
        "| bytes on the link |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, r in results.items():
        curve = r["curve"]
        t = reached(curve, target)
        speed = f"{t_plain / t:.1f}x" if t and t_plain else "-"
        lines.append(
            f"| {method} | {curve[-1][1]:.3f} | {curve[-1][0]:.1f} s | "
            f"{f'{t:.1f} s' if t else 'not reached'} | {speed} | {r['bytes'] / 1e6:.1f} MB |"
        )
    return "\n".join(lines)


def reached(curve: list, target: float) -> float | None:
    for t, acc in curve:
        if acc >= target:
            return float(t)
    return None


if __name__ == "__main__":
    sys.exit(main())
