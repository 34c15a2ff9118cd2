"""horovod.jax at 1, 2 and 3 ranks: every collective eagerly and inside jax.jit, gradients
through them (upstream's definitions), allreduce_gradients and broadcast_parameters on pytrees,
DistributedOptimizer over optax against one process on the whole batch, the errors, and the
example under horovodrun."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

import horovod.jax as hvd  # noqa: E402
from horovod.testing import run_ranks  # noqa: E402


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"np{n}")
def n(request):
    return request.param


def both(fn, *args):
    """``fn(*args)`` eagerly and under jax.jit, as NumPy."""
    eager = jax.tree_util.tree_map(np.asarray, fn(*args))
    jitted = jax.tree_util.tree_map(np.asarray, jax.jit(fn)(*args))
    return eager, jitted


def test_collectives_eager_and_jitted(n):
    def body(rank):
        x = jnp.arange(2.0 * n).reshape(n, 2) + 10 * rank

        def fn(x):
            return {
                "sum": hvd.allreduce(x, op=hvd.Sum, name="s"),
                "avg": hvd.allreduce(x, name="a"),
                "max": hvd.allreduce(x, op=hvd.Max, name="m"),
                "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, name="p"),
                "grouped": hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum, name="g"),
                "gather": hvd.allgather(x[:1], name="ag"),
                "bcast": hvd.broadcast(x, root_rank=n - 1, name="b"),
                "a2a": hvd.alltoall(x, name="t"),
                "rs": hvd.reducescatter(x, op=hvd.Sum, name="rs"),
            }

        return both(fn, x)

    base = np.arange(2.0 * n).reshape(n, 2)
    total = sum(base + 10 * r for r in range(n))
    for rank, results in enumerate(run_ranks(body, n)):
        for got in results:
            np.testing.assert_allclose(got["sum"], total)
            np.testing.assert_allclose(got["avg"], total / n)
            np.testing.assert_allclose(got["max"], base + 10 * (n - 1))
            np.testing.assert_allclose(got["scaled"], 2 * total)
            np.testing.assert_allclose(got["grouped"][1], total[:1])
            np.testing.assert_allclose(got["gather"], [base[0] + 10 * r for r in range(n)])
            np.testing.assert_allclose(got["bcast"], base + 10 * (n - 1))
            np.testing.assert_allclose(got["a2a"], [base[rank] + 10 * r for r in range(n)])
            np.testing.assert_allclose(got["rs"], total[rank : rank + 1])


def test_gradients_through_collectives_are_upstreams(n):
    """Rank r scales each output by k = r + 1 (jax.grad, under jit)."""

    def body(rank):
        k = rank + 1.0
        w = jnp.ones((n, 2))
        losses = {
            "allreduce": lambda w: jnp.sum(hvd.allreduce(w, op=hvd.Sum, name="gs") * k),
            "allgather": lambda w: jnp.sum(hvd.allgather(w, name="gg") * k),
            "broadcast": lambda w: jnp.sum(hvd.broadcast(w, 0, name="gb") * k),
            "alltoall": lambda w: jnp.sum(hvd.alltoall(w, name="gt") * k),
            "reducescatter": lambda w: jnp.sum(hvd.reducescatter(w, op=hvd.Sum, name="gr") * k),
        }
        return {key: np.asarray(jax.jit(jax.grad(f))(w)) for key, f in losses.items()}

    ks = [r + 1.0 for r in range(n)]
    mean = sum(ks) / n
    for rank, g in enumerate(run_ranks(body, n)):
        np.testing.assert_allclose(g["allreduce"], np.full((n, 2), sum(ks)))
        np.testing.assert_allclose(g["allgather"], np.full((n, 2), mean))
        np.testing.assert_allclose(g["broadcast"], np.full((n, 2), mean if rank == 0 else 0.0))
        np.testing.assert_allclose(g["alltoall"], [[i + 1.0] * 2 for i in range(n)])
        np.testing.assert_allclose(g["reducescatter"], [[n * (i + 1.0)] * 2 for i in range(n)])


def _mlp(key):
    k1, k2 = jax.random.split(key)
    return {
        "dense": {"w": jax.random.normal(k1, (4, 8)) * 0.5, "b": jnp.zeros(8)},
        "out": {"w": jax.random.normal(k2, (8, 2)) * 0.5, "b": jnp.zeros(2)},
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(step, rank, n_per=8):
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.normal(size=(n_per, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def test_distributed_optimizer_trains_like_one_process_on_the_whole_batch(n):
    """Different initial weights per rank, broadcast from rank 0; each step averages the
    ranks' gradients inside a jitted step: every rank ends with the weights one process
    gets training on the concatenated batch."""

    def body(rank):
        params = hvd.broadcast_parameters(_mlp(jax.random.PRNGKey(rank)), root_rank=0)
        opt = hvd.DistributedOptimizer(optax.adam(0.05))
        state = opt.init(params)

        @jax.jit
        def step(params, state, x, y):
            grads = jax.grad(_loss)(params, x, y)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for s in range(5):
            params, state = step(params, state, *_batch(s, rank))
        return jax.tree_util.tree_map(np.asarray, params)

    ref = _mlp(jax.random.PRNGKey(0))
    ref_opt = optax.adam(0.05)
    ref_state = ref_opt.init(ref)
    for s in range(5):
        parts = [_batch(s, r) for r in range(n)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        grads = jax.grad(_loss)(ref, x, y)
        updates, ref_state = ref_opt.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    for params in run_ranks(body, n):
        for a, b in zip(
            jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_allreduce_gradients_of_a_pytree():
    def body(rank):
        grads = {"a": jnp.full(3, rank + 1.0), "b": [jnp.ones((2, 2)) * rank]}
        eager = hvd.allreduce_gradients(grads)
        summed = jax.jit(lambda g: hvd.allreduce_gradients(g, op=hvd.Sum, name="s"))(grads)
        return jax.tree_util.tree_map(np.asarray, (eager, summed))

    for eager, summed in run_ranks(body, 2):
        np.testing.assert_allclose(eager["a"], [1.5] * 3)
        np.testing.assert_allclose(eager["b"][0], np.full((2, 2), 0.5))
        np.testing.assert_allclose(summed["a"], [3.0] * 3)


def test_pytree_errors_name_the_leaf():
    def body(rank):
        with pytest.raises(ValueError, match=r"the leaf at \['b'\] is a str, not an array"):
            hvd.allreduce_gradients({"a": jnp.ones(2), "b": "oops"})
        params = {"w": jnp.ones(3 if rank == 0 else 4)}
        with pytest.raises(
            ValueError,
            match=r"rank 0 has \['w'\] with shape \(3,\).*rank 1 has \['w'\] with shape \(4,\)",
        ):
            hvd.broadcast_parameters(params)
        with pytest.raises(ValueError, match="optax.GradientTransformation"):
            hvd.DistributedOptimizer(object())
        with pytest.raises(ValueError, match="multiple of the number of ranks"):
            hvd.alltoall(jnp.ones(3))
        with pytest.raises(ValueError, match="with splits inside jax.jit"):
            jax.jit(lambda x: hvd.alltoall(x, splits=[1, 1]))(jnp.ones(2))
        return "ok"

    assert run_ranks(body, 2) == ["ok", "ok"]


def test_allgather_under_jit_needs_the_same_rows_everywhere():
    from horovod.common.exceptions import HorovodInternalError

    def body(rank):
        rows = jnp.ones((rank + 1, 2))
        uneven = np.asarray(hvd.allgather(rows, name="eager"))  # eagerly: any rows
        assert uneven.shape == (3, 2)
        with pytest.raises(
            (ValueError, HorovodInternalError, Exception), match="same first dimension"
        ):
            jax.block_until_ready(jax.jit(lambda x: hvd.allgather(x, name="jit"))(rows))
        return "ok"

    assert run_ranks(body, 2) == ["ok", "ok"]


@pytest.mark.e2e
@pytest.mark.parametrize("example", ["jax_digits.py", "flax_nnx_digits.py"])
def test_example_trains_identical_replicas_under_horovodrun(example):
    from conftest import horovodrun_example

    if example.startswith("flax"):
        pytest.importorskip("flax.nnx")
    r = horovodrun_example(2, example, "--epochs", "3", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replicas identical: True" in r.stdout and "[0]<stdout>:test accuracy" in r.stdout, (
        r.stdout
    )


@pytest.mark.e2e
def test_training_benchmark_runs_every_configuration():
    """``python -m horovod.benchmarks.jax_training``: plain JAX, horovod.jax at 1 and 2 ranks
    and jax.distributed at 2 processes, one table row with a figure in every cell."""
    from conftest import run_module

    r = run_module(
        "horovod.benchmarks.jax_training",
        *("--models", "mlp", "--steps", "3", "--warmup", "1", "--repeats", "1"),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("| mlp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10 and all(float(c) > 0 for c in cells[1:6]), row
    assert cells[6].endswith("%") and cells[9].endswith("x"), row
