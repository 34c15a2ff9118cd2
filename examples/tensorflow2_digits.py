"""Data-parallel TensorFlow 2 training with horovod.tensorflow: a small CNN on scikit-learn's
digits, written as for upstream Horovod (GradientTape wrapped by hvd.DistributedGradientTape).

    horovodrun -np 2 python examples/tensorflow2_digits.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd


def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype("float32")[..., None]
    y = d.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01, help="single-process learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    hvd.init()
    tf.random.set_seed(1234 + hvd.rank())  # different initial weights: the broadcast fixes it
    (x_train, y_train), (x_test, y_test) = digits()
    # each rank trains on its shard
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    data = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2000, seed=hvd.rank())
    data = data.batch(args.batch_size)

    model = tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Scale the learning rate by the number of ranks: the global batch is size x larger.
    opt = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)  # (decayed per epoch)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, first: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first:
            # after the first step the optimizer's variables exist: start every rank from
            # rank 0's model and optimizer state
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    first = True
    base_lr = args.lr * hvd.size()
    for epoch in range(args.epochs):
        # Linear decay to a tenth over the run: the last epochs settle instead of jumping
        # between minima (at a constant rate the final accuracy moved by 8 points between runs).
        opt.learning_rate.assign(base_lr * (1.0 - 0.9 * epoch / args.epochs))
        losses = []
        for x, y in data:
            losses.append(float(train_step(x, y, first)))
            first = False
        loss = hvd.allreduce(tf.constant(np.mean(losses)), name="loss")
        logits = model(x_test, training=False)
        acc = float(np.mean(np.argmax(logits, 1) == y_test))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: train loss {float(loss):.4f}  test accuracy {acc:.3f}")
    digest = hvd.allgather_object(float(sum(float(tf.reduce_sum(v)) for v in model.variables)))
    same = len(set(digest)) == 1
    if hvd.rank() == 0:
        print(f"replicas identical: {same}")
    hvd.shutdown()
    if not same or acc < args.min_accuracy:
        print(f"failed: replicas identical {same}, accuracy {acc:.3f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
