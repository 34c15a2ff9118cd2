"""``import horovod.keras as hvd``: Horovod for standalone Keras 3 on any installed backend
(tensorflow, torch, jax).

With the TensorFlow backend everything is ``horovod.tensorflow.keras`` (graph-capable). With the
JAX backend gradients are reduced by ``horovod.jax`` in the optimizer's ``apply``, inside Keras's
jit-compiled train step too (ordered host callbacks). With torch they are reduced through NumPy
in ``apply``, which Keras's torch trainer runs eagerly.

Must not touch: TensorFlow unless Keras runs on it; the engine (everything goes through
``horovod.frontend``).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

import keras
import numpy as np

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core.messages import ADASUM_OP as Adasum
from horovod.core.messages import AVERAGE as Average
from horovod.core.messages import SUM as Sum
from horovod.frontend import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.keras import callbacks, elastic
from horovod.keras_common.local import local_weights

BACKEND = keras.backend.backend()


class _Compression:
    """Compression for the NumPy path (``Compression.fp16`` sends float16)."""

    none = F.Compression.none
    fp16 = F.Compression.fp16
    bf16 = F.Compression.bf16
    int8 = F.Compression.int8
    topk = F.Compression.topk
    powersgd = F.Compression.powersgd


Compression: Any = _Compression
if BACKEND == "tensorflow":
    from horovod.tensorflow.compression import Compression  # noqa: F811


def _contiguous(value: Any) -> np.ndarray:
    a = np.asarray(value)  # (np.ascontiguousarray would turn a scalar into shape (1,))
    return a if a.flags.c_contiguous else a.copy()


def _reduce_numpy(
    grads: list[Any], cfg: dict[str, Any], local: AbstractSet[int] = frozenset()
) -> list[Any]:
    """``grads`` reduced over the process set, but those at the indices ``local`` (gradients of
    variables registered local), which are only divided by the set's size (upstream's
    ``scale_local_gradients``)."""
    ps: ProcessSet = cfg["process_set"]
    if not ps.included() or ps.size() == 1:
        return grads
    out = list(grads)
    if cfg["scale_local"]:
        for i in local:
            if grads[i] is not None:
                out[i] = grads[i] / ps.size()
    idx = [i for i, g in enumerate(grads) if g is not None and i not in local]
    arrays = [_contiguous(keras.ops.convert_to_numpy(grads[i])) for i in idx]
    pre, post = 1.0, 1.0
    if cfg["op"] == Average and cfg["predivide"] != 1.0:
        pre, post = 1.0 / cfg["predivide"], cfg["predivide"]
    if getattr(cfg["compression"], "exchange", False):  # int8 / top-k / PowerSGD
        outs = F.exchange_reduce(
            cfg["compression"],
            arrays,
            f"{cfg['name']}.grads",
            cfg["op"],
            None,
            pre,
            post,
            ps,
            "grouped_allreduce",
        )
        for i, value in zip(idx, outs, strict=True):
            out[i] = keras.ops.convert_to_tensor(value, dtype=grads[i].dtype)
        return out
    packed = [cfg["compression"].compress(a) for a in arrays]
    reduced = F.grouped_allreduce(
        [p[0] for p in packed],
        op=cfg["op"],
        prescale_factor=pre,
        postscale_factor=post,
        process_set=ps,
        name=f"{cfg['name']}.grads",
    )
    for i, r, p in zip(idx, reduced, packed, strict=True):
        value = cfg["compression"].decompress(r, p[1])
        out[i] = keras.ops.convert_to_tensor(value, dtype=grads[i].dtype)
    return out


def _reduce_jax(grads: list[Any], cfg: dict[str, Any], local: AbstractSet[int]) -> list[Any]:
    """``_reduce_numpy`` for the JAX backend: ``horovod.jax``'s grouped allreduce, which works
    on traced arrays (Keras's jit-compiled train step) as well as eagerly."""
    import jax.numpy as jnp

    from horovod.jax.mpi_ops import grouped_allreduce

    ps: ProcessSet = cfg["process_set"]
    if not ps.included() or ps.size() == 1:
        return grads
    out = list(grads)
    if cfg["scale_local"]:
        for i in local:
            if grads[i] is not None:
                out[i] = grads[i] / ps.size()
    idx = [i for i, g in enumerate(grads) if g is not None and i not in local]
    wire = {_Compression.fp16: jnp.float16, _Compression.bf16: jnp.bfloat16}.get(cfg["compression"])
    sent = [grads[i].astype(wire) if wire is not None else grads[i] for i in idx]
    pre, post = 1.0, 1.0
    if cfg["op"] == Average and cfg["predivide"] != 1.0:
        pre, post = 1.0 / cfg["predivide"], cfg["predivide"]
    reduced = grouped_allreduce(
        sent,
        op=cfg["op"],
        prescale_factor=pre,
        postscale_factor=post,
        process_set=ps,
        name=f"{cfg['name']}.grads",
    )
    for i, r in zip(idx, reduced, strict=True):
        out[i] = r.astype(grads[i].dtype)
    return out


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    local: set[int] = set()
    if self._hvd_local:
        variables = list(
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        local = {i for i, v in enumerate(variables) if id(v) in self._hvd_local}
    reduce = _reduce_jax if BACKEND == "jax" else _reduce_numpy
    grads = reduce(list(grads), self._hvd_cfg, local)
    return self._hvd_base.apply(self, grads, trainable_variables)


def _register_local_var(self: Any, var: Any) -> None:
    """Keep ``var``'s gradient local (only divided by the number of ranks when
    ``scale_local_gradients``)."""
    self._hvd_local.add(id(var))


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A copy of ``optimizer`` (same class name and config) that averages (``op=Sum``: sums)
    gradients over the ranks before applying them."""
    if BACKEND == "tensorflow":
        from horovod.tensorflow.keras import DistributedOptimizer as TFDistributedOptimizer

        return TFDistributedOptimizer(
            optimizer,
            name=name,
            compression=compression or Compression.none,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            op=op,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
    if op not in (Average, Sum, Adasum):
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    base = optimizer.__class__
    cls: Any = type(
        base.__name__,
        (base,),
        {
            "apply": _apply,
            "register_local_var": _register_local_var,
            "_hvd_base": base,
            # saved models record these: loadable without Horovod
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )
    new = cls.from_config(optimizer.get_config())
    if BACKEND == "jax" and getattr(compression, "exchange", False):
        raise ValueError(
            "horovod.keras on the JAX backend: the lossy compressors (int8, topk, powersgd) "
            "run their exchange in Python, outside the compiled train step; use "
            "Compression.fp16/bf16 here, or the TensorFlow or PyTorch backend"
        )
    if hasattr(compression, "fresh"):
        compression = compression.fresh()  # error-feedback state of this optimizer only
    new._hvd_cfg = {
        "compression": compression or _Compression.none,
        "op": op,
        "predivide": gradient_predivide_factor,
        "process_set": process_set,
        "name": name or f"Distributed{base.__name__}",
        "scale_local": scale_local_gradients,
    }
    new._hvd_local = set()
    return new


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
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
    """``DistributedOptimizer`` whose gradients of ``local_layers`` (Keras layers) stay
    local: every other gradient is reduced over the ranks."""
    weights = local_weights(local_layers, keras.layers.Layer, "keras.layers.Layer")
    if backward_passes_per_step != 1:
        raise ValueError(
            "backward_passes_per_step: use Keras's own gradient_accumulation_steps with "
            "horovod.keras (or horovod.tensorflow.keras on the TensorFlow backend)"
        )
    opt = DistributedOptimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for var in weights:
        opt.register_local_var(var)
    return opt


def broadcast_variables(variables: Any, root_rank: int, name: str | None = None) -> None:
    """Assign ``root_rank``'s values to the Keras variables (eagerly)."""
    vs = list(variables)
    prefix = name or "broadcast_variables"
    handles = [
        F.broadcast_async(
            # (``numpy()``: converting the Variable object goes through an __array__ that
            # NumPy 2 warns about)
            _contiguous(
                np.asarray(v.numpy()) if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v)
            ),
            root_rank,
            name=f"{prefix}.{i}.{v.path if hasattr(v, 'path') else v.name}",
        )
        for i, v in enumerate(vs)
    ]
    for v, h in zip(vs, handles, strict=True):
        v.assign(F.synchronize(h))


def broadcast_global_variables(root_rank: int) -> None:
    raise RuntimeError(
        "Keras 3 keeps no global variable collection: use "
        "hvd.broadcast_variables(model.variables, root_rank) or "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)"
    )


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool = True,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: Any = None,
) -> np.ndarray:
    """Eager helper (upstream's default here is ``average=True``): a NumPy array."""
    return F.allreduce(
        np.asarray(keras.ops.convert_to_numpy(value)),
        average=None if op is not None else average,
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    return F.allgather(np.asarray(keras.ops.convert_to_numpy(value)), name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    return F.broadcast(np.asarray(keras.ops.convert_to_numpy(value)), root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> np.ndarray:
    return F.reducescatter(np.asarray(keras.ops.convert_to_numpy(value)), name=name, op=op)


def load_model(
    filepath: str,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = None,
) -> Any:
    """Load a model; its optimizer comes back wrapped in a DistributedOptimizer."""
    model = keras.models.load_model(filepath, custom_objects=custom_objects)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model


__all__ = [
    "elastic",
    "Adasum",
    "Average",
    "BACKEND",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "Sum",
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
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
