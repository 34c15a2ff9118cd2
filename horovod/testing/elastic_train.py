"""A small elastic training job with fault injection, for the elastic tests and the campaign
(``python -m horovod.benchmarks.elastic``). Run it under ``horovodrun --min-np ...``.

It trains a linear model on fixed synthetic data with ``horovod.numpy``: every batch is split
over the current ranks, gradients are averaged, and the state (weights, epoch, batch) is
committed every ``--commit-every`` batches. Faults come from ``HVD_TEST_FAULTS``, a JSON
list of ``{"id", "epoch", "batch", "rank", "how"}`` (``how``: ``raise``, ``exit``
(``os._exit(1)``), ``sigkill``, ``sigstop``), each fired once: the first worker to reach it
claims a marker file in ``HVD_TEST_FAULT_DIR``, writes the time there and fails.

Rank 0 of each round appends one line per finished batch to ``--log``:
``<time> <epoch> <batch> <size> <round>``; every rank writes its final weights to
``--out/rank.<r>.npy`` and its epoch and batch counters to ``--out/rank.<r>.json``.

Must not touch: anything outside the files it is told to write.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

import horovod.numpy as hvd


def fault_here(epoch: int, batch: int) -> None:
    faults = json.loads(os.environ.get("HVD_TEST_FAULTS", "[]"))
    where = os.environ.get("HVD_TEST_FAULT_DIR", "")
    for f in faults:
        if (f["epoch"], f["batch"], f["rank"]) != (epoch, batch, hvd.rank()):
            continue
        marker = os.path.join(where, f"fault.{f['id']}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue  # fired already (by this slot's predecessor, or at an earlier pass)
        os.write(fd, f"{time.time()!r}".encode())
        os.close(fd)
        how = f["how"]
        print(f"fault {f['id']}: {how} at epoch {epoch} batch {batch}", flush=True)
        if how == "raise":
            raise RuntimeError(f"injected fault {f['id']}")
        if how == "exit":
            os._exit(1)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)


FEATURES = 16
LEARNING_RATE = 0.05


def data(batches: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed synthetic data set: ``batches * batch_size`` rows."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batches * batch_size, FEATURES))
    return x, x @ rng.standard_normal(FEATURES)


def reference_weights(epochs: int, batches: int, batch_size: int = 24) -> np.ndarray:
    """What the job computes without faults, in one process (whole batches): a faulty run that
    skipped or repeated a batch differs from this by far more than rounding."""
    x, y = data(batches, batch_size)
    w = np.zeros(FEATURES)
    for _ in range(epochs):
        for b in range(batches):
            xb, yb = (
                x[b * batch_size : (b + 1) * batch_size],
                y[b * batch_size : (b + 1) * batch_size],
            )
            w = w - LEARNING_RATE * (xb.T @ (xb @ w - yb)) / len(yb)
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=8, help="batches per epoch")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per batch")
    p.add_argument("--log", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    train_job(**vars(args))
    hvd.shutdown()


def train_job(
    epochs: int = 3,
    batches: int = 8,
    batch_size: int = 24,
    commit_every: int = 1,
    step_seconds: float = 0.0,
    log: str = "",
    out: str = "",
) -> dict:
    """The job's body (``main`` parses its arguments; ``horovod.ray`` and ``horovod.spark``
    tests call it as the function of an elastic job): returns this rank's final state."""
    hvd.init()
    x, y = data(batches, batch_size)
    state = hvd.elastic.ObjectState(w=np.zeros(FEATURES), epoch=0, batch=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        while state.epoch < epochs:
            while state.batch < batches:
                fault_here(state.epoch, state.batch)
                lo = state.batch * batch_size
                xb, yb = x[lo : lo + batch_size], y[lo : lo + batch_size]
                mine = slice(hvd.rank(), None, hvd.size())
                err = xb[mine] @ state.w - yb[mine]
                grad = hvd.allreduce(xb[mine].T @ err, op=hvd.Sum, name="grad")
                count = hvd.allreduce(np.array([len(err)], np.float64), op=hvd.Sum, name="n")
                state.w = state.w - LEARNING_RATE * grad / count[0]
                if step_seconds:
                    time.sleep(step_seconds)
                if hvd.rank() == 0 and log:
                    g = _round()
                    with open(log, "a") as f:
                        f.write(f"{time.time()!r} {state.epoch} {state.batch} {hvd.size()} {g}\n")
                state.batch += 1
                if state.batch % commit_every == 0:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            state.commit()

    train(state)
    r = hvd.rank()
    if out:
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, f"rank.{r}.npy"), state.w)
        with open(os.path.join(out, f"rank.{r}.json"), "w") as f:
            json.dump({"epoch": state.epoch, "batch": state.batch, "size": hvd.size()}, f)
    print(f"done: rank {r} of {hvd.size()}, resets {resets}", flush=True)
    return {
        "rank": r,
        "size": hvd.size(),
        "w": state.w,
        "epoch": state.epoch,
        "batch": state.batch,
        "resets": resets,
    }


def _round() -> int:
    from horovod.core import membership

    return membership.last_round() or 0


if __name__ == "__main__":
    main()
