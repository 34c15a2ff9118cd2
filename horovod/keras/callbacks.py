"""Upstream's Keras callbacks for standalone Keras 3: see ``horovod/keras_common/callbacks.py``.

Must not touch: tf.keras (standalone Keras only).
"""

import keras

from horovod.keras_common import callbacks as shared


def _broadcast(variables, root_rank, name=None):  # type: ignore[no-untyped-def]
    from horovod.keras import broadcast_variables

    broadcast_variables(variables, root_rank, name=name)


_built = shared.build(keras.callbacks.Callback, _broadcast, keras.callbacks.ModelCheckpoint)
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
