"""``import horovod.jax as hvd``: Horovod for JAX (beyond upstream, which has no JAX frontend).

The collectives on ``jax.Array``s, eagerly and inside ``jax.jit`` (ordered host callbacks),
differentiable as upstream's other frontends; ``allreduce_gradients`` and
``broadcast_parameters`` for pytrees; ``DistributedOptimizer`` wrapping an optax
``GradientTransformation``; and the basics, join, barrier, object collectives and process sets
of ``horovod.frontend`` (these run eagerly, outside ``jit``).

Must not touch: the engine (it uses ``horovod.frontend``).
"""

from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend import (
    Adasum,
    add_process_set,
    allgather_object,
    barrier,
    broadcast_object,
    comm_process_set_id,
    cross_rank,
    cross_size,
    get_process_set_ids_and_ranks,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.jax.mpi_ops import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
    reducescatter,
)
from horovod.jax.optimizer import DistributedOptimizer, allreduce_gradients, broadcast_parameters

__all__ = [
    "Adasum",
    "Average",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "comm_process_set_id",
    "get_process_set_ids_and_ranks",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "grouped_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
