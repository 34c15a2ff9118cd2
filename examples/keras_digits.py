"""Keras ``model.fit`` with horovod.tensorflow.keras, exactly as an upstream Horovod script:
DistributedOptimizer, BroadcastGlobalVariablesCallback, MetricAverageCallback and a learning
rate warmup, on scikit-learn's digits.

    horovodrun -np 2 python examples/keras_digits.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01, help="single-process learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    hvd.init()
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = d.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    x_test, y_test = x[:n_test], y[:n_test]
    x_train, y_train = x[n_test:][hvd.rank() :: hvd.size()], y[n_test:][hvd.rank() :: hvd.size()]

    tf.random.set_seed(hvd.rank())  # different initial weights: the callback broadcasts rank 0's
    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(args.lr * hvd.size(), warmup_epochs=2),
    ]
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    digests = hvd.allgather(np.array([sum(float(w.sum()) for w in model.get_weights())]))
    same = len(set(digests.tolist())) == 1
    if hvd.rank() == 0:
        print(f"test accuracy {acc:.3f}; replicas identical: {same}")
    hvd.shutdown()
    if not same or acc < args.min_accuracy:
        print(f"failed: replicas identical {same}, accuracy {acc:.3f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
