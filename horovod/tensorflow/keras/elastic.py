"""``horovod.tensorflow.keras.elastic``: ``KerasState``, the elastic callbacks and ``run``
for tf.keras (see ``horovod/keras_common/elastic.py``).

Must not touch: standalone Keras (tf.keras only).
"""

from horovod.tensorflow.elastic import _keras, run

KerasState = _keras.KerasState
CommitStateCallback = _keras.CommitStateCallback
UpdateBatchStateCallback = _keras.UpdateBatchStateCallback
UpdateEpochStateCallback = _keras.UpdateEpochStateCallback

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
