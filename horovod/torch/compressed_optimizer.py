"""``DistributedOptimizer(..., compression=hvd.Compression.int8 / topk(r) / powersgd(r))`` for
PyTorch: gradients exchanged through a lossy compressor with error feedback
(``horovod.frontend.lossy``).

These compressors run their own exchange over all of a step's gradients (PowerSGD needs every
matrix's P before any Q), so the exchange happens at ``synchronize()`` (called by ``step()``),
not from gradient hooks: communication does not overlap the backward pass, and the bytes sent
are what shrinks. Gradients accumulated in ``.grad`` over several backward passes
(``backward_passes_per_step``) are exchanged once, at ``step()``, as upstream reduces the
accumulated gradient. Each optimizer gets its own compressor state (residuals per parameter
name); ``synchronize()`` then ``with skip_synchronize(): step()`` works as upstream (for
gradient clipping).

Must not touch: the hook-driven optimizer (``horovod.torch.optimizer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from horovod.frontend.process_sets import ProcessSet


class _CompressedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        names: dict[int, str],
        compressor: Any,
        op: int,
        process_set: ProcessSet,
    ) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._hvd_names = names
        self._hvd_compressor = compressor
        self._hvd_op = op
        self._hvd_synced = False
        self._hvd_skip = False
        self._hvd_set = process_set

    def synchronize(self) -> None:
        """Exchange this step's gradients (compressed) and write the result into ``.grad``."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        arrays = [p.grad.detach().to("cpu", torch.float32).numpy() for p in params]
        names = [self._hvd_names[id(p)] for p in params]
        out = self._hvd_compressor.reduce(
            arrays, names, self._hvd_op, self._hvd_set, name="DistributedOptimizer"
        )
        with torch.no_grad():
            for p, o in zip(params, out, strict=True):
                p.grad.copy_(torch.from_numpy(np.ascontiguousarray(o)).to(p.grad.dtype))
        self._hvd_synced = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._hvd_skip and not self._hvd_synced:
            self.synchronize()
        self._hvd_synced = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._hvd_synced = False
        super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


def compressed_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any,
    compressor: Any,
    op: int,
    process_set: ProcessSet,
) -> torch.optim.Optimizer:
    """``optimizer`` exchanging its gradients through ``compressor`` (a fresh copy of it)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is not None:
        names = {id(p): n for n, p in named_parameters}
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(
                f"named_parameters does not name parameter(s) {missing} of the optimizer"
            )
    else:
        names = {id(p): f"param.{i}" for i, p in enumerate(params)}
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_CompressedOptimizer.__dict__),
    )
    return cls(
        optimizer.param_groups,
        names,
        compressor.fresh(),
        op,
        process_set,
    )
