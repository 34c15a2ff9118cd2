"""Upstream's Keras callbacks for tf.keras: see ``horovod/_keras_callbacks.py``."""

import tensorflow as tf

from horovod import _keras_callbacks
from horovod.tensorflow import mpi_ops

_built = _keras_callbacks.build(tf.keras.callbacks.Callback, mpi_ops.broadcast_variables)
BroadcastGlobalVariablesCallback = _built.BroadcastGlobalVariablesCallback
MetricAverageCallback = _built.MetricAverageCallback
LearningRateScheduleCallback = _built.LearningRateScheduleCallback
LearningRateWarmupCallback = _built.LearningRateWarmupCallback

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
