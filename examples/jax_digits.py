"""Data-parallel training with horovod.jax and optax: a small MLP on scikit-learn's digits.

    horovodrun -np 2 python examples/jax_digits.py
    python examples/jax_digits.py            # the same script, one process

Each rank trains on its own shard of the data with a jitted step; inside it,
``hvd.DistributedOptimizer`` averages the gradients over all ranks (an ordered host callback
inside the compiled step) before Adam's update, so every rank applies the same update and the
replicas stay identical. Parameters start from rank 0's (``hvd.broadcast_parameters``).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import horovod.jax as hvd


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def init_params(key, sizes=(64, 128, 10)):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        key, sub = jax.random.split(key)
        params[f"fc{i + 1}"] = {
            "w": jax.random.normal(sub, (a, b)) * np.sqrt(2.0 / a),
            "b": jnp.zeros(b),
        }
    return params


def logits_of(params, x):
    h = jax.nn.relu(x @ params["fc1"]["w"] + params["fc1"]["b"])
    return h @ params["fc2"]["w"] + params["fc2"]["b"]


def loss_fn(params, x, y):
    logits = logits_of(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (logits.argmax(axis=1) == y).mean()


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

    # Different random init per rank on purpose: the broadcast makes them identical.
    params = hvd.broadcast_parameters(init_params(jax.random.PRNGKey(hvd.rank())), root_rank=0)
    opt = hvd.DistributedOptimizer(optax.adam(args.lr * hvd.size()))
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, acc

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), {steps} steps/epoch", flush=True)
    rng = np.random.default_rng(hvd.rank())
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        losses, accs = [], []
        for s in range(steps):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            params, state, loss, acc = step(params, state, x_shard[idx], y_shard[idx])
            losses.append(loss)
            accs.append(acc)
        metrics = hvd.allreduce(jnp.array([np.mean(losses), np.mean(accs)]), name="metrics")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}: loss {metrics[0]:.4f}  train accuracy {metrics[1]:.3f}")

    leaves = jax.tree_util.tree_leaves(params)
    digest = float(sum(np.asarray(leaf, np.float64).sum() for leaf in leaves))
    digests = hvd.allgather_object(digest)
    test_acc = float((logits_of(params, x_test).argmax(axis=1) == y_test).mean())
    if hvd.rank() == 0:
        print(
            f"test accuracy {test_acc:.3f} after {time.perf_counter() - start:.1f} s; "
            f"replicas identical: {len(set(digests)) == 1}",
            flush=True,
        )
    return 0 if test_acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
