"""``DistributedOptimizer(..., op=hvd.Adasum)`` for PyTorch: upstream's "delta" optimizer.

Adasum is applied to what the optimizer would change, not to the gradients: at ``step()``
each rank runs the wrapped optimizer on its own gradients, takes every parameter's change
(``after - before``), combines the changes of all ranks with an Adasum allreduce (per parameter,
``horovod.collectives.adasum``) and sets each parameter to ``before + combined change``. With
plain SGD this equals applying Adasum to the gradients; with Adam or momentum it is what
upstream does (the optimizer's state stays each rank's own). Recommended learning rate: the
single-worker one, not scaled by the number of ranks.

Differences from upstream, on purpose: the changes are combined in one grouped allreduce at
``step()`` (upstream starts one per parameter from its gradient hook, which only overlaps with
the local steps of other parameters); any process set is allowed.

Must not touch: the gradient-averaging optimizer (``horovod.torch.optimizer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from horovod.frontend.arguments import Adasum
from horovod.frontend.process_sets import ProcessSet
from horovod.torch.allreduce_ops import grouped_allreduce


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    def __init__(
        self, params: Any, compression: Any, process_set: ProcessSet, name: str = "adasum"
    ) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._compression = compression
        self._process_set = process_set
        self._adasum_name = name
        self._adasum_steps = 0

    def synchronize(self) -> None:
        """Nothing to wait for: the ranks' changes are combined inside ``step()``."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "skip_synchronize() does not apply with op=hvd.Adasum: step() combines the ranks' "
            "parameter changes itself"
        )
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        params = [
            p
            for g in self.param_groups
            for p in g["params"]
            if p.requires_grad and p.grad is not None
        ]
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        loss = super(self.__class__, self).step(closure)  # type: ignore[misc]
        if not params:
            return loss
        with torch.no_grad():
            deltas = [p.detach() - b for p, b in zip(params, before, strict=True)]
            combined = grouped_allreduce(
                deltas,
                name=f"{self._adasum_name}.delta",
                compression=self._compression,
                op=Adasum,
                process_set=self._process_set,
            )
            for p, b, d in zip(params, before, combined, strict=True):
                p.copy_(b + d.to(p.dtype))
        self._adasum_steps += 1
        return loss


def adasum_optimizer(
    optimizer: torch.optim.Optimizer, compression: Any, process_set: ProcessSet
) -> torch.optim.Optimizer:
    """``optimizer`` as an Adasum delta optimizer: an object of a subclass of its own class."""
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_DistributedAdasumOptimizer.__dict__),
    )
    return cls(optimizer.param_groups, compression, process_set)
