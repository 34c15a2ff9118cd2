"""JAX training benchmark: horovod.jax against plain JAX and JAX's own multi-process runtime.

    python -m horovod.benchmarks.jax_training
    python -m horovod.benchmarks.jax_training --steps 200 --repeats 3

The same MLP and synthetic batch everywhere, a jitted step with optax's Adam, one XLA thread per
process. Printed per model: samples/s (all ranks together) of a plain single process, of
horovod.jax at 1 and 2 ranks (``horovodrun``; the gradients averaged inside the jitted step by
``hvd.DistributedOptimizer``) and of ``jax.distributed`` at 2 processes (a mesh over both
processes' CPU devices, the batch sharded, the parameters replicated: XLA inserts the gradient
allreduce, over Gloo), the scaling efficiency of each against the plain process, and the
horovod / jax.distributed ratio (> 1: horovod trains faster). A run that fails is recorded as
failed (see ``launch``), the others go on.

Must not touch: the runtime's internals (it uses ``horovod.jax`` like a user).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from horovod.benchmarks import launch

MODELS = {"mlp": (784, 512, 512, 10), "wide": (784, 2048, 2048, 10)}
# One XLA thread per process, as every other benchmark here runs one thread per rank.
XLA_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}  # (launch sets OMP_NUM_THREADS=1)


def _init(sizes, key):  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp

    params = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (a, b)) * (2.0 / a) ** 0.5, jnp.zeros(b)))
    return params


def _loss(params, x, y):  # type: ignore[no-untyped-def]
    import jax
    import optax

    h = x
    for w, b in params[:-1]:
        h = jax.nn.relu(h @ w + b)
    w, b = params[-1]
    return optax.softmax_cross_entropy_with_integer_labels(h @ w + b, y).mean()


def worker(
    kind: str, model: str, steps: int, warmup: int, batch: int, out: str, extra: list
) -> None:
    import jax
    import numpy as np
    import optax

    sizes = MODELS[model]
    rng = np.random.default_rng(0)
    x_local = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y_local = rng.integers(0, sizes[-1], batch).astype(np.int32)
    size, rank = 1, 0
    if kind == "horovod":
        import horovod.jax as hvd

        hvd.init()
        size, rank = hvd.size(), hvd.rank()
        opt = hvd.DistributedOptimizer(optax.adam(1e-3))
        x, y = x_local, y_local
    elif kind == "jaxdist":
        n, rank, port = int(extra[0]), int(extra[1]), extra[2]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        size = n
        mesh = jax.make_mesh((n,), ("data",))
        data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        x = jax.make_array_from_process_local_data(data, x_local)
        y = jax.make_array_from_process_local_data(data, y_local)
        opt = optax.adam(1e-3)
    else:
        opt = optax.adam(1e-3)
        x, y = x_local, y_local
    params = _init(sizes, jax.random.PRNGKey(0))
    if kind == "jaxdist":
        params = jax.device_put(params, rep)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):  # type: ignore[no-untyped-def]
        grads = jax.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(warmup):
        params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    if kind == "horovod":
        seconds = float(hvd.allreduce(np.array([seconds]), op=hvd.Max, name="time")[0])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"samples_per_s": size * batch * steps / seconds}, f)
    if kind == "jaxdist":
        jax.distributed.shutdown()


def _spawn(n: int, argvs: list[list[str]], what: str) -> None:
    """Run ``n`` processes at once (``python -m`` each of ``argvs``); LaunchFailed with their
    errors if any fails or hangs."""
    procs = []
    for args in argvs:
        cmd, env = launch.command("none", 1, args, XLA_ENV)
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    errs, status, hung = [], 0, False
    for p in procs:
        try:
            _, err = p.communicate(timeout=launch.DEFAULT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            hung = True
        if p.returncode:
            errs.append(err[-2000:])
            status = status or p.returncode
    if errs:
        raise launch.LaunchFailed(what, status, "\n".join(errs), hung)


def run(kind: str, np_: int, model: str, steps: int, warmup: int, batch: int) -> float:
    """Samples/s of all ranks together. ("plain", 2): two plain processes at once, with no
    communication: what sharing the machine costs by itself, the ceiling of any 2-rank job.)"""
    outs = [tempfile.NamedTemporaryFile(suffix=".json", delete=False).name for _ in range(np_)]
    argvs = [
        launch.worker_args(
            "horovod.benchmarks.jax_training", kind, model, steps, warmup, batch, out
        )
        for out in outs
    ]
    try:
        if kind == "jaxdist":
            port = str(launch.free_port())
            extra = [[*argvs[0], "--extra", str(np_), str(r), port] for r in range(np_)]
            _spawn(np_, extra, "jax.distributed processes")
            outs = outs[:1]  # (process 0 writes the figure)
        elif kind == "plain" and np_ > 1:
            _spawn(np_, argvs, "plain processes")
        else:
            launch.run("horovodrun" if kind == "horovod" else "none", np_, argvs[0], XLA_ENV)
            outs = outs[:1]
        total = 0.0
        for out in outs:
            with open(out) as f:
                total += float(json.load(f)["samples_per_s"])
        return total
    finally:
        for args in argvs:  # every output file made, whoever wrote it
            path = args[args.index("--out") + 1]
            if os.path.exists(path):
                os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,wide")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--repeats", type=int, default=2, help="passes (each figure: the best)")
    ap.add_argument("--worker", choices=["plain", "horovod", "jaxdist"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--extra", nargs="*", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.models, a.steps, a.warmup, a.batch_size, a.out, a.extra)
        return 0
    print(
        f"host: {socket.gethostname()}, {os.cpu_count()} CPUs; batch {a.batch_size} per rank, "
        f"{a.steps} timed steps, best of {a.repeats} passes; samples/s of all ranks together\n"
    )
    print(
        "| model | plain 1 proc | 2 plain procs at once (no comm.) | horovod 1 | horovod 2 "
        "| jax.distributed 2 | ceiling eff. | horovod eff. | jax.distributed eff. "
        "| horovod / jax.distributed at 2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    configs = [("plain", 1), ("plain", 2), ("horovod", 1), ("horovod", 2), ("jaxdist", 2)]
    failures: list[str] = []
    ours_failed = False
    for model in a.models.split(","):
        best: dict[tuple[str, int], float | None] = {c: None for c in configs}
        for _ in range(a.repeats):
            for kind, np_ in configs:  # interleaved: a slow phase hits every configuration
                try:
                    value = run(kind, np_, model, a.steps, a.warmup, a.batch_size)
                    best[(kind, np_)] = max(value, best[(kind, np_)] or 0.0)
                except launch.LaunchFailed as e:
                    failures.append(f"{model}, {kind} at {np_}: {e.summary()}")
                    ours_failed |= kind == "horovod"
                    print(e, file=sys.stderr, flush=True)

        def cell(num: tuple[str, int], den: tuple[str, int] | None = None, k: int = 1,
                 fmt: str = "{:.0f}") -> str:  # fmt: skip
            top, bottom = best[num], (best[den] if den else 1.0)
            return "failed" if top is None or bottom is None else fmt.format(top / (k * bottom))

        plain, plain2, h1, h2, jd = configs
        print(
            f"| {model} | {cell(plain)} | {cell(plain2)} | {cell(h1)} | {cell(h2)} | {cell(jd)} "
            f"| {cell(plain2, plain, 2, '{:.0%}')} | {cell(h2, plain, 2, '{:.0%}')} "
            f"| {cell(jd, plain, 2, '{:.0%}')} | {cell(h2, jd, 1, '{:.2f}x')} |",
            flush=True,
        )
    if failures:
        print("\nRuns that failed (the others went on):\n")
        print("\n".join(f"- {line}" for line in failures))
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
