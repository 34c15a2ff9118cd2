"""Elastic Keras training with horovod.tensorflow.keras: a small dense network on
scikit-learn's digits, with ``model.fit`` and upstream's elastic callbacks.

    horovodrun -np 2 --min-np 1 -H localhost:2 python examples/elastic/keras_elastic_digits.py

The model and optimizer live in ``hvd.elastic.KerasState`` with the epoch and batch counters;
``UpdateEpochStateCallback`` and ``UpdateBatchStateCallback`` keep the counters current and
``CommitStateCallback`` commits every few batches. After a reset the data is re-sharded over
the new number of workers and the learning rate rescaled. See docs/elastic.md.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batches-per-commit", type=int, default=5)
    ap.add_argument("--min-accuracy", type=float, default=0.85)
    ap.add_argument("--save", default="", help="write the final weights here (rank's own)")
    args = ap.parse_args()

    from sklearn.datasets import load_digits

    hvd.init()
    tf.keras.utils.set_random_seed(1234)
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    n_test = len(x) // 5
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input((64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)
    )
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_reset() -> None:
        model.optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([on_reset])
    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]

    class Report(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if hvd.rank() == 0:
                print(f"epoch {epoch}: {hvd.size()} workers", flush=True)

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        # This worker's shard at the current size; equal shards, so every worker runs the
        # same number of batches (and so the same collectives).
        n = len(x_train) // hvd.size() * hvd.size()
        mine = slice(hvd.rank(), n, hvd.size())
        model.fit(
            x_train[mine],
            y_train[mine],
            batch_size=args.batch_size,
            epochs=args.epochs,
            initial_epoch=state.epoch,
            callbacks=[*callbacks, Report()],
            shuffle=False,
            verbose=0,
        )

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if args.save:
        np.savez(f"{args.save}.rank{hvd.rank()}.npz", *model.get_weights())
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.3f} with {hvd.size()} workers", flush=True)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
