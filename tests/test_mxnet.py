"""horovod.mxnet under the real horovodrun at 1, 2 and 3 ranks, in MXNet's own environment
(``.venv-mxnet``, made by ``.ci/setup``: MXNet 1.9.1 needs NumPy < 1.24): every collective on
NDArrays, broadcast_parameters (deferred initialization included), DistributedTrainer and
DistributedOptimizer against one process on the whole batch, the errors, and the example."""

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("HVD_MXNET_PYTHON") or str(REPO / ".venv-mxnet" / "bin" / "python")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.path.exists(PYTHON),
        reason=f"no MXNet environment at {PYTHON} (bash .ci/setup makes it)",
    ),
]


def horovodrun(np_: int, script: str, *args: str, timeout: float = 180, path: str = ""):
    with tempfile.TemporaryDirectory(prefix="hvd-mx-") as d:
        if not path:
            path = os.path.join(d, "script.py")
            with open(path, "w") as f:
                f.write(textwrap.dedent(script))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = [PYTHON, "-m", "horovod.runner.launch", "-np", str(np_), PYTHON, path, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def results(stdout: str) -> dict[int, dict]:
    out = {}
    for m in re.finditer(r"\[(\d+)\]<stdout>:RESULT (.*)", stdout):
        out[int(m.group(1))] = json.loads(m.group(2))
    return out


COLLECTIVES = """
    import json
    import mxnet as mx
    import numpy as np
    import horovod.mxnet as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.array(np.arange(2 * n).reshape(n, 2) + 10 * r, dtype="float32")
    res = {}
    res["avg"] = hvd.allreduce(x, name="avg").asnumpy().tolist()
    res["sum"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, name="sum").asnumpy().tolist()
    y = x.copy()
    assert hvd.allreduce_(y, op=hvd.Max, name="max") is y
    res["max"] = y.asnumpy().tolist()
    res["grouped"] = [t.asnumpy().tolist() for t in hvd.grouped_allreduce([x, x[0]], op=hvd.Sum, name="g")]
    res["gather"] = hvd.allgather(mx.nd.ones((r + 1, 2), dtype="int32") * r, name="ag").asnumpy().tolist()
    res["ggather"] = [t.shape for t in hvd.grouped_allgather([x, x[:1]], name="gg")]
    b = x.copy()
    hvd.broadcast_(b, root_rank=n - 1, name="b")
    res["bcast"] = b.asnumpy().tolist()
    res["bcast_new"] = hvd.broadcast(x, root_rank=0, name="b2").asnumpy().tolist()
    res["a2a"] = hvd.alltoall(x, name="t").asnumpy().tolist()
    out, recv = hvd.alltoall(x, splits=[1] * n, name="t2")
    res["a2a_recv"] = recv.asnumpy().tolist()
    res["rs"] = hvd.reducescatter(x, op=hvd.Sum, name="rs").asnumpy().tolist()
    res["grs"] = [t.shape for t in hvd.grouped_reducescatter([x, x], op=hvd.Sum, name="grs")]
    res["obj"] = hvd.allgather_object({"rank": r})
    res["dtype"] = str(hvd.allreduce(x.astype("float16"), name="h").dtype)
    try:
        hvd.allreduce(np.ones(3))
    except TypeError as e:
        res["type_error"] = str(e)
    try:
        hvd.allreduce(mx.nd.ones(3 + (r == 0 and n > 1)), name="mismatch")
    except hvd.HorovodInternalError as e:
        res["mismatch"] = str(e).splitlines()[0]
    try:
        hvd.broadcast_parameters([1, 2])
    except ValueError as e:
        res["bad_params"] = str(e)
    print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_on_ndarrays(n):
    r = horovodrun(n, COLLECTIVES)
    assert r.returncode == 0, r.stdout + r.stderr
    got = results(r.stdout)
    assert sorted(got) == list(range(n)), r.stdout + r.stderr
    import numpy as np

    base = np.arange(2 * n).reshape(n, 2)
    total = sum(base + 10 * q for q in range(n))
    for rank, res in got.items():
        np.testing.assert_allclose(res["avg"], total / n)
        np.testing.assert_allclose(res["sum"], 2 * total)
        np.testing.assert_allclose(res["max"], base + 10 * (n - 1))
        np.testing.assert_allclose(res["grouped"][1], total[0])
        assert res["gather"] == [[q, q] for q in range(n) for _ in range(q + 1)]
        assert res["ggather"] == [[n * n, 2], [n, 2]]
        np.testing.assert_allclose(res["bcast"], base + 10 * (n - 1))
        np.testing.assert_allclose(res["bcast_new"], base)
        np.testing.assert_allclose(res["a2a"], [base[rank] + 10 * q for q in range(n)])
        assert res["a2a_recv"] == [1] * n
        np.testing.assert_allclose(res["rs"], total[rank : rank + 1])
        assert res["grs"] == [[1, 2], [1, 2]]
        assert res["obj"] == [{"rank": q} for q in range(n)]
        assert res["dtype"] == "<class 'numpy.float16'>"
        assert "expected an mxnet.nd.NDArray, got ndarray" in res["type_error"]
        assert "invalid params of type list" in res["bad_params"]
        if n > 1:
            assert "allreduce 'mismatch': shape" in res["mismatch"], res


TRAINING = """
    import json, sys
    import mxnet as mx
    import numpy as np
    import horovod.mxnet as hvd
    from mxnet import autograd, gluon

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    way = sys.argv[1]

    def make(seed):
        mx.random.seed(seed)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, activation="tanh"), gluon.nn.Dense(2))
        net.initialize(mx.init.Xavier())  # deferred: shapes known at the first forward
        return net

    def batch(step, rank):
        rng = np.random.default_rng(100 * step + rank)
        x = rng.normal(size=(8, 4)).astype("float32")
        return mx.nd.array(x), mx.nd.array((x[:, 0] > 0).astype("float32"))

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    net = make(seed=r)  # different weights on purpose
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # deferred: broadcast at initialization
    if way == "trainer":
        trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.5})
    else:
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5))
        trainer = gluon.Trainer(params, opt, kvstore=None)
    for step in range(4):
        x, y = batch(step, r)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
    mine = [p.data().asnumpy() for _, p in sorted(params.items())]

    # one process on the concatenated batch, from rank 0's initial weights
    ref = make(seed=0)
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.5}, kvstore=None)
    for step in range(4):
        parts = [batch(step, q) for q in range(n)]
        x = mx.nd.concat(*[p[0] for p in parts], dim=0)
        y = mx.nd.concat(*[p[1] for p in parts], dim=0)
        with autograd.record():
            loss = loss_fn(ref(x), y)
        loss.backward()
        ref_trainer.step(8 * n)
    theirs = [p.data().asnumpy() for _, p in sorted(ref.collect_params().items())]
    err = max(float(np.abs(a - b).max()) for a, b in zip(mine, theirs))
    digest = float(sum(a.astype(np.float64).sum() for a in mine))
    print("RESULT " + json.dumps({"err": err, "digests": hvd.allgather_object(digest)}), flush=True)
"""


@pytest.mark.parametrize("way", ["trainer", "optimizer"])
@pytest.mark.parametrize("n", [2, 3])
def test_training_matches_one_process_on_the_whole_batch(n, way):
    r = horovodrun(n, TRAINING, way)
    assert r.returncode == 0, r.stdout + r.stderr
    got = results(r.stdout)
    assert sorted(got) == list(range(n)), r.stdout + r.stderr
    for res in got.values():
        assert res["err"] < 1e-5, res
        assert len(set(res["digests"])) == 1, res  # identical replicas


def test_example_trains_identical_replicas():
    r = horovodrun(2, "", "--epochs", "3", path=str(REPO / "examples" / "mxnet_digits.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0]<stdout>:test accuracy" in r.stdout and "replicas identical: True" in r.stdout


def test_without_mxnet_the_import_says_what_to_install():
    r = subprocess.run(
        [sys.executable, "-c", "import horovod.mxnet"], capture_output=True, text=True
    )
    if r.returncode == 0:
        pytest.skip("MXNet is installed in the main environment too")
    assert "pip install mxnet==1.9.1 numpy==1.23.5" in r.stderr, r.stderr
