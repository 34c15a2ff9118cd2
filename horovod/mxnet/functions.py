"""MXNet training helpers (upstream's): ``DistributedOptimizer`` (an ``mx.optimizer`` whose
updates use gradients summed over the ranks, the average coming from ``rescale_grad``),
``DistributedTrainer`` (a gluon ``Trainer`` that reduces through Horovod instead of a
kvstore), ``broadcast_parameters`` (dicts and gluon ``ParameterDict``s, deferred initialization
included) and ``Compression``.

Must not touch: the engine (it uses the collectives of ``mpi_ops``).
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import mxnet as mx
import numpy as np

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.mxnet.mpi_ops import allreduce_, broadcast_, grouped_allreduce_


class _NoneCompressor:
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class _FP16Compressor:
    """Floating gradients travel as float16."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if np.dtype(tensor.dtype).kind == "f":
            return tensor.astype("float16"), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """Gradient compression for transport: ``none`` and ``fp16`` (upstream's)."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


def _size(process_set: ProcessSet) -> int:
    n = process_set.size() if process_set is not global_process_set else F.size()
    assert n is not None
    return n


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: ``update`` first sums the gradient over the ranks
    (``rescale_grad`` is divided by their number, which averages it)."""

    def __init__(
        self,
        optimizer: Any,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        if gradient_predivide_factor <= 0:
            raise ValueError(
                f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}"
            )
        self._optimizer = optimizer
        # The sum over the ranks is averaged by the inner optimizer's rescale_grad.
        self._rescale = gradient_predivide_factor / _size(process_set)
        self._optimizer.rescale_grad *= self._rescale
        self._predivide = gradient_predivide_factor
        self._num_groups = num_groups
        self._process_set = process_set

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)

    @property
    def rescale_grad(self) -> float:
        return self._optimizer.rescale_grad / self._rescale

    @rescale_grad.setter
    def rescale_grad(self, value: float) -> None:
        # (gluon's Trainer sets it every step: 1 / batch size) the inner optimizer's, averaged
        self._optimizer.rescale_grad = value * self._rescale

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        if _size(self._process_set) == 1:
            return
        kw = dict(op=F.Sum, prescale_factor=1.0 / self._predivide, process_set=self._process_set)
        if isinstance(index, (tuple, list)):
            if self._num_groups > 0:
                grouped_allreduce_(list(grad), name=f"grouped.{index[0]}", **kw)  # type: ignore[arg-type]
            else:
                for i, g in zip(index, grad, strict=True):
                    allreduce_(g, name=str(i), **kw)  # type: ignore[arg-type]
        else:
            allreduce_(grad, name=str(index), **kw)  # type: ignore[arg-type]

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: Any) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Any) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon ``Trainer`` that sums gradients over the ranks with Horovod (no kvstore); the
    average comes from the trainer's scale, divided by the number of ranks."""

    def __init__(
        self,
        params: Any,
        optimizer: Any,
        optimizer_params: Any = None,
        compression: Any = Compression.none,
        gradient_predivide_factor: float = 1.0,
        prefix: str | None = None,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn(
                "DistributedTrainer does not take a DistributedOptimizer as its optimizer: "
                "it was unwrapped",
                stacklevel=2,
            )
        if isinstance(params, mx.gluon.ParameterDict):
            params = [params[key] for key in sorted(params.keys())]
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._scale *= gradient_predivide_factor / _size(process_set)
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_compression = compression
        self._hvd_prefix = prefix or ""
        self._hvd_num_groups = num_groups
        self._hvd_process_set = process_set

    def _allreduce_grads(self) -> None:
        if _size(self._hvd_process_set) == 1:
            return
        kw = dict(
            op=F.Sum,
            prescale_factor=1.0 / self._hvd_predivide,
            process_set=self._hvd_process_set,
        )
        live = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        packed = [self._hvd_compression.compress(p.list_grad()[0]) for _, p in live]
        if self._hvd_num_groups > 0:
            grouped_allreduce_([t for t, _ in packed], name=f"{self._hvd_prefix}grouped", **kw)  # type: ignore[arg-type]
        else:
            for (i, _), (t, _) in zip(live, packed, strict=True):
                allreduce_(t, name=f"{self._hvd_prefix}{i}", **kw)  # type: ignore[arg-type]
        for (_, p), (t, ctx) in zip(live, packed, strict=True):
            if ctx is not None:
                p.list_grad()[0][:] = self._hvd_compression.decompress(t, ctx)


def _broadcast_after_init(param: Any, root_rank: int, name: str) -> Any:
    """``param._init_impl`` that broadcasts once the deferred initialization has run."""
    original = param._init_impl

    def init_then_broadcast(self: Any, *args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        broadcast_(self.data(), root_rank, name=name)
        self.data().wait_to_read()

    return types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None) -> None:
    """Overwrite ``params`` (a dict of NDArrays, or a gluon ``ParameterDict``) with
    ``root_rank``'s values, in place, in sorted key order. A gluon parameter whose shape is not
    known yet (deferred initialization) is broadcast when it is initialized."""
    prefix = prefix or ""
    if isinstance(params, dict):
        tensors = [(k, v) for k, v in sorted(params.items())]
    elif isinstance(params, mx.gluon.ParameterDict):
        tensors = []
        for key, p in sorted(params.items()):
            try:
                tensors.append((key, p.data()))
            except mx.gluon.parameter.DeferredInitializationError:
                p._init_impl = _broadcast_after_init(p, root_rank, f"{prefix}{key}")
    else:
        raise ValueError(
            f"broadcast_parameters: invalid params of type {type(params).__name__}; pass a dict "
            "of NDArrays or a gluon ParameterDict (net.collect_params())"
        )
    for key, tensor in tensors:
        broadcast_(tensor, root_rank, name=f"{prefix}{key}")
