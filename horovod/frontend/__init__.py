"""The framework-free API: every Horovod call on NumPy arrays (the layer under every framework).

``horovod.numpy`` exports it as is; framework packages adapt their tensors to arrays (zero-copy
views where the framework allows) and call the ``submit_*`` functions here, so argument checks,
naming, handles and error texts are written once. The parts, each a module:

- ``basics``: init/shutdown, rank and size, build flags, timeline;
- ``arguments``: checking arrays, process sets and reduce ops;
- ``naming``: the names ops are negotiated under, group ids, call sites;
- ``submission``: ``submit_*``, the express way, ``waited()``, blocking control ops;
- ``handles``: ``poll`` and ``synchronize``;
- ``collectives``: the NumPy API of every collective;
- ``objects``: object collectives; ``process_sets``: dynamic process sets;
- ``compression``: ``Compression.none/fp16/bf16``.

Must not touch: framework tensors (frameworks convert before calling), the engine's internals
(it submits entries and calls ``Engine.express``), the launcher.
"""

from horovod.common.exceptions import HorovodInternalError
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core.express import NOT_EXPRESS
from horovod.core.messages import ALLGATHER, ALLREDUCE, BROADCAST
from horovod.frontend.arguments import (
    REDUCE_OPS,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    as_array,
    check_writable,
    require_context,
    resolve_op,
    resolve_set,
)
from horovod.frontend.basics import (
    BASICS,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    device_code,
    device_paths,
    device_standin,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    use_device_plane,
)
from horovod.frontend.collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    reducescatter,
    reducescatter_async,
)
from horovod.frontend.collectives import exchange_reduce as exchange_reduce  # (frameworks)
from horovod.frontend.compression import Compression, Compressor, NoneCompressor
from horovod.frontend.handles import poll, synchronize
from horovod.frontend.objects import allgather_object, broadcast_object
from horovod.frontend.process_sets import (
    add_process_set,
    comm_process_set_id,
    get_process_set_ids_and_ranks,
    remove_process_set,
)
from horovod.frontend.submission import (
    Alloc,
    express,
    express_allreduce,
    submit_allgather,
    submit_allreduce,
    submit_allreduce_batch,
    submit_alltoall,
    submit_broadcast,
    submit_reducescatter,
    waited,
)

# Besides ``__all__`` (horovod.numpy's API), framework packages use the building blocks above:
# ``submit_*``, ``express``/``express_allreduce``/``NOT_EXPRESS``, ``waited``, the checks of
# ``arguments`` and the op codes.

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "cross_size",
    "cross_rank",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compression",
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "broadcast_object",
    "allgather_object",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "comm_process_set_id",
    "get_process_set_ids_and_ranks",
    "remove_process_set",
    "HorovodInternalError",
]
