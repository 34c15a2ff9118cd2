"""``horovod.ray``: Horovod jobs whose ranks are Ray actors, on the Ray cluster a user already has
(upstream's ``RayExecutor``; docs/ray.md).

Importing it imports Ray, never a training framework: a rank's frameworks are imported by the
user's function inside the actors (ray #32332).

Must not touch: the training runtime (see ``horovod.ray.runner``).
"""

from horovod.ray.elastic import ElasticRayExecutor, RayHostDiscovery
from horovod.ray.runner import MiniSettings, RayExecutor
from horovod.ray.worker import BaseHorovodWorker

__all__ = [
    "BaseHorovodWorker",
    "ElasticRayExecutor",
    "MiniSettings",
    "RayExecutor",
    "RayHostDiscovery",
]
