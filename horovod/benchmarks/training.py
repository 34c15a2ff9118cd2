"""Training benchmark: horovod.torch vs PyTorch DDP (Gloo), same model and data, 1 and 2 ranks.

    python -m horovod.benchmarks.training                      # convnet and mlp200
    python -m horovod.benchmarks.training --models resnet_small --steps 40
    python -m horovod.benchmarks.training --timeline-overhead   # timeline on vs off, 2 ranks

Every rank is one process with one thread (``torch.set_num_threads(1)``), training on a fixed
synthetic batch. Printed per model: samples/s (all ranks together) of a plain single process,
of horovod.torch and of DDP at 1 and 2 ranks, the scaling efficiency of each (throughput at 2
ranks / (2 x its throughput at 1 rank), and against the plain single process), and the
horovod/DDP ratio at 2 ranks (> 1 means horovod.torch trains faster).

Two references. Two plain processes training at the same time without any communication:
what they reach together against twice one alone ("ceiling eff.") is what sharing the cores,
caches and memory bandwidth costs by itself. Two plain processes in lockstep: the same, plus a
4-byte allreduce after every step, so that each step starts on both ranks together, as in
synchronous data-parallel training, but no gradient moves ("lockstep eff."): every step then
lasts as long as the slower rank's, which is what synchronous training costs on the machine
before any communication, the most horovod.torch or DDP can reach there.
``--repeats R`` makes R passes over all configurations in turn and keeps each one's best, so
that a slow phase of a shared machine lands on every configuration alike. A second table gives
the ratios computed within each pass (runs made moments apart), their median over the passes
and their range: how much of a figure is the machine's phase rather than the code.
``--flush-subnormals`` has every process (the references, horovod.torch and DDP alike) compute
with subnormal floats flushed to zero (``torch.set_flush_denormal(True)``): on x86 an
arithmetic operation on a subnormal operand or result takes a microcode assist, and mlp200's
gradients vanish through its 100 layers (about a third of their values are subnormal), so
without it torch's backward, the optimizer and averaging the gradients run several times slower
on that model in every configuration (docs/benchmarks.md, "Subnormal gradients"). Under the
tables the benchmark prints each model's share of subnormal gradient values (a plain
process's last step).
``--baseline DIR`` also runs horovod.torch from another checkout (``DIR`` holds its ``horovod``
package) in every pass, and prints every row again for it ("model (baseline)"), with the
paired ratio of this code's horovod to the baseline's at 2 ranks.

Must not touch: the runtime's internals (it uses ``horovod.torch`` like a user).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from horovod.benchmarks import launch

# Set (to "1") in the environment the workers inherit by ``--flush-subnormals``.
FLUSH_SUBNORMALS_ENV = "HVD_BENCH_FLUSH_SUBNORMALS"


def _train(model, optimizer, steps: int, warmup: int, batch: int, after=None) -> float:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if after is not None:
            after()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - t0


def subnormal_share(model) -> float:
    """The share of ``model``'s floating-point gradient values that are subnormal (nonzero,
    below the type's smallest normal): every multiplication on one takes x86 a microcode
    assist, so a large share slows training in every configuration alike."""
    import torch

    grads = [g for p in model.parameters() if (g := p.grad) is not None and g.is_floating_point()]
    total = sum(g.numel() for g in grads)
    found = sum(int(((g != 0) & (g.abs() < torch.finfo(g.dtype).tiny)).sum()) for g in grads)
    return found / total if total else 0.0


def worker(kind: str, model_name: str, steps: int, warmup: int, batch: int, out: str) -> None:
    import torch

    from horovod.benchmarks.models import MODELS

    torch.set_num_threads(1)
    if os.environ.get(FLUSH_SUBNORMALS_ENV) == "1":
        torch.set_flush_denormal(True)  # (this thread's, the one that trains)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if kind == "plain":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        seconds, size, rank = _train(model, opt, steps, warmup, batch), 1, 0
    elif kind == "lockstep":
        import horovod.torch as hvd

        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        tick = torch.zeros(1)
        seconds = _train(
            model, opt, steps, warmup, batch, lambda: hvd.allreduce_(tick, name="lockstep")
        )
        size, rank = hvd.size(), hvd.rank()
        seconds = float(hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="time"))
    elif kind == "horovod":
        import horovod.torch as hvd

        hvd.init()
        base = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        seconds = _train(model, opt, steps, warmup, batch)
        size, rank = hvd.size(), hvd.rank()
        seconds = float(hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="time"))
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        size, rank = dist.get_world_size(), dist.get_rank()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01 * size, momentum=0.9)
        seconds = _train(ddp, opt, steps, warmup, batch)
        t = torch.tensor(seconds)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t)
        dist.destroy_process_group()
    if rank == 0:
        report = {"samples_per_s": size * batch * steps / seconds}
        if kind == "plain":  # (the gradients of its last step)
            report["subnormal_share"] = subnormal_share(model)
        with open(out, "w") as f:
            json.dump(report, f)


BASELINE: dict[str, str] = {}  # the environment running the baseline checkout (``--baseline``)
# Per model, the share of subnormal gradient values a plain process saw (printed under the
# tables: a large one means multiplications on them dominate every configuration's step).
SUBNORMAL_SHARE: dict[str, float] = {}


def run(
    kind: str,
    np_: int,
    model: str,
    steps: int,
    warmup: int,
    batch: int,
    extra_env: dict[str, str] | None = None,
) -> float:
    if kind == "plain" and np_ > 1:
        return _run_independent(np_, model, steps, warmup, batch)
    if kind == "base":  # horovod.torch from the baseline checkout
        kind, extra_env = "horovod", {**(extra_env or {}), **BASELINE}
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    args = launch.worker_args("horovod.benchmarks.training", kind, model, steps, warmup, batch, out)
    launchers = {
        "plain": "none",
        "lockstep": "horovodrun",
        "horovod": "horovodrun",
        "ddp": "torchrun",
    }
    launcher = launchers[kind]
    launch.run(launcher, np_, args, extra_env)
    with open(out) as f:
        report = json.load(f)
    os.unlink(out)
    if "subnormal_share" in report:
        SUBNORMAL_SHARE[model] = report["subnormal_share"]
    return float(report["samples_per_s"])


def _run_independent(np_: int, model: str, steps: int, warmup: int, batch: int) -> float:
    """``np_`` plain processes at once, with no communication at all: their samples/s
    together. What sharing the machine's cores, caches and memory bandwidth alone costs: the
    ceiling of any data-parallel job's scaling efficiency here."""
    outs = [tempfile.NamedTemporaryFile(suffix=".json", delete=False).name for _ in range(np_)]
    procs = []
    try:
        for out in outs:
            args = launch.worker_args(
                "horovod.benchmarks.training", "plain", model, steps, warmup, batch, out
            )
            cmd, env = launch.command("none", 1, args)
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        try:
            errs = [p.communicate(timeout=launch.DEFAULT_TIMEOUT_S)[1] for p in procs]
        except subprocess.TimeoutExpired:
            raise launch.LaunchFailed("a plain process", None, "", hung=True) from None
        for p, err in zip(procs, errs, strict=True):
            if p.returncode != 0:
                tail = err.decode(errors="replace")[-3000:]
                raise launch.LaunchFailed("a plain process", p.returncode, tail)
        total = 0.0
        for out in outs:
            with open(out) as f:
                total += json.load(f)["samples_per_s"]
        return total
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr is not None:
                p.stderr.close()
        for out in outs:
            os.unlink(out)


def timeline_overhead(models: list[str], steps: int, warmup: int, batch: int, repeats: int) -> None:
    """horovod.torch at 2 ranks with and without a timeline being written (interleaved runs,
    best of ``repeats`` each): what recording costs."""
    print("| model | timeline off (samples/s) | timeline on | on/off | timeline events |")
    print("|---|---|---|---|---|")
    for model in models:
        off, on, events = 0.0, 0.0, 0
        for _ in range(repeats):
            off = max(off, run("horovod", 2, model, steps, warmup, batch))
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "timeline.json")
                tl = {"HOROVOD_TIMELINE": path}
                on = max(on, run("horovod", 2, model, steps, warmup, batch, tl))
                with open(path) as f:
                    events = len(json.load(f))
        print(f"| {model} | {off:.0f} | {on:.0f} | {on / off:.3f} | {events} |", flush=True)


PAIRED = (
    "lockstep eff. (vs plain)",
    "horovod eff. (vs plain)",
    "DDP eff. (vs plain)",
    "horovod / lockstep at 2",
    "horovod / DDP at 2",
)


Figures = dict[tuple[str, int], "float | None"]  # samples/s per (kind, ranks); None: failed


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _cell(value: float | None, fmt: str) -> str:
    return "failed" if value is None else fmt.format(value)


def paired(passes: list[Figures], hvd: str = "horovod") -> list[str]:
    """The ratios of ``PAIRED``, each computed from the figures of one pass, as "median
    (lowest-highest)" over the passes. Taking each configuration's best pass (the main table)
    may pair one configuration's lucky moment with another's unlucky one on a shared
    machine; a ratio within a pass compares runs made moments apart. ``hvd``: the
    configuration standing for horovod.torch ("base": the baseline checkout's). A pass where
    a run failed gives no ratio that needs it ("failed" where no pass gave one)."""

    def ratios(p: Figures) -> list[float | None]:
        plain = p[("plain", 1)]
        plain2 = None if plain is None else 2 * plain
        return [
            _ratio(p[("lockstep", 2)], plain2),
            _ratio(p[(hvd, 2)], plain2),
            _ratio(p[("ddp", 2)], plain2),
            _ratio(p[(hvd, 2)], p[("lockstep", 2)]),
            _ratio(p[(hvd, 2)], p[("ddp", 2)]),
        ]

    columns = list(zip(*map(ratios, passes), strict=True))
    cells = []
    for name, column in zip(PAIRED, columns, strict=True):
        fmt = "{:.2f}x" if name.endswith("at 2") else "{:.0%}"
        values = [v for v in column if v is not None]
        if not values:
            cells.append("failed")
            continue
        mid, lo, hi = statistics.median(values), min(values), max(values)
        cells.append(f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})")
    return cells


def row(label: str, r: Figures, hvd: str = "horovod") -> str:
    """One line of the main table from the best figures ``r``; ``hvd``: the configuration
    standing for horovod.torch ("base": the baseline checkout's); "failed" where a figure
    (or one a ratio needs) failed in every pass."""
    plain = r[("plain", 1)]
    plain2 = None if plain is None else 2 * plain

    def eff(kind: str) -> str:
        one = r[(kind, 1)]
        return (
            f"{_cell(_ratio(r[(kind, 2)], None if one is None else 2 * one), '{:.0%}')} / "
            f"{_cell(_ratio(r[(kind, 2)], plain2), '{:.0%}')}"
        )

    cells = [_cell(r[c], "{:.0f}") for c in [("plain", 1), ("plain", 2), ("lockstep", 2)]]
    cells += [_cell(r[c], "{:.0f}") for c in [(hvd, 1), (hvd, 2), ("ddp", 1), ("ddp", 2)]]
    cells += [
        _cell(_ratio(r[("plain", 2)], plain2), "{:.0%}"),
        _cell(_ratio(r[("lockstep", 2)], plain2), "{:.0%}"),
        eff(hvd),
        eff("ddp"),
        _cell(_ratio(r[(hvd, 2)], r[("ddp", 2)]), "{:.2f}x"),
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


OURS = {"lockstep", "horovod"}  # this code's runs: one failing fails the benchmark


Failure = tuple[str, str, int, launch.LaunchFailed]  # model, kind, ranks, what happened


def measure_pass(
    model: str, configs: list[tuple[str, int]], a: argparse.Namespace, failures: list[Failure]
) -> Figures:
    """One pass over ``configs``: samples/s of each, None for a run that crashed or hung
    (added to ``failures``; its whole stderr tail goes to stderr at once)."""
    figures: Figures = {}
    for kind, np_ in configs:
        try:
            figures[(kind, np_)] = run(kind, np_, model, a.steps, a.warmup, a.batch_size)
        except launch.LaunchFailed as e:
            figures[(kind, np_)] = None
            failures.append((model, kind, np_, e))
            print(f"{model}, {kind} at {np_} rank(s): {e}", file=sys.stderr, flush=True)
    return figures


def best(passes: list[Figures], config: tuple[str, int]) -> float | None:
    values = [v for p in passes if (v := p[config]) is not None]
    return max(values) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="convnet,mlp200")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes over all configurations, interleaved (each one's best pass is kept)",
    )
    ap.add_argument(
        "--timeline-overhead", action="store_true", help="measure timeline on vs off instead"
    )
    ap.add_argument(
        "--flush-subnormals",
        action="store_true",
        help="every process computes with subnormal floats flushed to zero (see above)",
    )
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run another checkout's horovod.torch (DIR holds its horovod package)",
    )
    ap.add_argument(
        "--worker", choices=["plain", "lockstep", "horovod", "ddp"], help=argparse.SUPPRESS
    )
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.models, a.steps, a.warmup, a.batch_size, a.out)
        return 0
    if a.flush_subnormals:
        os.environ[FLUSH_SUBNORMALS_ENV] = "1"  # (every worker inherits it)
    print(
        f"host: {socket.gethostname()}, {os.cpu_count()} CPUs; batch {a.batch_size} per rank, "
        f"{a.steps} timed steps, best of {a.repeats} interleaved passes; "
        "samples/s of all ranks together"
        + ("; subnormals flushed to zero in every process" if a.flush_subnormals else "")
        + "\n"
    )
    if a.baseline:
        BASELINE.update(launch.baseline_env(a.baseline))
    if a.timeline_overhead:
        timeline_overhead(a.models.split(","), a.steps, a.warmup, a.batch_size, a.repeats)
        return 0
    print(
        "| model | plain 1 proc | 2 plain procs at once (no comm.) | 2 plain procs in lockstep | "
        "horovod 1 | horovod 2 | DDP 1 | DDP 2 | ceiling eff. (2 plain procs vs plain) | "
        "lockstep eff. (vs plain) | horovod eff. (vs 1 rank / vs plain) | "
        "DDP eff. (vs 1 rank / vs plain) | horovod/DDP at 2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    paired_rows: list[str] = []
    versus_base: list[str] = []
    failures: list[Failure] = []
    for model in a.models.split(","):
        configs = [
            ("plain", 1),
            ("plain", 2),
            ("lockstep", 2),
            ("horovod", 1),
            ("horovod", 2),
            ("ddp", 1),
            ("ddp", 2),
        ]
        if BASELINE:
            configs += [("base", 1), ("base", 2)]
        # Passes over every configuration (a slow phase hits all); each one's best pass.
        passes = [measure_pass(model, configs, a, failures) for _ in range(a.repeats)]
        r = {c: best(passes, c) for c in configs}
        for hvd, label in [("horovod", model)] + (
            [("base", f"{model} (baseline)")] if BASELINE else []
        ):
            paired_rows.append(
                f"| {label} | {len(passes)} | " + " | ".join(paired(passes, hvd)) + " |"
            )
            print(row(label, r, hvd), flush=True)
        if BASELINE:
            ab = [v for p in passes if (v := _ratio(p[("horovod", 2)], p[("base", 2)]))]
            within = (
                f"{statistics.median(ab):.3f}x ({min(ab):.3f}x-{max(ab):.3f}x)" if ab else "failed"
            )
            best_ratio = _cell(_ratio(r[("horovod", 2)], r[("base", 2)]), "{:.3f}x")
            versus_base.append(f"| {model} | {best_ratio} | {within} |")
    print(
        "\nPaired within each pass (the configurations of one pass ran within a minute or two "
        "of each other), median over the passes (lowest-highest):\n"
    )
    print("| model | passes | " + " | ".join(PAIRED) + " |")
    print("|---|---|" + "---|" * len(PAIRED))
    for line in paired_rows:
        print(line)
    if SUBNORMAL_SHARE:
        shares = ", ".join(f"{m} {v:.1%}" for m, v in SUBNORMAL_SHARE.items())
        print(
            f"\nGradient values that are subnormal (a plain process's last step): {shares}. "
            "On x86 every multiplication on one takes a microcode assist, in every configuration "
            "alike (--flush-subnormals flushes them to zero in every process)."
        )
    if versus_base:
        print("\nThis code's horovod.torch against the baseline's at 2 ranks (samples/s ratio):\n")
        print("| model | best pass vs best pass | paired within each pass, median (range) |")
        print("|---|---|---|")
        for line in versus_base:
            print(line)
    if failures:
        print("\nRuns that failed (recorded as failed for their pass; the others went on):\n")
        for model, kind, np_, e in failures:
            print(f"- {model}, {kind} at {np_} rank(s): {e.summary()}")
    return 1 if any(kind in OURS for _, kind, _, _ in failures) else 0


if __name__ == "__main__":
    sys.exit(main())
