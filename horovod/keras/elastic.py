"""``horovod.keras.elastic``: ``KerasState``, the elastic callbacks and ``run`` for standalone
Keras (see ``horovod/keras_common/elastic.py``).

Must not touch: tf.keras (standalone Keras only).
"""

import keras

from horovod.elastic import run
from horovod.keras_common import elastic as shared


def _broadcast(variables, root_rank, name=None):  # type: ignore[no-untyped-def]
    from horovod.keras import broadcast_variables

    broadcast_variables(variables, root_rank, name=name)


_built = shared.build(keras.callbacks.Callback, _broadcast)
KerasState = _built.KerasState
CommitStateCallback = _built.CommitStateCallback
UpdateBatchStateCallback = _built.UpdateBatchStateCallback
UpdateEpochStateCallback = _built.UpdateEpochStateCallback

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
