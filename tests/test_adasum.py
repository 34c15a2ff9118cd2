"""Adasum (``op=hvd.Adasum``): the pairwise rule, the tree over any number of ranks (bitwise
equal to the one-process definition on every rank), per-tensor coefficients inside a fused
group, process sets, scale factors, bad input, and upstream's delta optimizer for PyTorch
converging at 3 processes under horovodrun (upstream fails at 3, #3400)."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, run_script

import horovod.numpy as hvd
from horovod.collectives.adasum import combine, levels, reference
from horovod.testing import RankFailed, run_ranks


def adasum2(a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot = a64 @ b64
    return (1 - dot / (2 * (a64 @ a64))) * a64 + (1 - dot / (2 * (b64 @ b64))) * b64


def test_the_pairwise_rule():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    out = np.empty(50)
    combine(a, b, [50], out)
    np.testing.assert_allclose(out, adasum2(a, b), rtol=1e-12)
    combine(a, a, [50], out)  # identical gradients: the gradient itself
    np.testing.assert_allclose(out, a, rtol=1e-12)
    e0, e1 = np.eye(2)
    combine(e0, e1, [2], out[:2])  # orthogonal ones add up
    np.testing.assert_array_equal(out[:2], [1.0, 1.0])
    z = np.zeros(50)
    combine(a, z, [50], out)  # a zero vector keeps its coefficient at 1: a + 0
    np.testing.assert_array_equal(out, a)
    # per segment: each tensor gets its own coefficients
    combine(np.r_[a, a], np.r_[b, a], [50, 50], out2 := np.empty(100))
    np.testing.assert_allclose(out2[:50], adasum2(a, b), rtol=1e-12)
    np.testing.assert_allclose(out2[50:], a, rtol=1e-12)


# The coefficients' sums, by NumPy's own loops: the same bits whatever BLAS (its kernel for the
# CPU, its threads) and whatever SIMD NumPy dispatches to. With BLAS dot products (before stop
# 56), OpenBLAS's "Prescott" and "Sandybridge" kernels gave other bits for the same vectors.
COMBINE_BITS = """
import hashlib, numpy as np
from horovod.collectives.adasum import combine
rng = np.random.default_rng(7)
h = hashlib.sha256()
for counts in ([100], [5000], [70_001], [300_000], [10] * 500, [3000] * 30, [0, 9, 40_000, 0]):
    n = sum(counts)
    for dtype in (np.float64, np.float32):  # (float64 keeps a coefficient's last bits)
        a = rng.standard_normal(n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
        out = np.empty_like(a)
        combine(a, b, counts, out)
        h.update(out.tobytes())
print(h.hexdigest())
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS x86 kernels")
def test_the_coefficients_do_not_depend_on_blas_or_the_cpus_simd():
    avx512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
    settings = [
        {},
        {"OPENBLAS_CORETYPE": "Prescott"},
        {"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_NUM_THREADS": "2"},
        {"NPY_DISABLE_CPU_FEATURES": avx512},
        {"NPY_DISABLE_CPU_FEATURES": avx512 + " AVX2 FMA3 F16C AVX"},
    ]
    digests = set()
    for extra in settings:
        env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
        out = subprocess.run(
            [sys.executable, "-c", COMBINE_BITS],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, (extra, out.stderr)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


@pytest.mark.parametrize("n", range(1, 10))
def test_every_send_has_its_receive_and_the_tree_is_the_pairwise_one(n):
    """Simulate the levels of all ranks in one process: the messages match up and every rank
    ends with the one-process tree's result, bit for bit."""
    rng = np.random.default_rng(n)
    vecs = [rng.standard_normal(7) for _ in range(n)]
    plans = [levels(n, r) for r in range(n)]
    state = [v.copy() for v in vecs]
    depth = len(plans[0])
    assert all(len(p) == depth for p in plans) and 2**depth >= n > 2 ** (depth - 1) - (n == 1)
    for lvl in range(depth):
        active = [r for r in range(n) if plans[r][lvl] is not None]
        sent = {(r, q) for r in active for q in plans[r][lvl][1]}
        received = {(plans[r][lvl][2], r) for r in active}
        assert sent == received
        nxt = []
        for r in range(n):
            if plans[r][lvl] is None:  # an unpaired group sits the level out
                nxt.append(state[r])
                continue
            lower, _, source = plans[r][lvl]
            a, b = (state[r], state[source]) if lower else (state[source], state[r])
            out = np.empty(7)
            combine(a, b, [7], out)
            nxt.append(out)
        state = nxt
    want = reference(vecs)
    for s in state:
        assert s.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_allreduce_adasum_equals_the_tree_on_every_rank(size, dtype):
    n = 70_001 if dtype == np.float64 else 1000  # float64: above the small-message switch

    def data(rank):
        return np.random.default_rng(rank).standard_normal(n).astype(dtype)

    def body(rank):
        return hvd.allreduce(data(rank), op=hvd.Adasum, name="g")

    want = reference([data(r) for r in range(size)])
    for got in run_ranks(body, size):
        assert got.dtype == dtype and got.tobytes() == want.tobytes()


def test_grouped_adasum_has_coefficients_per_tensor_and_scale_factors():
    """A fused group: each tensor combined on its own, as if reduced alone; prescale and
    postscale around the combination."""
    shapes = [(3, 4), (5,), (2, 2, 2)]

    def data(rank):
        rng = np.random.default_rng(10 + rank)
        return [rng.standard_normal(s) for s in shapes]

    def body(rank):
        xs = data(rank)
        grouped = hvd.grouped_allreduce(xs, op=hvd.Adasum, name="grp")
        scaled = hvd.allreduce(xs[0], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
        return grouped, scaled

    out = run_ranks(body, 3)
    for i, s in enumerate(shapes):
        want = reference([data(r)[i] for r in range(3)]).reshape(s)
        for grouped, _ in out:
            np.testing.assert_array_equal(grouped[i], want)
    want0 = reference([2.0 * data(r)[0] for r in range(3)]).reshape(shapes[0]) * 0.25
    for _, scaled in out:
        np.testing.assert_allclose(scaled, want0, rtol=1e-15)


def test_adasum_on_a_process_set():
    def body(rank):
        ps = hvd.add_process_set([0, 2])
        x = np.full(5, rank + 1.0) + np.arange(5)
        if rank in (0, 2):
            return hvd.allreduce(x, op=hvd.Adasum, process_set=ps, name="ps")
        return None

    out = run_ranks(body, 3, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    want = reference([np.full(5, r + 1.0) + np.arange(5) for r in (0, 2)])
    np.testing.assert_array_equal(out[0], want)
    np.testing.assert_array_equal(out[2], want)


def test_bad_input_is_named():
    def body(rank):
        with pytest.raises(TypeError, match="op=Adasum needs floating-point tensors.*int32"):
            hvd.allreduce(np.arange(4, dtype=np.int32), op=hvd.Adasum)
        with pytest.raises(ValueError, match="reducescatter: op=Adasum"):
            hvd.reducescatter(np.ones(4), op=hvd.Adasum)
        return True

    assert run_ranks(body, 2) == [True, True]


def test_ranks_must_agree_on_adasum():
    def body(rank):
        return hvd.allreduce(np.ones(3), op=hvd.Adasum if rank == 0 else hvd.Sum, name="mix")

    with pytest.raises(RankFailed, match="Adasum"):
        run_ranks(body, 2)


TORCH_ADASUM = textwrap.dedent(
    """
    import torch, numpy as np
    import horovod.torch as hvd
    from sklearn.datasets import load_digits

    hvd.init()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), op=hvd.Adasum,
        named_parameters=model.named_parameters())
    assert type(opt).__name__ == "Adam"
    mine = torch.arange(hvd.rank(), len(y), hvd.size())
    for epoch in range(15):
        for i in range(0, len(mine), 64):
            idx = mine[i:i + 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sums = hvd.allgather_object(float(flat.double().sum()))
    assert len(set(sums)) == 1, sums  # the replicas stayed identical
    print(f"rank {hvd.rank()} of {hvd.size()}: accuracy {acc:.3f}", flush=True)
    assert acc > 0.9, acc
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None,
    reason="needs torch and scikit-learn",
)
def test_torch_adasum_optimizer_converges_at_3_processes():
    r = run_script(TORCH_ADASUM, np_=3, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("accuracy") == 3


TF_ADASUM = textwrap.dedent(
    """
    import numpy as np, tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvdk
    from horovod.collectives.adasum import reference

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.standard_normal((8, 5)))
    w = tf.Variable(np.linspace(0.5, 1.5, 5))

    def loss():
        return tf.reduce_sum((tf.linalg.matvec(x, w) - 1.0) ** 2)

    with tf.GradientTape() as tape:
        value = loss()
    (g,) = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(value, [w])
    with tf.GradientTape() as tape:
        value = loss()
    raw = tape.gradient(value, w).numpy()
    want = reference(hvd.allgather_object(raw))
    assert g.numpy().tobytes() == want.tobytes(), (g.numpy(), want)

    # Keras: the optimizer applies the Adasum of the ranks' gradients
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(1)])
    hvdk.callbacks.BroadcastGlobalVariablesCallback(0)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), op=hvd.Adasum)
    model.compile(opt, loss="mse")
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    model.fit(x, y, epochs=3, batch_size=8, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    sums = hvd.allgather_object(float(sum(np.sum(v) for v in model.get_weights())))
    assert len(set(sums)) == 1, sums
    print("adasum tf ok", flush=True)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs TensorFlow")
def test_tensorflow_tape_and_keras_optimizer_take_adasum():
    r = run_script(TF_ADASUM, np_=3, timeout=180, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("adasum tf ok") == 3


@pytest.mark.skipif(
    importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None,
    reason="needs jax and optax",
)
def test_jax_allreduce_and_optax_optimizer_take_adasum():
    """Eagerly and inside jax.jit; the optax wrapper combines the ranks' gradients (with SGD
    the update is -lr times their Adasum)."""
    import jax
    import jax.numpy as jnp
    import optax

    import horovod.jax as hj

    def grads(rank):
        return np.random.default_rng(rank).standard_normal(6).astype(np.float32)

    def body(rank):
        g = jnp.asarray(grads(rank))
        eager = hj.allreduce(g, op=hj.Adasum, name="e")
        jitted = jax.jit(lambda x: hj.allreduce(x, op=hj.Adasum, name="j"))(g)
        opt = hj.DistributedOptimizer(optax.sgd(0.5), op=hj.Adasum)
        params = {"w": jnp.zeros(6, jnp.float32)}
        updates, _ = opt.update({"w": g}, opt.init(params), params)
        return np.asarray(eager), np.asarray(jitted), np.asarray(updates["w"])

    want = reference([grads(r) for r in range(3)])
    for eager, jitted, update in run_ranks(body, 3):
        np.testing.assert_array_equal(eager, want)
        np.testing.assert_array_equal(jitted, want)
        np.testing.assert_allclose(update, -0.5 * want, rtol=1e-6)


PLANES = textwrap.dedent(
    """
    import numpy as np
    import horovod.numpy as hvd
    from horovod.collectives.adasum import reference

    hvd.init()
    grad = lambda k: np.random.default_rng(k).standard_normal(50_000).astype(np.float32)
    got = hvd.allreduce(grad(hvd.rank()), op=hvd.Adasum, name="g")
    assert got.tobytes() == reference([grad(k) for k in range(hvd.size())]).tobytes()
    print("plane ok", flush=True)
    """
)


@pytest.mark.parametrize("plane", ["shared-memory", "tcp"])
def test_adasum_on_the_process_planes_at_3_processes(plane):
    """(The MPI plane: tests/test_mpi.py's collectives job.)"""
    env = {"HOROVOD_SHARED_MEMORY": "0"} if plane == "tcp" else {}
    r = run_script(PLANES, np_=3, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("plane ok") == 3


def test_the_combine_benchmark_compares_a_baseline_checkout(tmp_path):
    """``horovod.benchmarks.adasum`` times this checkout's ``combine`` and a baseline's in
    alternating processes (here the baseline is a copy of this one) and prints their ratio."""
    import shutil

    from conftest import run_module

    shutil.copytree(REPO / "horovod", tmp_path / "horovod")
    r = run_module(
        "horovod.benchmarks.adasum", "--quick", "--repeats", "1", "--baseline", str(tmp_path)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    from horovod.benchmarks.adasum import LAYOUTS

    for label, _, _ in LAYOUTS:
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {label} |"))
        assert row.count(" us |") == 2 and row.rstrip(" |").endswith("x"), row
