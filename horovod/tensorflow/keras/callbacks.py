"""Upstream's Keras callbacks for tf.keras: see ``horovod/keras_common/callbacks.py``.

Must not touch: standalone Keras (tf.keras only).
"""

import tensorflow as tf

from horovod.keras_common import callbacks as shared
from horovod.tensorflow import mpi_ops

_built = shared.build(
    tf.keras.callbacks.Callback, mpi_ops.broadcast_variables, tf.keras.callbacks.ModelCheckpoint
)
BestModelCheckpoint = _built.BestModelCheckpoint
BroadcastGlobalVariablesCallback = _built.BroadcastGlobalVariablesCallback
MetricAverageCallback = _built.MetricAverageCallback
LearningRateScheduleCallback = _built.LearningRateScheduleCallback
LearningRateWarmupCallback = _built.LearningRateWarmupCallback
LocalSGDCallback = _built.LocalSGDCallback
DiLoCoCallback = _built.DiLoCoCallback

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "DiLoCoCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "LocalSGDCallback",
    "MetricAverageCallback",
]
