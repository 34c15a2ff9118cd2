"""Data-parallel training of a Flax NNX model with horovod.jax: an MLP on scikit-learn's digits.

    horovodrun -np 2 python examples/flax_nnx_digits.py

The model's state starts from rank 0's (``hvd.broadcast_parameters`` on ``nnx.split``'s state);
``nnx.Optimizer`` wraps ``hvd.DistributedOptimizer(optax.adam(...))``, so the gradients are
averaged over the ranks inside the ``nnx.jit``-compiled step and the replicas stay identical.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import horovod.jax as hvd


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # hvd.DistributedOptimizer averages the grads in here
    return loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.003, help="single-process learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    hvd.init()
    (x_train, y_train), (x_test, y_test) = load_data()
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    steps = len(x_train) // hvd.size() // args.batch_size  # the same on every rank

    model = MLP(nnx.Rngs(hvd.rank()))  # different initial weights on purpose
    _, state = nnx.split(model)
    nnx.update(model, hvd.broadcast_parameters(state, root_rank=0))
    tx = hvd.DistributedOptimizer(optax.adam(args.lr * hvd.size()))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), {steps} steps/epoch", flush=True)
    rng = np.random.default_rng(hvd.rank())
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        losses = []
        for s in range(steps):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            losses.append(train_step(model, optimizer, x_shard[idx], y_shard[idx]))
        mean = hvd.allreduce(jnp.array([np.mean(losses)]), name="loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}: loss {float(mean[0]):.4f}", flush=True)

    _, state = nnx.split(model)
    digest = float(
        sum(np.asarray(leaf, np.float64).sum() for leaf in jax.tree_util.tree_leaves(state))
    )
    digests = hvd.allgather_object(digest)
    test_acc = float((np.asarray(model(x_test)).argmax(axis=1) == y_test).mean())
    if hvd.rank() == 0:
        print(
            f"test accuracy {test_acc:.3f} after {time.perf_counter() - start:.1f} s; "
            f"replicas identical: {len(set(digests)) == 1}",
            flush=True,
        )
    return 0 if test_acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
