"""``horovod.spark.torch``: ``TorchEstimator`` and ``TorchModel`` (upstream's names; docs/spark.md).

Must not touch: the training runtime in the driver (see ``estimator``).
"""

from horovod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
