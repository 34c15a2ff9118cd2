"""Batch normalization with statistics over the whole global batch (every rank's samples).

Must not touch: the engine (it uses the collectives of ``mpi_ops``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod.tensorflow import mpi_ops


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """Keras ``BatchNormalization`` whose training-time mean and variance are computed over the
    samples of all ranks: per rank the count, sum and sum of squares are summed with one
    grouped allreduce (differentiable), as if the global batch were on one rank."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused is not False:
            raise ValueError("SyncBatchNormalization does not support fused=True (or None)")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if mask is not None or mpi_ops.F.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float32)
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), tf.float32)
        local_sum = tf.reduce_sum(x, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x), axis=axes)
        total_count, total_sum, total_sq = mpi_ops.grouped_allreduce(
            [tf.reshape(count, [1]), local_sum, local_sq], op=mpi_ops.Sum
        )
        mean = total_sum / total_count
        variance = tf.maximum(total_sq / total_count - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
