"""Training in one job: horovod.torch against its references in the same two processes.

    python -m horovod.benchmarks.training_ab                    # convnet and mlp200, 2 ranks
    python -m horovod.benchmarks.training_ab --models mlp200 --rounds 20 --steps 10

``horovod.benchmarks.training`` runs every configuration in processes of its own, minutes
apart, and on a shared machine the phase moves between them by more than the differences it
looks for (the same code read 62-96% of a plain process over eight passes there). Here every
rank holds three copies of the model, with the same weights and the same batch:

- *lockstep*: plain SGD and a 4-byte allreduce after every step, so that each step starts on
  both ranks together but no gradient moves: what synchronous training costs on the machine
  before any communication, the most horovod.torch or DDP can reach;
- *horovod*: horovod.torch's ``DistributedOptimizer`` (its defaults);
- *DDP*: ``DistributedDataParallel`` over Gloo, a ``torch.distributed`` process group beside
  Horovod in the same processes.

A round trains each copy for ``--steps`` steps after ``--warmup`` untimed ones (its own
caches and buffers back in place), the three in an order that rotates from round to round;
a block's time is the slower rank's. Printed per model: the median milliseconds per step of
each, and the median and range over the rounds of each round's speed ratios, horovod to
lockstep and horovod to DDP (> 1: horovod faster), which moments apart see the same phase of
the machine. Issue 37's targets: horovod at 0.95x lockstep or more on both models, 1.15x DDP
or more on the conv model.

Must not touch: the runtime's internals (it uses ``horovod.torch`` and ``torch.distributed``
like a user).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from horovod.benchmarks import launch

KINDS = ("lockstep", "horovod", "ddp")
TARGETS = {"lockstep": 0.95, "ddp": 1.15}  # issue 37: horovod / lockstep, horovod / DDP


def worker(models: list[str], rounds: int, steps: int, warmup: int, batch: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.benchmarks.models import MODELS

    hvd.init()
    torch.set_num_threads(1)
    size = hvd.size()
    port = hvd.broadcast_object(launch.free_port() if hvd.rank() == 0 else None, 0, name="port")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=size
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    tick = torch.zeros(1)
    out: dict = {}
    for name in models:
        torch.manual_seed(0)
        first = MODELS[name]()
        copies = {k: MODELS[name]() for k in KINDS}
        for m in copies.values():
            m.load_state_dict(first.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(copies["ddp"])
        nets = {"lockstep": copies["lockstep"], "horovod": copies["horovod"], "ddp": ddp}
        opts = {
            "lockstep": torch.optim.SGD(nets["lockstep"].parameters(), lr=0.01, momentum=0.9),
            "horovod": hvd.DistributedOptimizer(
                torch.optim.SGD(nets["horovod"].parameters(), lr=0.01 * size, momentum=0.9),
                named_parameters=nets["horovod"].named_parameters(),
            ),
            "ddp": torch.optim.SGD(nets["ddp"].parameters(), lr=0.01 * size, momentum=0.9),
        }

        def block(kind: str, n: int) -> float:
            net, opt = nets[kind], opts[kind]
            hvd.allreduce_(tick, name="ab.start")  # (both ranks start the block together)
            t0 = time.perf_counter()
            for _ in range(n):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
                if kind == "lockstep":
                    hvd.allreduce_(tick, name="ab.lockstep")
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(rounds):
            for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                block(kind, warmup)
                mine = torch.tensor(block(kind, steps) / steps)
                times[kind].append(float(hvd.allreduce(mine, op=hvd.Max, name="ab.time")))
        out[name] = times
    dist.destroy_process_group()
    return out if hvd.rank() == 0 else {}


def summary(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Per reference: (median, lowest, highest) over the rounds of the round's horovod speed
    ratio to it (its step time over horovod's)."""
    out = {}
    for ref in ("lockstep", "ddp"):
        ratios = sorted(a / h for a, h in zip(times[ref], times["horovod"], strict=True))
        out[ref] = (statistics.median(ratios), ratios[0], ratios[-1])
    return out


def table(results: dict[str, dict[str, list[float]]], rounds: int, steps: int) -> list[str]:
    lines = [
        "| model | lockstep | horovod | DDP | horovod / lockstep (range) | "
        "horovod / DDP (range) | targets (0.95x lockstep; convnet 1.15x DDP) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, times in results.items():
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        s = summary(times)
        met = [s["lockstep"][0] >= TARGETS["lockstep"]]
        if name == "convnet":
            met.append(s["ddp"][0] >= TARGETS["ddp"])
        cells = [f"{ms[k]:.2f} ms" for k in KINDS] + [
            f"{s[r][0]:.3f}x ({s[r][1]:.3f}x-{s[r][2]:.3f}x)" for r in ("lockstep", "ddp")
        ]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {'met' if all(met) else 'not met'} |"
        )
    lines.append(
        f"\n(milliseconds per step: medians over {rounds} rounds of {steps} steps each, the "
        "slower rank's; ratios: speed, paired within each round)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="convnet,mlp200")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one block of each")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each block")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    from horovod.benchmarks.models import MODELS

    unknown = [m for m in models if m not in MODELS]
    if unknown or not models or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        ap.error(
            f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})"
            if unknown
            else "give at least one model, --rounds and --steps of 1 or more, --warmup >= 0"
        )
    if a.worker:
        launch.report(a.out, worker(models, a.rounds, a.steps, a.warmup, a.batch_size))
        return 0
    args = ["horovod.benchmarks.training_ab", "--worker", "--models", ",".join(models)]
    args += ["--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    args += ["--batch-size", str(a.batch_size)]
    results = launch.collect("horovodrun", a.np, args)
    print(
        f"\n{a.np} ranks, {os.cpu_count()} CPUs; batch {a.batch_size} per rank; lockstep, "
        "horovod.torch and DDP trained in turn in the same processes"
    )
    print("\n".join(table(results, a.rounds, a.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
