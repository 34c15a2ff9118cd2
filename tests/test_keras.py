"""Keras under the real horovodrun, one job per flavour: standalone Keras 3 through
``horovod.keras`` on the torch and tensorflow backends, and Keras 2 (tf-keras,
``TF_USE_LEGACY_KERAS=1``) through ``horovod.tensorflow.keras``. Each rank starts from different
weights and trains on different data; the job must end with identical replicas and the same
(averaged) metrics on every rank."""

import importlib.util
import re

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

SCRIPT = """
import numpy as np
import {module} as hvd

hvd.init()
{keras_import}
{seed}
model = keras.Sequential(
    [keras.layers.Dense(8, activation="relu", input_shape=(4,)), keras.layers.Dense(2)]
)
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
model.compile(
    optimizer=opt,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(64, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
h = model.fit(
    x, y, batch_size=16, epochs=2, verbose=0,
    callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1),
    ],
)
digest = hvd.allgather(np.array([sum(float(np.sum(w)) for w in model.get_weights())]))
print("class", type(model.optimizer).__name__, "identical", len(set(digest.tolist())) == 1,
      "loss", h.history["loss"])

# PartialDistributedOptimizer: the local layer's gradient stays local (divided by the number
# of ranks, upstream's scale_local_gradients), the other is averaged.
local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
local.build((None, 1))
shared.build((None, 1))
popt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
ops = getattr(keras, "ops", None)
to_t = ops.convert_to_tensor if ops is not None else __import__("tensorflow").constant
g = to_t(np.full((1, 1), hvd.rank() + 1.0, "float32"))
popt.apply_gradients(zip([g, g], [local.kernel, shared.kernel]))
print("partial", float(np.asarray(local.kernel).item()), float(np.asarray(shared.kernel).item()))
"""

FLAVOURS = {
    "keras3-torch": (
        "horovod.keras",
        "import keras",
        "keras.utils.set_random_seed(hvd.rank())",
        {"KERAS_BACKEND": "torch"},
        ("keras", "torch"),
    ),
    "keras3-jax": (  # Keras's default jit-compiled train step (jit_compile="auto")
        "horovod.keras",
        "import keras",
        "keras.utils.set_random_seed(hvd.rank())",
        {"KERAS_BACKEND": "jax"},
        ("keras", "jax"),
    ),
    "keras3-tensorflow": (
        "horovod.keras",
        "import keras",
        "keras.utils.set_random_seed(hvd.rank())",
        {"KERAS_BACKEND": "tensorflow"},
        ("keras", "tensorflow"),
    ),
    "tf-keras2": (
        "horovod.tensorflow.keras",
        "import tensorflow as tf\nkeras = tf.keras",
        "tf.random.set_seed(hvd.rank())",
        {"TF_USE_LEGACY_KERAS": "1"},
        ("tf_keras", "tensorflow"),
    ),
}


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_model_fit_ends_with_identical_replicas(flavour):
    module, keras_import, seed, env, needs = FLAVOURS[flavour]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    script = SCRIPT.format(module=module, keras_import=keras_import, seed=seed)
    out = run_script(script, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"), timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    lines = re.findall(r"\[(\d)\]<stdout>:class SGD identical True loss (\[.*\])", out.stdout)
    assert len(lines) == 2, text[-4000:]
    assert lines[0][1] == lines[1][1]  # metrics averaged: the same on both ranks
    partial = dict(re.findall(r"\[(\d)\]<stdout>:partial (\S+ \S+)", out.stdout))
    # local: 1 - (rank + 1) / 2; shared: 1 - mean(1, 2)
    assert partial == {"0": "0.5 -0.5", "1": "0.0 -0.5"}, text[-4000:]


def test_keras2_backward_passes_per_step():
    if importlib.util.find_spec("tf_keras") is None:
        pytest.skip("needs tf_keras")
    script = """
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

hvd.init()
keras = tf.keras
w = tf.Variable([0.0])
opt = hvd.DistributedOptimizer(
    keras.optimizers.SGD(1.0), backward_passes_per_step=2, average_aggregated_gradients=True
)

@tf.function
def step(g):
    opt.apply_gradients([(g, w)])

for p in range(4):
    step(tf.constant([float(p + 1 + hvd.rank())]))
print("module", type(opt).__mro__[1].__module__, "value", float(w.numpy()[0]))
print("helper", type(opt._agg_helper).__name__)  # upstream's attribute

# minimize goes through _compute_gradients (upstream's override), reduced once
w2 = tf.Variable([1.0])
opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
assert opt2._agg_helper is None
opt2.minimize(lambda: w2 * float(hvd.rank() + 1), [w2])
print("minimize", float(w2.numpy()[0]))
"""
    out = run_script(script, env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    # passes (1,2) and (3,4) per rank r shifted by r; mean over passes, then over ranks:
    # 2 + 4 = 6 applied with lr 1
    values = re.findall(r"module tf_keras\S* value (\S+)", out.stdout)
    assert values == ["-6.0", "-6.0"], out.stdout
    assert out.stdout.count("helper LocalGradientAggregationHelper") == 2, out.stdout
    assert re.findall(r"minimize (\S+)", out.stdout) == ["-0.5", "-0.5"], out.stdout


XLA_SCRIPT = """
import numpy as np
import horovod.keras as hvd
import keras
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

hvd.init()


def fit(jit, custom_step=False):
    keras.utils.set_random_seed(0)  # the same initial weights on every rank and in both runs
    cls = keras.Sequential
    if custom_step:  # a train_step of its own: Keras's train function, unchanged
        class Stepped(keras.Sequential):
            def train_step(self, data):
                return super().train_step(data)
        cls = Stepped
    model = cls([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit,
        steps_per_execution=2,
    )
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    h = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    return model, h.history["loss"]


compiled, loss = fit(True)
plain, _ = fit(False)
close = all(
    np.allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled.get_weights(), plain.get_weights())
)
digest = hvd.allgather(np.array([sum(float(np.sum(w)) for w in compiled.get_weights())]))
print("xla", compiled.jit_compile, "close", close, "identical", len(set(digest.tolist())) == 1,
      "decreasing", loss[-1] < loss[0], flush=True)
try:
    fit(True, custom_step=True)
    print("custom: no error")
except Exception as e:
    print("custom:", type(e).__name__, "cannot run inside an XLA-compiled function" in str(e))
"""


def test_keras3_tensorflow_under_xla_reduces_outside_the_compiled_parts():
    """model.compile(jit_compile=True) (what "auto" resolves to on a GPU): the forward and
    backward pass and the optimizer's update run compiled, the reduction between them; the
    weights are those of the uncompiled run."""
    missing = [m for m in ("keras", "tensorflow") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    out = run_script(
        XLA_SCRIPT, env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert out.stdout.count("xla True close True identical True decreasing True") == 2, text[-4000:]
    assert out.stdout.count("custom: ValueError True") == 2, text[-4000:]
