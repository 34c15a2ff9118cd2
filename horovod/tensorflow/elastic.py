"""``horovod.tensorflow.elastic``: ``run`` (which also treats TensorFlow's wrapping of a failed
Horovod op as the ``HorovodInternalError`` it is), ``TensorFlowKerasState`` for Keras models,
and ``TensorFlowState`` for plain ``tf.Variable`` lists.

Must not touch: the engine (states broadcast through the TensorFlow frontend).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from horovod.common.exceptions import HorovodInternalError
from horovod.elastic import ObjectState, State
from horovod.elastic.run import reset, run_fn
from horovod.keras_common import elastic as keras_elastic
from horovod.tensorflow.mpi_ops import broadcast_variables

# Text of the errors a failed collective raises, as TensorFlow reports them from inside an op.
_HOROVOD_FAILURES = ("HorovodInternalError", "TransportError", "Horovod has been shut down")


def _unwrapped(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as e:
            if any(text in str(e.message) for text in _HOROVOD_FAILURES):
                raise HorovodInternalError(str(e.message)) from e
            raise

    return call


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``@hvd.elastic.run`` for TensorFlow and Keras training functions."""
    return run_fn(_unwrapped(func), reset)


_keras = keras_elastic.build(tf.keras.callbacks.Callback, broadcast_variables)
TensorFlowKerasState = _keras.KerasState


class TensorFlowState(ObjectState):
    """``TensorFlowState(variables, epoch=0)``: a list of ``tf.Variable`` plus attributes
    (upstream's ``session`` argument is for TF1 graphs and is not supported)."""

    def __init__(
        self, variables: Sequence[tf.Variable] | None = None, session: Any = None, **kwargs: Any
    ) -> None:
        if session is not None:
            raise ValueError(
                "TensorFlowState(session=...) is for TensorFlow 1 sessions, which this build "
                "does not support; pass the variables of an eager (TF2) program"
            )
        self.variables = list(
            variables if variables is not None else tf.compat.v1.global_variables()
        )
        self._saved_values = [tf.identity(v) for v in self.variables]
        super().__init__(**kwargs)

    def save(self) -> None:
        self._saved_values = [tf.identity(v) for v in self.variables]
        super().save()

    def restore(self) -> None:
        for v, x in zip(self.variables, self._saved_values, strict=True):
            v.assign(x)
        super().restore()

    def sync(self) -> None:
        root = self.newest_holder()
        broadcast_variables(self.variables, root, name="elastic.variables")
        self.sync_objects(root)
        self._saved_values = [tf.identity(v) for v in self.variables]


__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]
