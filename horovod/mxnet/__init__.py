"""``import horovod.mxnet as hvd``: Horovod for MXNet 1.9 (upstream's ``horovod.mxnet``).

The collectives on ``mx.nd.NDArray`` (``mpi_ops``), ``DistributedOptimizer``,
``DistributedTrainer``, ``broadcast_parameters`` and ``Compression`` (``functions``), and the
basics, join, barrier, object collectives and process sets of ``horovod.frontend``. MXNet
1.9.1, its last release, needs NumPy < 1.24: it is tested in an environment of its own
(``.venv-mxnet``, made by ``.ci/setup``).

Must not touch: the engine (it uses ``horovod.frontend``).
"""

try:
    import mxnet  # noqa: F401
except ImportError as e:  # say what to install
    raise ImportError(
        "horovod.mxnet needs MXNet: pip install mxnet==1.9.1 numpy==1.23.5 (MXNet 1.9.1, its "
        "last release, needs NumPy < 1.24: give it a virtual environment of its own)"
    ) from e

from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend import (
    add_process_set,
    allgather_object,
    barrier,
    broadcast_object,
    comm_process_set_id,
    cross_rank,
    cross_size,
    get_process_set_ids_and_ranks,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    nccl_built,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.mxnet.functions import (
    Compression,
    DistributedOptimizer,
    DistributedTrainer,
    broadcast_parameters,
)
from horovod.mxnet.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedTrainer",
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
    "allreduce_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
