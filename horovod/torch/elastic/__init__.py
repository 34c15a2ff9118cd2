"""``horovod.torch.elastic``: ``run``, ``TorchState`` and ``ElasticSampler`` (upstream's names),
plus the framework-free ``State`` and ``ObjectState``.

Must not touch: the engine; the dataset (the sampler only chooses indices).
"""

from horovod.elastic import ObjectState, State, run
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
