"""Data-parallel training with horovod.mxnet and gluon: a small MLP on scikit-learn's digits.

    horovodrun -np 2 .venv-mxnet/bin/python examples/mxnet_digits.py

(MXNet 1.9.1 needs NumPy < 1.24: ``bash .ci/setup`` makes ``.venv-mxnet`` for it.) Each rank
trains on its own shard; ``hvd.DistributedTrainer`` sums the gradients over the ranks (its
scale averages them) before the SGD update, so the replicas stay identical. Parameters start
from rank 0's (``hvd.broadcast_parameters``, applied when gluon's deferred initialization runs).
"""

from __future__ import annotations

import argparse
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import horovod.mxnet as hvd


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1, help="single-process learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    hvd.init()
    (x_train, y_train), (x_test, y_test) = load_data()
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    steps = len(x_train) // hvd.size() // args.batch_size  # the same on every rank

    mx.random.seed(hvd.rank())  # different initial weights on purpose: the broadcast fixes it
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(
        params, "sgd", {"learning_rate": args.lr * hvd.size(), "momentum": 0.9}
    )
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), {steps} steps/epoch", flush=True)
    rng = np.random.default_rng(hvd.rank())
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        total = 0.0
        for s in range(steps):
            idx = order[s * args.batch_size : (s + 1) * args.batch_size]
            x, y = mx.nd.array(x_shard[idx]), mx.nd.array(y_shard[idx])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(args.batch_size)
            total += float(loss.mean().asscalar())
        mean = hvd.allreduce(mx.nd.array([total / steps]), name="loss").asscalar()
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}: loss {mean:.4f}", flush=True)

    digest = float(sum(p.data().asnumpy().astype(np.float64).sum() for p in params.values()))
    digests = hvd.allgather_object(digest)
    pred = net(mx.nd.array(x_test)).asnumpy().argmax(axis=1)
    test_acc = float((pred == y_test).mean())
    if hvd.rank() == 0:
        print(
            f"test accuracy {test_acc:.3f} after {time.perf_counter() - start:.1f} s; "
            f"replicas identical: {len(set(digests)) == 1}",
            flush=True,
        )
    return 0 if test_acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
