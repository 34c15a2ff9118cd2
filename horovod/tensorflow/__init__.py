"""``import horovod.tensorflow as hvd``: upstream Horovod's TensorFlow 2 API on pyhorovod's
engine. Every collective works eagerly and inside ``tf.function``, with gradients.

Must not touch: the engine (everything goes through ``horovod.frontend``), standalone Keras.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core.messages import ADASUM_OP as Adasum
from horovod.core.messages import MAX as Max
from horovod.core.messages import MIN as Min
from horovod.core.messages import PRODUCT as Product
from horovod.frontend import (
    add_process_set,
    ccl_built,
    comm_process_set_id,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    get_process_set_ids_and_ranks,
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
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.keras_common.local import local_weights
from horovod.tensorflow import elastic, util
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.local_sgd import DiLoCo, LocalSGD
from horovod.tensorflow.mpi_ops import (
    Average,
    Sum,
    _executing_eagerly,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from horovod.tensorflow.mpi_ops import (
    reduce_gradients as _reduce_gradients,
)
from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization


def broadcast_global_variables(root_rank: int) -> Any:
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class _DistributedGradientTape:
    """Methods grafted onto a subclass of the user's tape class (so ``isinstance(tape,
    tf.GradientTape)`` still holds): ``gradient`` returns gradients reduced over the ranks."""

    _hvd_base: Any  # the user's tape class, set on the grafted subclass

    def _hvd_setup(
        self,
        compression: Any,
        sparse_as_dense: bool,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        process_set: ProcessSet,
        scale_local_gradients: bool,
    ) -> None:
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if op not in (Average, Sum, Adasum):
            raise ValueError("op must be Average, Sum or Adasum")
        # (a lossy compressor keeps error-feedback state: one copy per tape)
        self._hvd_compression = (
            compression.fresh() if hasattr(compression, "fresh") else compression
        )
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_groups = groups
        self._hvd_process_set = process_set
        self._hvd_scale_local = scale_local_gradients
        self._hvd_local_sources: set[int] = set()

    def register_local_source(self, source: tf.Variable) -> None:
        """Gradients of ``source`` stay local (not reduced; divided by the set size when
        ``scale_local_gradients``)."""
        self._hvd_local_sources.add(id(source))

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
        **kwargs: Any,
    ) -> Any:
        grads = self._hvd_base.gradient(self, target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._hvd_reduce(flat_sources, flat_grads, use_generic_names)
        return tf.nest.pack_sequence_as(grads, reduced)

    def _hvd_reduce(self, sources: list[Any], grads: list[Any], generic: bool) -> list[Any]:
        return _reduce_gradients(
            sources,
            grads,
            op=self._hvd_op,
            compression=self._hvd_compression,
            predivide=self._hvd_predivide,
            sparse_as_dense=self._hvd_sparse_as_dense,
            process_set=self._hvd_process_set,
            local_ids=self._hvd_local_sources,
            scale_local=self._hvd_scale_local,
            name=None if generic else "DistributedGradientTape",
        )


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op``) gradients over the ranks."""
    base = gradtape.__class__
    cls = type(
        base.__name__,
        (base,),
        {k: v for k, v in _DistributedGradientTape.__dict__.items() if not k.startswith("__")}
        | {"_hvd_base": base},
    )
    tape: Any = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_setup(
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        groups,
        process_set,
        scale_local_gradients,
    )
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Sequence[Any] | None = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """As DistributedGradientTape; the trainable weights of ``local_layers`` stay local."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for w in local_weights(local_layers, tf.keras.layers.Layer, "tf.keras.layers.Layer"):
        tape.register_local_source(w)  # type: ignore[attr-defined]
    return tape


class _DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` returns gradients reduced
    over the ranks; everything else is the wrapped optimizer's."""

    def __init__(
        self,
        optimizer: Any,
        name: str | None,
        use_locking: bool,
        compression: Any,
        sparse_as_dense: bool,
        op: int,
        gradient_predivide_factor: float,
        process_set: ProcessSet,
        scale_local_gradients: bool,
    ) -> None:
        super().__init__(
            name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking
        )
        self._optimizer = optimizer
        self._hvd = dict(
            op=op,
            compression=compression,
            predivide=gradient_predivide_factor,
            sparse_as_dense=sparse_as_dense,
            process_set=process_set,
            scale_local=scale_local_gradients,
        )
        self._local_ids: set[int] = set()

    def register_local_var(self, var: Any) -> None:
        """``var``'s gradient stays local (divided by the set size when scale_local_gradients)."""
        self._local_ids.add(id(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        variables = [v for _, v in pairs]
        grads = _reduce_gradients(
            variables,
            [g for g, _ in pairs],
            local_ids=self._local_ids,
            name=f"{self.get_name()}.grads",
            **self._hvd,  # type: ignore[arg-type]
        )
        return list(zip(grads, variables, strict=True))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wrap a ``tf.compat.v1.train.Optimizer`` (gradients reduced in ``compute_gradients``) or a
    Keras optimizer (see ``horovod.tensorflow.keras.DistributedOptimizer``)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is supported for Keras optimizers only"
            )
        return _DistributedOptimizerV1(
            optimizer,
            name,
            use_locking,
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            process_set,
            scale_local_gradients,
        )
    from horovod.tensorflow.keras import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 sessions: broadcast every global variable from ``root_rank`` once the session is
    created (or its variables restored from a checkpoint)."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


__all__ = [
    "DiLoCo",
    "LocalSGD",
    "elastic",
    "util",
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "LocalGradientAggregationHelper",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "_executing_eagerly",
    "add_process_set",
    "comm_process_set_id",
    "get_process_set_ids_and_ranks",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]
