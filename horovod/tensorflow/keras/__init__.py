"""``import horovod.tensorflow.keras as hvd``: Horovod for ``tf.keras`` (Keras 3 with the
TensorFlow backend, or Keras 2 through tf-keras when ``TF_USE_LEGACY_KERAS=1``).

Must not touch: standalone Keras when tf.keras is Keras 2; the engine (it uses
``horovod.frontend``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend import (
    add_process_set,
    comm_process_set_id,
    cross_rank,
    cross_size,
    get_process_set_ids_and_ranks,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.keras_common.local import local_weights
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from horovod.tensorflow.keras import callbacks, elastic, xla_split
from horovod.tensorflow.mpi_ops import Adasum, Average, Sum


def _keras() -> Any:
    return tf.keras


class _DistributedMixin:
    """Grafted onto a subclass of the user's optimizer class: gradients are reduced over the
    ranks before the wrapped optimizer applies them. The subclass keeps the class name, so a
    saved model loads without Horovod."""

    _hvd_cfg: dict[str, Any]  # set on each wrapped optimizer
    _hvd_local: set[int]  # ids of the variables registered local

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced over the ranks, only divided by their
        number when ``scale_local_gradients`` (upstream's default)."""
        self._hvd_local.add(id(var))

    def _hvd_reduce(self, grads: list[Any], variables: list[Any] | None = None) -> list[Any]:
        cfg = self._hvd_cfg
        if self._hvd_local and variables is None:
            variables = list(getattr(self, "_trainable_variables", None) or [])
            if len(variables) != len(grads):
                raise ValueError(
                    "register_local_var: cannot tell which gradient belongs to which variable; "
                    "pass the variables along with the gradients"
                )
        return mpi_ops.reduce_gradients(
            list(variables) if variables is not None else [None] * len(grads),
            grads,
            op=cfg["op"],
            compression=cfg["compression"],
            predivide=cfg["predivide"],
            sparse_as_dense=cfg["sparse_as_dense"],
            process_set=cfg["process_set"],
            local_ids=self._hvd_local,
            scale_local=cfg["scale_local"],
            name=f"{cfg['name']}.grads",
            postscale=cfg["aggregate_scale"],
        )


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:  # Keras 3
    variables = None if trainable_variables is None else list(trainable_variables)
    grads = self._hvd_reduce(list(grads), variables)
    return self._hvd_base.apply(self, grads, trainable_variables)


def _update_step(self: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
    # Keras 3 gradient accumulation: called on update steps only, with the accumulated grads
    grads = self._hvd_reduce(list(grads), list(trainable_variables))
    return self._hvd_base._backend_update_step(self, grads, trainable_variables, learning_rate)


def _apply_gradients_aggregated(
    self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any
) -> Any:  # Keras 2 with backward_passes_per_step > 1
    pairs = list(grads_and_vars)
    variables = [v for _, v in pairs]
    grads = self._hvd_agg.compute_gradients([g for g, _ in pairs], variables)
    # slot variables must exist before the update is put under a tf.cond
    if hasattr(self, "build") and not getattr(self, "_built", True):
        self.build(variables)
    elif hasattr(self, "_create_all_weights"):
        self._create_all_weights(variables)

    def apply() -> Any:
        return self._hvd_base.apply_gradients(
            self,
            [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None],
            *args,
            **kwargs,
        )

    return self._hvd_agg.apply_gradients(apply)


def _compute_gradients(
    self: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
) -> Any:  # Keras 2: upstream's override (``minimize`` calls it); the local gradients
    # (reduced once, in ``apply_gradients``)
    return self._hvd_base._compute_gradients(self, loss, var_list, grad_loss=grad_loss, tape=tape)


def _apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:  # Keras 2
    pairs = list(grads_and_vars)
    grads = self._hvd_reduce([g for g, _ in pairs], [v for _, v in pairs])
    return self._hvd_base.apply_gradients(
        self, list(zip(grads, [v for _, v in pairs], strict=True)), *args, **kwargs
    )


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A copy of ``optimizer`` (same class name and config) whose updates use gradients
    averaged (or summed, ``op=hvd.Sum``) over the ranks of ``process_set``."""
    if op not in (Average, Sum, Adasum):
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    base = optimizer.__class__
    keras3 = hasattr(base, "apply") and base.__module__.startswith("keras.")
    config = optimizer.get_config()
    aggregate_scale = 1.0
    if backward_passes_per_step > 1:
        if keras3:
            # Keras accumulates locally and averages; the reduction runs on update steps only.
            config["gradient_accumulation_steps"] = backward_passes_per_step
            if not average_aggregated_gradients:  # upstream's default: the sum of the passes
                aggregate_scale = float(backward_passes_per_step)
    methods: dict[str, Any] = {
        k: v for k, v in _DistributedMixin.__dict__.items() if not k.startswith("__")
    }
    methods["_hvd_base"] = base
    # Keras records module and class name when saving: make them the wrapped optimizer's, so
    # the saved model loads without Horovod (hvd.load_model wraps it again).
    methods["__module__"] = base.__module__
    methods["__qualname__"] = base.__qualname__
    if keras3 and backward_passes_per_step > 1:
        methods["_backend_update_step"] = _update_step
    elif keras3:
        methods["apply"] = _apply
        # under XLA (jit_compile), Keras's train step reduces outside the compiled parts
        xla_split.install()
    elif backward_passes_per_step > 1:
        methods["apply_gradients"] = _apply_gradients_aggregated
    else:
        methods["apply_gradients"] = _apply_gradients
    if not keras3 and hasattr(base, "_compute_gradients"):
        methods["_compute_gradients"] = _compute_gradients
    cls: Any = type(base.__name__, (base,), methods)
    new = cls.from_config(config)
    new._hvd_cfg = {
        # (a lossy compressor keeps error-feedback state: one copy per optimizer)
        "compression": compression.fresh() if hasattr(compression, "fresh") else compression,
        "sparse_as_dense": sparse_as_dense,
        "op": op,
        "predivide": gradient_predivide_factor,
        "process_set": process_set,
        "name": name or f"Distributed{base.__name__}",
        "aggregate_scale": aggregate_scale,
        "scale_local": scale_local_gradients,
    }
    new._hvd_local = set()
    # upstream's attribute: the helper that aggregates backward passes (Keras 2), else None
    new._agg_helper = None
    if not keras3 and backward_passes_per_step > 1:
        new._hvd_agg = new._agg_helper = LocalGradientAggregationHelper(
            backward_passes_per_step,
            new._hvd_reduce,
            sparse_as_dense=sparse_as_dense,
            average_aggregated_gradients=average_aggregated_gradients,
            process_set=process_set,
        )
    return new


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """``DistributedOptimizer`` whose gradients of ``local_layers`` (Keras layers) stay local:
    every other gradient is reduced over the ranks."""
    weights = local_weights(local_layers, _keras().layers.Layer, "tf.keras.layers.Layer")
    opt = DistributedOptimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for var in weights:
        opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank: int) -> Any:
    """Keras 3 keeps no global variable collection: broadcast a model's variables with
    ``broadcast_variables(model.variables, root_rank)`` or use
    ``callbacks.BroadcastGlobalVariablesCallback``."""
    raise RuntimeError(
        "broadcast_global_variables() needs TF1 global variables, which Keras 3 does not have; "
        "use hvd.broadcast_variables(model.variables, root_rank=0) or "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(0)"
    )


broadcast_variables = mpi_ops.broadcast_variables


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = Compression.none,
) -> Any:
    """Eager helper: the reduced value, as a NumPy array."""
    return np.asarray(
        mpi_ops.allreduce(
            tf.convert_to_tensor(value),
            average=average,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            name=name,
            compression=compression,
        )
    )


def allgather(value: Any, name: str | None = None) -> Any:
    return np.asarray(mpi_ops.allgather(tf.convert_to_tensor(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    return np.asarray(mpi_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    return np.asarray(mpi_ops.reducescatter(tf.convert_to_tensor(value), name=name, op=op))


def load_model(
    filepath: str,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """Load a model saved with a DistributedOptimizer; its optimizer comes back wrapped."""
    model = tf.keras.models.load_model(filepath, custom_objects=custom_objects, compile=True)
    if getattr(model, "optimizer", None) is not None:
        wrapped = DistributedOptimizer(model.optimizer, compression=compression)
        model.optimizer = wrapped
    return model


__all__ = [
    "elastic",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "comm_process_set_id",
    "get_process_set_ids_and_ranks",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_homogeneous",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "F",
]
