"""Data-parallel training with horovod.numpy: a small MLP on scikit-learn's digits.

    horovodrun -np 2 python examples/numpy_digits.py
    python examples/numpy_digits.py            # the same script, one process

Each rank trains on its own shard of the data; after every step the gradients are averaged
over all ranks with one grouped allreduce, so every rank applies the same update and the model
replicas stay identical. The learning rate is scaled by the number of ranks (the global batch
grows with it), with a linear warmup over the first epoch, as Horovod recommends.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import horovod.numpy as hvd


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def init_params(rng: np.random.Generator, sizes=(64, 128, 10)) -> dict[str, np.ndarray]:
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        params[f"fc{i + 1}.weight"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(
            np.float32
        )
        params[f"fc{i + 1}.bias"] = np.zeros(b, np.float32)
    return params


def forward(params, x):
    h = np.maximum(x @ params["fc1.weight"] + params["fc1.bias"], 0.0)
    logits = h @ params["fc2.weight"] + params["fc2.bias"]
    return h, logits


def loss_and_grads(params, x, y):
    h, logits = forward(params, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    acc = float((p.argmax(axis=1) == y).mean())
    d = p
    d[np.arange(n), y] -= 1.0
    d /= n
    grads = {"fc2.weight": h.T @ d, "fc2.bias": d.sum(axis=0)}
    dh = (d @ params["fc2.weight"].T) * (h > 0)
    grads["fc1.weight"] = x.T @ dh
    grads["fc1.bias"] = dh.sum(axis=0)
    return loss, acc, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1, help="single-process learning rate")
    ap.add_argument(
        "--min-accuracy",
        type=float,
        default=0.9,
        help="exit non-zero if the final test accuracy is lower",
    )
    args = ap.parse_args()

    hvd.init()
    (x_train, y_train), (x_test, y_test) = load_data()
    # Shard the training set: rank r takes every size-th sample starting at r.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    steps = len(x_train) // hvd.size() // args.batch_size  # the same on every rank

    # Different random init per rank on purpose: the broadcast makes them identical.
    params = init_params(np.random.default_rng(1234 + hvd.rank()))
    names = sorted(params)
    for name in names:
        hvd.broadcast_(params[name], root_rank=0, name=f"init.{name}")

    lr = args.lr * hvd.size()
    rng = np.random.default_rng(hvd.rank())
    if hvd.rank() == 0:
        print(
            f"training on {hvd.size()} rank(s), {steps} steps/epoch, "
            f"global batch {args.batch_size * hvd.size()}, lr {lr:g}",
            flush=True,
        )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_shard))
        losses, accs = [], []
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss, acc, grads = loss_and_grads(params, x_shard[idx], y_shard[idx])
            # One grouped allreduce averages every gradient over all ranks.
            averaged = hvd.grouped_allreduce(
                [grads[n] for n in names], op=hvd.Average, name="grads"
            )
            warm = min(1.0, (epoch * steps + step + 1) / steps)  # warmup over epoch 1
            for n, g in zip(names, averaged, strict=False):
                params[n] -= lr * warm * g
            losses.append(loss)
            accs.append(acc)
        # Average the epoch metrics over ranks, so rank 0 reports the global figures.
        metrics = hvd.allreduce(
            np.array([np.mean(losses), np.mean(accs)]), op=hvd.Average, name="metrics"
        )
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1:2d}: loss {metrics[0]:.4f}  train accuracy {metrics[1]:.3f}",
                flush=True,
            )

    # Every replica must hold exactly the same weights.
    digest = (
        np.frombuffer(np.concatenate([params[n].ravel() for n in names]).tobytes(), np.uint8)
        .astype(np.int64)
        .sum()
    )
    digests = hvd.allgather(np.array([digest], dtype=np.int64))
    _, logits = forward(params, x_test)
    test_acc = float((logits.argmax(axis=1) == y_test).mean())
    if hvd.rank() == 0:
        print(
            f"test accuracy {test_acc:.3f} after {time.perf_counter() - start:.1f} s; "
            f"replicas identical: {len(set(digests.tolist())) == 1}",
            flush=True,
        )
    ok = len(set(digests.tolist())) == 1 and test_acc >= args.min_accuracy
    hvd.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
