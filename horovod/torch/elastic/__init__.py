"""``horovod.torch.elastic``. This version provides ``ElasticSampler`` (usable without
elastic mode); ``run`` and ``TorchState`` arrive with elastic training.

Must not touch: the engine; the dataset (the sampler only chooses indices).
"""

from horovod.torch.elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
