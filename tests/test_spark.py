"""horovod.spark.run against a real Spark ``local[2]`` session (one per module, UI off, on
loopback): results by rank, the rank layout, Python workers reused across runs, a failing rank
named as the root cause, more ranks than task slots refused at once, the example's training."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests import mpi_impls

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("pyspark") is None or shutil.which("java") is None,
        reason="needs PySpark and a Java runtime (pip install 'pyhorovod[spark]'; "
        "apt-get install openjdk-17-jre-headless)",
    ),
    # PySpark's result sockets (py4j, collect) are left for the garbage collector to close
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("horovod tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join([HERE, ROOT]))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        _stop_the_jvm()


def _stop_the_jvm() -> None:
    """PySpark keeps its JVM until the interpreter exits: end it with this module, and let
    the garbage collector close PySpark's sockets now, not during a later module's tests."""
    import gc
    import warnings

    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is not None:
        proc = getattr(gateway, "proc", None)
        try:
            gateway.shutdown()
        except Exception:  # noqa: BLE001 - already gone
            pass
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        SparkContext._gateway = None
        SparkContext._jvm = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()


def layout_job(scale):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    s = hvd.allreduce(np.full(3, hvd.rank() + 1.0) * scale, op=hvd.Sum, name="spark.sum")
    extra = os.environ.get("HVD_TEST_EXTRA")
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), s.tolist(), extra


def test_run_returns_results_by_rank_and_runs_again_in_the_same_workers(spark):
    import horovod.spark

    out = horovod.spark.run(layout_job, args=(2.0,), num_proc=2, env={"HVD_TEST_EXTRA": "x"})
    assert out == [(0, 2, 0, 2, [6.0] * 3, "x"), (1, 2, 1, 2, [6.0] * 3, "x")]
    # Spark reuses its Python workers: Horovod was shut down and the environment restored
    again = horovod.spark.run(layout_job, kwargs={"scale": 1.0})  # num_proc: the parallelism
    assert again == [(0, 2, 0, 2, [3.0] * 3, None), (1, 2, 1, 2, [3.0] * 3, None)]
    assert horovod.spark.run(lambda: 7, num_proc=1) == [7]


def failing_job():
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("bad batch 42")
    hvd.allreduce(np.ones(3), name="waits.for.rank1")


def test_a_failing_rank_is_named_as_the_root_cause(spark):
    import horovod.spark

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed: KeyError: 'bad batch 42'"):
        horovod.spark.run(failing_job, num_proc=2)
    assert time.monotonic() - t0 < 60
    # the session is still usable
    assert [r[4] for r in horovod.spark.run(layout_job, args=(1.0,), num_proc=2)] == [[3.0] * 3] * 2


def test_more_ranks_than_task_slots_are_refused_at_once(spark):
    import horovod.spark

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="runs 2 tasks at once"):
        horovod.spark.run(layout_job, args=(1.0,), num_proc=3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="use_gloo and use_mpi only allow one"):
        horovod.spark.run(layout_job, use_mpi=True, use_gloo=True)
    with pytest.raises(ValueError, match="num_proc must be at least 1"):
        horovod.spark.run(layout_job, num_proc=0)


def mpi_job(scale):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    s = hvd.allreduce(np.full(3, hvd.rank() + 1.0) * scale, op=hvd.Sum, name="spark.mpi.sum")
    g = hvd.allgather(np.full((hvd.rank() + 1, 2), float(hvd.rank())), name="spark.mpi.gather")
    extra = os.environ.get("HVD_TEST_EXTRA")
    return hvd.rank(), hvd.size(), hvd.mpi_enabled(), s.tolist(), g.tolist(), extra


def _mpi_processes():
    import psutil

    marks = ("horovod.spark.mpi_agent", "horovod.runner.run_task", "prted")
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(m in part for part in p.info["cmdline"] or [] for m in marks)
    ]


@pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpirun and mpi4py (pip install 'pyhorovod[mpi]')",
)
def test_use_mpi_starts_the_ranks_with_mpirun_inside_the_tasks(spark):
    """use_mpi=True: mpirun's daemons run in the Spark tasks (through the remote-shell agent),
    the data moves through MPI, a failing rank is named, and nothing is left running."""
    import horovod.spark

    out = horovod.spark.run(
        mpi_job, args=(2.0,), num_proc=2, use_mpi=True, env={"HVD_TEST_EXTRA": "m"}
    )
    gathered = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert out == [(r, 2, True, [6.0] * 3, gathered, "m") for r in range(2)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed: KeyError: 'bad batch 42'"):
        horovod.spark.run(failing_job, num_proc=2, extra_mpi_args="--mca btl self,vader,tcp")
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 10
    while _mpi_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _mpi_processes()
    # the tasks' slots are free again, and the session runs the built-in planes as before
    assert [r[2] for r in horovod.spark.run(mpi_job, args=(1.0,), num_proc=2)] == [False] * 2


def test_use_mpi_without_mpirun_says_what_to_install(spark, monkeypatch):
    import horovod.spark

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(
        RuntimeError, match=r"needs an mpirun on the driver's PATH.*pyhorovod\[mpi\]"
    ):
        horovod.spark.run(mpi_job, args=(1.0,), num_proc=2, use_mpi=True)


HYDRA_SPARK_JOB = """
import os, sys
from pyspark.sql import SparkSession
session = (
    SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"]).getOrCreate()
)
session.sparkContext.setLogLevel("ERROR")
import horovod.spark


def mpi_job(scale):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    s = hvd.allreduce(np.full(3, hvd.rank() + 1.0) * scale, op=hvd.Sum, name="spark.mpi.sum")
    g = hvd.allgather(np.full((hvd.rank() + 1, 2), float(hvd.rank())), name="spark.mpi.gather")
    return hvd.rank(), hvd.size(), hvd.mpi_enabled(), s.tolist(), g.tolist(), None


print("RESULT", horovod.spark.run(mpi_job, args=(1.0,), num_proc=2, use_mpi=True))
session.stop()
"""


@pytest.mark.parametrize(
    "impl", [pytest.param(i, marks=mpi_impls.needs(i)) for i in ("mpich", "intelmpi")]
)
def test_use_mpi_under_hydra(impl, tmp_path):
    """MPICH's and Intel MPI's mpirun (Hydra) take the agent as ``-launcher-exec``, and call it
    ssh's way (``-x host command``). Their venvs hold no PySpark: this one's is lent to them."""
    import py4j
    import pyspark

    lent = tmp_path / "lent"
    lent.mkdir()
    for module in (pyspark, py4j):
        (lent / module.__name__).symlink_to(os.path.dirname(module.__file__))
    env = dict(os.environ)
    env["PATH"] = mpi_impls.path(impl, env.get("PATH", ""))
    env["PYTHONPATH"] = os.pathsep.join([str(lent), HERE, ROOT])
    out = subprocess.run(
        [mpi_impls.python(impl), "-c", HYDRA_SPARK_JOB],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    expected = [(r, 2, True, [3.0] * 3, [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], None) for r in (0, 1)]
    assert f"RESULT {expected}" in out.stdout, out.stderr[-3000:]
    assert not _mpi_processes()


def test_without_a_session_run_says_how_to_make_one():
    code = (
        "import sys, horovod.spark\n"
        "assert 'pyspark' not in sys.modules and 'torch' not in sys.modules\n"
        "try:\n    horovod.spark.run(print)\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "needs an active Spark session" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_spark_example_trains_the_digits_model(spark):
    import horovod.spark

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import ray_torch_digits
    finally:
        sys.path.pop(0)
    spark.sparkContext.addPyFile(os.path.join(ROOT, "examples", "ray_torch_digits.py"))
    out = horovod.spark.run(ray_torch_digits.train, args=(8, 32, 0.02), num_proc=2)
    assert [r["rank"] for r in out] == [0, 1] and out[0]["accuracy"] >= 0.9
    assert out[0]["checksum"] == out[1]["checksum"]


# ---------------------------------------------------------------------------- estimators
needs_estimator_stack = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "pyarrow", "pandas")),
    reason="the Torch estimator needs torch, pyarrow and pandas",
)


@needs_estimator_stack
def test_torch_estimator_fits_a_dataframe_and_its_model_predicts(spark, tmp_path):
    import numpy as np
    import torch
    from pyspark.ml.feature import VectorAssembler

    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator, TorchModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 2))
    y = 3 * x[:, 0] - 2 * x[:, 1] + 1
    rows = [(float(a), float(b), float(c)) for (a, b), c in zip(x, y, strict=True)]
    df = spark.createDataFrame(rows, ["x1", "x2", "y"])
    df = VectorAssembler(inputCols=["x1", "x2"], outputCol="features").transform(df)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    store = Store.create(str(tmp_path / "store"))
    est = TorchEstimator(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=6,
        validation=0.2,
        store=store,
        run_id="run1",
        verbose=0,
    )
    fitted = est.fit(df)
    assert isinstance(fitted, TorchModel) and fitted.getRunId() == "run1"
    history = fitted.getHistory()
    assert len(history["loss"]) == len(history["val_loss"]) == 6
    assert history["loss"][-1] < 1e-3 < history["loss"][0]
    w, b = fitted.getModel().weight.data[0].tolist(), float(fitted.getModel().bias.data[0])
    assert abs(w[0] - 3) < 0.05 and abs(w[1] + 2) < 0.05 and abs(b - 1) < 0.05
    assert store.exists(store.get_checkpoint_path("run1"))
    assert store.exists(store.get_logs_path("run1") + "/history.json")
    out = fitted.transform(df).select("y", "y__output").collect()
    assert len(out) == 300
    assert max(abs(r["y"] - r["y__output"]) for r in out) < 0.1


@needs_estimator_stack
def test_estimator_mistakes_are_named(spark, tmp_path):
    import torch

    from horovod.spark.common.store import Store
    from horovod.spark.task import get_available_devices
    from horovod.spark.torch import TorchEstimator

    df = spark.createDataFrame([(1.0, 2.0)], ["a", "b"])
    store = Store.create(f"file://{tmp_path}/s")
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs loss"):
        TorchEstimator(
            model=model, optimizer=opt, feature_cols=["a"], label_cols=["b"], store=store
        ).fit(df)
    est = TorchEstimator(
        num_proc=2,
        model=model,
        optimizer=opt,
        loss=torch.nn.MSELoss(),
        store=store,
        feature_cols=["nope"],
        label_cols=["b"],
    )
    with pytest.raises(ValueError, match=r"columns \['nope'\] are not in the DataFrame"):
        est.fit(df)
    with pytest.raises(NotImplementedError, match="only local directories"):
        Store.create("s3://bucket/prefix")
    assert get_available_devices() == []  # on the driver
    assert horovod_spark_run(lambda: get_available_devices(), num_proc=2) == [[], []]


def horovod_spark_run(fn, **kwargs):
    import horovod.spark

    return horovod.spark.run(fn, **kwargs)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("tensorflow", "keras", "pyarrow", "pandas")),
    reason="the Keras estimator needs tensorflow, keras, pyarrow and pandas",
)
def test_keras_estimator_fits_a_dataframe_and_its_model_predicts(spark, tmp_path):
    import keras
    import numpy as np
    from pyspark.ml.feature import VectorAssembler

    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator, KerasModel

    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2))
    y = 3 * x[:, 0] - 2 * x[:, 1] + 1
    rows = [(float(a), float(b), float(c)) for (a, b), c in zip(x, y, strict=True)]
    df = VectorAssembler(inputCols=["x1", "x2"], outputCol="features").transform(
        spark.createDataFrame(rows, ["x1", "x2", "y"])
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    store = Store.create(str(tmp_path / "kstore"))
    fitted = KerasEstimator(
        num_proc=2,
        model=model,
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=6,
        validation=0.2,
        store=store,
        run_id="krun",
        verbose=0,
    ).fit(df)
    assert isinstance(fitted, KerasModel) and fitted.getRunId() == "krun"
    history = fitted.getHistory()
    assert len(history["loss"]) == len(history["val_loss"]) == 6
    assert history["loss"][-1] < 1e-3 < history["loss"][0]
    kernel, bias = fitted.getModel().get_weights()
    assert np.allclose(kernel.ravel(), [3, -2], atol=0.05) and abs(float(bias[0]) - 1) < 0.05
    assert store.exists(store.get_logs_path("krun") + "/history.json")
    out = fitted.transform(df).select("y", "y__output").collect()
    assert len(out) == 300 and max(abs(r["y"] - r["y__output"]) for r in out) < 0.1


# ---------------------------------------------------------------------------- elastic jobs
def _worker_processes():
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(
            "horovod.spark.agent import worker_main" in part for part in p.info["cmdline"] or []
        ):
            out.append(p)
    return out


def _sizes(log):
    return [int(line.split()[3]) for line in log.read_text().splitlines()]


def test_run_elastic_loses_a_worker_goes_on_and_grows_back(spark, tmp_path):
    """Two agents, two workers; rank 1 exits at epoch 0 batch 2: rank 0 goes on alone from its
    last commit, the host comes back after the 1 s cooldown and the idle agent starts a new
    worker. The weights are those of training without faults; nothing is left running."""
    import numpy as np

    import horovod.spark
    from horovod.testing.elastic_train import reference_weights, train_job

    log = tmp_path / "log"
    faults = [{"id": "exit", "epoch": 0, "batch": 2, "rank": 1, "how": "exit"}]
    out = horovod.spark.run_elastic(
        train_job,
        kwargs={"epochs": 3, "batches": 8, "step_seconds": 0.1, "log": str(log)},
        num_proc=2,
        min_num_proc=1,
        cooldown_range=(1, 1),
        env={"HVD_TEST_FAULTS": json.dumps(faults), "HVD_TEST_FAULT_DIR": str(tmp_path)},
    )
    sizes = _sizes(log)
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert [o["rank"] for o in out] == [0, 1] and [o["size"] for o in out] == [2, 2]
    want = reference_weights(3, 8)
    for o in out:
        np.testing.assert_array_equal(o["w"], out[0]["w"])
        np.testing.assert_allclose(o["w"], want, rtol=1e-9, atol=1e-12)
    assert _worker_processes() == []


def shard_error():
    import horovod.numpy as hvd

    hvd.init()
    raise ValueError(f"rank {hvd.rank()} cannot read its shard")


def kill_my_task():
    """Rank 1 kills the Spark task (Python worker) it runs under, as a lost executor would."""
    import signal

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)
    for i in range(600):
        hvd.allreduce(np.ones(2), name=f"step.{i}")
        time.sleep(0.05)


def test_run_elastic_failures_are_explained_and_leave_nothing(spark):
    import horovod.spark

    # every worker raises: no one is left to carry the state; the errors are named
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no worker of round 0 is left") as err:
        horovod.spark.run_elastic(shard_error, num_proc=2, min_num_proc=1)
    assert "exited with code 1" in str(err.value) and "cannot read its shard" in str(err.value)
    # the Spark task running a worker is killed: Spark fails the stage, the job ends at once
    with pytest.raises(RuntimeError, match="Spark stage running the workers failed") as err:
        horovod.spark.run_elastic(kill_my_task, num_proc=2, min_num_proc=1)
    assert "Python worker exited unexpectedly" in str(err.value)  # Spark's own reason
    assert time.monotonic() - t0 < 90
    assert _worker_processes() == []
    # sizes are checked up front
    with pytest.raises(ValueError, match="min_num_proc <= num_proc <= max_num_proc"):
        horovod.spark.run_elastic(shard_error, num_proc=2, min_num_proc=3)
    # and Spark still runs jobs afterwards
    assert horovod.spark.run(lambda: 5, num_proc=2) == [5, 5]
