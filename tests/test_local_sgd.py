"""Local SGD and DiLoCo (issue 35): parameters averaged every ``sync_every`` steps (DiLoCo: an
outer Nesterov step on the averaged change), against a one-process simulation of the same
rule, in NumPy and PyTorch; bad arguments; PyTorch training at 3 processes under horovodrun."""

from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest
from conftest import run_script

import horovod.numpy as hvd
from horovod.testing import run_ranks

LR = 0.1


def target(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(6)


def simulate(size, steps, sync_every, outer_lr=None, mu=0.0, nesterov=True):
    """Every rank's parameters after each step, in one process: local SGD steps on
    0.5 |w - target(rank)|^2 from w = 1, averaged (or DiLoCo's outer step) every sync_every."""
    ws = [np.ones(6) for _ in range(size)]
    g, v = np.ones(6), np.zeros(6)
    history = []
    for step in range(1, steps + 1):
        ws = [w - LR * (w - target(r)) for r, w in enumerate(ws)]
        if step % sync_every == 0:
            avg = sum(ws) / size
            if outer_lr is None:
                ws = [avg.copy() for _ in ws]
            else:
                delta = g - avg
                v = mu * v + delta
                g = g - outer_lr * (delta + mu * v if nesterov else v)
                ws = [g.copy() for _ in ws]
        history.append([w.copy() for w in ws])
    return history


@pytest.mark.parametrize("kind", ["local_sgd", "diloco", "diloco_as_local_sgd"])
def test_numpy_matches_the_simulation(size, kind):
    steps, every = 7, 3
    outer = {"local_sgd": None, "diloco": (0.7, 0.9), "diloco_as_local_sgd": (1.0, 0.0)}[kind]

    def body(rank):
        w = np.ones(6)
        if outer is None:
            sync = hvd.LocalSGD([w], sync_every=every)
        else:
            sync = hvd.DiLoCo([w], sync_every=every, outer_lr=outer[0], outer_momentum=outer[1])
        seen = []
        for _ in range(steps):
            w -= LR * (w - target(rank))
            synced = sync.step()
            seen.append((w.copy(), synced))
        return seen

    want = simulate(size, steps, every, *(outer or (None,)))
    out = run_ranks(body, size)
    for rank, seen in enumerate(out):
        for step, (w, synced) in enumerate(seen, start=1):
            assert synced == (step % every == 0)
            np.testing.assert_allclose(w, want[step - 1][rank], rtol=1e-12, atol=1e-12)
            if synced:  # identical bits on every rank after a sync
                assert w.tobytes() == out[0][step - 1][0].tobytes()
    if kind == "diloco_as_local_sgd":
        plain = simulate(size, steps, every)
        np.testing.assert_allclose(want[-1][0], plain[-1][0], rtol=1e-12)


def test_bad_arguments_are_named():
    def body(rank):
        w = np.ones(3)
        with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
            hvd.LocalSGD([w], sync_every=0)
        with pytest.raises(ValueError, match="outer_lr must be > 0"):
            hvd.DiLoCo([w], sync_every=2, outer_lr=0.0)
        with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\)"):
            hvd.DiLoCo([w], sync_every=2, outer_momentum=1.0)
        with pytest.raises(TypeError, match="parameter 0 must be a writable floating-point"):
            hvd.LocalSGD([np.arange(3)], sync_every=2)
        return True

    assert run_ranks(body, 1) == [True]


torch = pytest.importorskip("torch") if importlib.util.find_spec("torch") else None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


@needs_torch
@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_torch_wrappers_match_the_simulation(kind):
    import horovod.torch as ht

    steps, every, size = 7, 3, 3
    outer = None if kind == "local_sgd" else (0.7, 0.9)

    def body(rank):
        w = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))
        opt = torch.optim.SGD([w], lr=LR)
        if outer is None:
            opt = ht.LocalSGD(opt, sync_every=every)
        else:
            opt = ht.DiLoCo(opt, sync_every=every, outer_lr=outer[0], outer_momentum=outer[1])
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        seen = []
        c = torch.tensor(target(rank))
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * ((w - c) ** 2).sum()).backward()
            opt.step()
            seen.append(w.detach().numpy().copy())
        opt.sync()  # step 7 is not a sync step: sync() averages now
        seen.append(w.detach().numpy().copy())
        return seen

    want = simulate(size, steps, every, *(outer or (None,)))
    out = run_ranks(body, size)
    for rank, seen in enumerate(out):
        for step in range(steps):
            np.testing.assert_allclose(seen[step], want[step][rank], rtol=1e-12, atol=1e-12)
    finals = [seen[-1] for seen in out]
    assert all(f.tobytes() == finals[0].tobytes() for f in finals)  # sync() made them equal
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        ht.LocalSGD(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), sync_every=0)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        ht.LocalSGD(object(), sync_every=2)


TRAIN = textwrap.dedent(
    """
    import sys, torch
    import horovod.torch as hvd
    from sklearn.datasets import load_digits

    hvd.init()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    mine = torch.arange(hvd.rank(), len(y), hvd.size())
    for kind in ("LocalSGD", "DiLoCo"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        if kind == "LocalSGD":
            opt = hvd.LocalSGD(inner, sync_every=4)
        else:
            opt = hvd.DiLoCo(inner, sync_every=4, outer_lr=0.7, outer_momentum=0.5)
        for epoch in range(12):
            for i in range(0, len(mine), 64):
                idx = mine[i:i + 64]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        opt.sync()
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        sums = hvd.allgather_object(float(flat.double().sum()))
        assert len(set(sums)) == 1, sums
        print(f"{kind} rank {hvd.rank()}: accuracy {acc:.3f}", flush=True)
        assert acc > 0.9, (kind, acc)
    """
)


@needs_torch
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_torch_local_sgd_and_diloco_train_at_3_processes():
    r = run_script(TRAIN, np_=3, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("accuracy") == 6


needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs TensorFlow"
)


@needs_tf
@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_tensorflow_variables_match_the_simulation(kind):
    import tensorflow as tf

    import horovod.tensorflow as htf

    steps, every, size = 7, 3, 2
    outer = None if kind == "local_sgd" else (0.7, 0.9)

    def body(rank):
        w = tf.Variable(np.ones(6))
        if outer is None:
            sync = htf.LocalSGD([w], sync_every=every)
        else:
            sync = htf.DiLoCo([w], sync_every=every, outer_lr=outer[0], outer_momentum=outer[1])
        seen = []
        for _ in range(steps):
            w.assign_sub(LR * (w - target(rank)))
            sync.step()
            seen.append(w.numpy().copy())
        return seen

    want = simulate(size, steps, every, *(outer or (None,)))
    for rank, seen in enumerate(run_ranks(body, size, timeout=120)):
        for step in range(steps):
            np.testing.assert_allclose(seen[step], want[step][rank], rtol=1e-12, atol=1e-12)


@needs_tf
@pytest.mark.parametrize("module", ["horovod.tensorflow.keras", "horovod.keras"])
def test_keras_callbacks_average_every_few_batches_and_at_the_end(module):
    import importlib

    import tensorflow as tf

    hk = importlib.import_module(module)
    if module == "horovod.keras":
        import keras as tf_keras_module
    else:
        tf_keras_module = tf.keras

    def body(rank):
        tf_keras_module.utils.set_random_seed(0)
        rng = np.random.default_rng(rank)
        x = rng.standard_normal((40, 4)).astype(np.float32)
        y = (x @ np.arange(1.0, 5.0, dtype=np.float32))[:, None]
        out = {}
        for name, cb in (
            ("local", hk.callbacks.LocalSGDCallback(sync_every=3)),
            ("diloco", hk.callbacks.DiLoCoCallback(sync_every=3, outer_momentum=0.5)),
        ):
            k = tf_keras_module
            model = k.Sequential([k.Input((4,)), k.layers.Dense(1)])
            model.compile(k.optimizers.SGD(0.05), loss="mse")
            model.fit(
                x,
                y,
                epochs=2,
                batch_size=8,
                verbose=0,
                callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0), cb],
            )
            out[name] = (cb.core.syncs, [w.copy() for w in model.get_weights()])
        return out

    results = run_ranks(body, 2, timeout=180)
    for name in ("local", "diloco"):
        syncs, weights = results[0][name]
        assert syncs == 4  # 10 batches: after 3, 6, 9, and at the end
        for other in results[1:]:
            assert all(
                a.tobytes() == b.tobytes() for a, b in zip(weights, other[name][1], strict=True)
            )
    with pytest.raises(ValueError, match="LocalSGDCallback: sync_every must be an int >= 1"):
        hk.callbacks.LocalSGDCallback(sync_every=0)


def test_adaptive_period_shrinks_with_the_ranks_average_loss():
    """AdaComm: H = ceil(sqrt(L / L0) * H0), from the loss averaged over the ranks in the
    sync's own allreduce (rank 0 reports 3x what rank 1 does: both pick the same H)."""
    losses = {0: [6.0] * 8 + [1.5] * 8 + [0.06] * 4 + [0.06] * 2, 1: [2.0] * 8 + [0.5] * 8}
    losses[1] += [0.02] * 6

    def body(rank):
        w = np.ones(3)
        sync = hvd.LocalSGD([w], sync_every=8, adaptive=True)
        synced_at = []
        for step, loss in enumerate(losses[rank], start=1):
            w -= 0.1 * (w - rank)
            if sync.step(loss=loss):
                synced_at.append(step)
        return synced_at, sync.core.periods

    for synced_at, periods in run_ranks(body, 2):
        # L0 = 4 at step 8 (H stays 8); L = 1 at step 16: H = 4; L = 0.04 at 20: H = 1
        assert periods == [8, 8, 4, 1, 1, 1]
        assert synced_at == [8, 16, 20, 21, 22]


@needs_torch
def test_torch_adaptive_takes_the_closures_loss():
    import horovod.torch as ht

    def body(rank):
        w = torch.nn.Parameter(torch.ones(2))
        opt = ht.LocalSGD(torch.optim.SGD([w], lr=1e-4), sync_every=4, adaptive=True)
        loss_scale = [100.0] * 4 + [1.0] * 4

        for s in loss_scale:

            def closure(s=s):
                opt.zero_grad()
                loss = s * ((w - rank) ** 2).sum()
                loss.backward()
                return loss

            opt.step(closure)
        return opt._hvd_periodic.periods

    for periods in run_ranks(body, 2):
        assert periods[0] == 4 and periods[-1] < 4  # the loss fell 100x: syncs come sooner
