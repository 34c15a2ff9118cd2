"""``horovod.spark.keras``: ``KerasEstimator`` and ``KerasModel`` (upstream's names; docs/spark.md).

Must not touch: the training runtime in the driver (see ``estimator``).
"""

from horovod.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
