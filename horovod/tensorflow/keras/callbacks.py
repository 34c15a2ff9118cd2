"""Upstream's Keras callbacks for tf.keras: see ``horovod/_keras_callbacks.py``."""

import tensorflow as tf

from horovod import _keras_callbacks
from horovod.tensorflow import mpi_ops

_built = _keras_callbacks.build(
    tf.keras.callbacks.Callback, mpi_ops.broadcast_variables, tf.keras.callbacks.ModelCheckpoint
)
BestModelCheckpoint = _built.BestModelCheckpoint
BroadcastGlobalVariablesCallback = _built.BroadcastGlobalVariablesCallback
MetricAverageCallback = _built.MetricAverageCallback
LearningRateScheduleCallback = _built.LearningRateScheduleCallback
LearningRateWarmupCallback = _built.LearningRateWarmupCallback

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
