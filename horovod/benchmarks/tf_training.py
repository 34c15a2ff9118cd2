"""TensorFlow training benchmark: horovod.tensorflow (DistributedGradientTape) vs
tf.distribute.MultiWorkerMirroredStrategy, same model and data, 1 and 2 ranks on this host.

    python -m horovod.benchmarks.tf_training
    python -m horovod.benchmarks.tf_training --models convnet --steps 40

Every rank is one process with one intra-op and one inter-op thread, training on a fixed
synthetic batch with a tf.function step. Printed per model: samples/s (all ranks together) of a
plain single process, of horovod at 1 and 2 ranks and of MultiWorkerMirroredStrategy at 2
workers (gRPC ring collectives on localhost), the scaling efficiency against the plain process,
and the horovod/MWMS ratio (> 1 means horovod trains faster).

Must not touch: the runtime's internals (it uses ``horovod.tensorflow`` like a user).
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

Config = tuple[str, int]  # (kind, ranks)


def _model(name: str):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    k = tf.keras
    if name == "convnet":
        return k.Sequential(
            [
                k.Input((32, 32, 3)),
                k.layers.Conv2D(32, 3, padding="same", activation="relu"),
                k.layers.MaxPooling2D(),
                k.layers.Conv2D(64, 3, padding="same", activation="relu"),
                k.layers.MaxPooling2D(),
                k.layers.Flatten(),
                k.layers.Dense(256, activation="relu"),
                k.layers.Dense(10),
            ]
        )
    if name == "mlp50":  # many small tensors
        layers = [k.Input((3072,)), k.layers.Dense(128, activation="relu")]
        layers += [k.layers.Dense(128, activation="relu") for _ in range(24)]
        return k.Sequential(layers + [k.layers.Dense(10)])
    raise ValueError(f"unknown model {name!r}")


def worker(kind: str, model_name: str, steps: int, warmup: int, batch: int, out: str) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    # the strategy must exist before any TensorFlow op runs
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if kind == "mwms" else None
    shape = (batch, 32, 32, 3) if model_name == "convnet" else (batch, 3072)
    x = tf.random.stateless_normal(shape, seed=(0, 1))
    y = tf.random.stateless_uniform((batch,), seed=(0, 2), maxval=10, dtype=tf.int64)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rank, size = 0, 1
    if strategy is not None:
        size = strategy.num_replicas_in_sync
        rank = strategy.cluster_resolver.task_id
        with strategy.scope():
            model = _model(model_name)
            opt = tf.keras.optimizers.SGD(0.01 * size, momentum=0.9)

        def replica_step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / size
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        @tf.function
        def step() -> None:
            strategy.run(replica_step)

    else:
        model = _model(model_name)
        if kind == "horovod":
            import horovod.tensorflow as hvd

            hvd.init()
            rank, size = hvd.rank(), hvd.size()
        opt = tf.keras.optimizers.SGD(0.01 * size, momentum=0.9)

        @tf.function
        def step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if kind == "horovod":
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = time.perf_counter() - t0
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"samples_per_s": size * batch * steps / seconds}, f)


def _run_mwms(np_: int, args: list[str]) -> None:
    ports = [launch.free_port() for _ in range(np_)]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(np_):
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
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
        raise launch.LaunchFailed(
            "MultiWorkerMirroredStrategy workers", status, "\n".join(errs), hung
        )


def run(kind: str, np_: int, model: str, steps: int, warmup: int, batch: int) -> float:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    args = launch.worker_args(
        "horovod.benchmarks.tf_training", kind, model, steps, warmup, batch, out
    )
    if kind == "mwms":
        _run_mwms(np_, args)
    else:
        launch.run(
            "horovodrun" if kind == "horovod" else "none", np_, args, {"TF_CPP_MIN_LOG_LEVEL": "2"}
        )
    with open(out) as f:
        value = json.load(f)["samples_per_s"]
    os.unlink(out)
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="convnet,mlp50")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration (best kept)")
    ap.add_argument("--worker", choices=["plain", "horovod", "mwms"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.models, a.steps, a.warmup, a.batch_size, a.out)
        return 0
    print(
        f"host: {socket.gethostname()}, {os.cpu_count()} CPUs; batch {a.batch_size} per rank, "
        f"{a.steps} timed steps, best of {a.repeats}; samples/s of all ranks together\n"
    )
    print(
        "| model | plain 1 proc | horovod 1 | horovod 2 | MWMS 2 | horovod eff. | MWMS eff. "
        "| horovod/MWMS at 2 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failures: list[tuple[str, Config, launch.LaunchFailed]] = []
    for model in a.models.split(","):
        r: dict[tuple[str, int], float | None] = {}
        for kind, np_ in (("plain", 1), ("horovod", 1), ("horovod", 2), ("mwms", 2)):
            values = []
            for _ in range(a.repeats):
                try:
                    values.append(run(kind, np_, model, a.steps, a.warmup, a.batch_size))
                except launch.LaunchFailed as e:  # recorded; the other runs go on
                    failures.append((model, (kind, np_), e))
                    print(e, file=sys.stderr, flush=True)
            r[(kind, np_)] = max(values) if values else None

        def cell(num: Config, den: Config | None = None, fmt: str = "{:.0f}", k: int = 1) -> str:
            top, bottom = r[num], (r[den] if den else 1.0)
            return "failed" if top is None or bottom is None else fmt.format(top / (k * bottom))

        plain, h1, h2, mwms = ("plain", 1), ("horovod", 1), ("horovod", 2), ("mwms", 2)
        print(
            f"| {model} | {cell(plain)} | {cell(h1)} | {cell(h2)} | {cell(mwms)} | "
            f"{cell(h2, plain, '{:.0%}', 2)} | {cell(mwms, plain, '{:.0%}', 2)} | "
            f"{cell(h2, mwms, '{:.2f}x')} |",
            flush=True,
        )
    if failures:
        print("\nRuns that failed (the others went on):\n")
        for model, (kind, np_), failure in failures:
            print(f"- {model}, {kind} at {np_} rank(s): {failure.summary()}")
    return 1 if any(kind == "horovod" for _, (kind, _), _ in failures) else 0


if __name__ == "__main__":
    sys.exit(main())
