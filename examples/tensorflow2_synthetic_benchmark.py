"""Synthetic TensorFlow 2 throughput benchmark with upstream Horovod's flags.

    horovodrun -np 2 python examples/tensorflow2_synthetic_benchmark.py --model convnet

Same flags and output as upstream's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``.
Models: ``convnet`` (a small conv net on 32x32 images), ``mlp50`` (52 small tensors), or any
``tf.keras.applications`` name such as ``ResNet50`` (224x224 images: slow on CPU).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.benchmarks.tf_training import _model


def main() -> None:
    ap = argparse.ArgumentParser(
        description="TensorFlow Synthetic Benchmark",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression"
    )
    ap.add_argument("--model", type=str, default="convnet", help="model to benchmark")
    ap.add_argument("--batch-size", type=int, default=32, help="input batch size")
    ap.add_argument("--num-warmup-batches", type=int, default=10)
    ap.add_argument("--num-batches-per-iter", type=int, default=10)
    ap.add_argument("--num-iters", type=int, default=10)
    ap.add_argument("--no-cuda", action="store_true", default=False)
    args = ap.parse_args()

    hvd.init()
    gpus = [] if args.no_cuda else tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    if args.model in ("convnet", "mlp50"):
        model = _model(args.model)
        shape = (args.batch_size, 32, 32, 3) if args.model == "convnet" else (args.batch_size, 3072)
    else:
        model = getattr(tf.keras.applications, args.model)(weights=None)
        shape = (args.batch_size, 224, 224, 3)
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    data = tf.random.uniform(shape)
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=10, dtype=tf.int64)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def benchmark_step(first_batch: bool) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if gpus else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    benchmark_step(first_batch=True)
    log("Running warmup...")
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(
            lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter
        )
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(
        f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}"
    )


if __name__ == "__main__":
    main()
