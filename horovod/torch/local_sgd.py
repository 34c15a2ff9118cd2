"""``hvd.LocalSGD(optimizer, sync_every=H)`` and ``hvd.DiLoCo(optimizer, sync_every=H, ...)``
for PyTorch: the wrapped optimizer steps on each rank's own gradients, and every H-th
``step()`` the parameters are averaged over the ranks (DiLoCo: with an outer Nesterov step on
the averaged change). The rule and its numerics: ``horovod.frontend.local_sgd``.

As ``DistributedOptimizer``, the result is an object of a subclass of the optimizer's own
class over the same parameter groups. Do not combine it with ``DistributedOptimizer`` (that
would average every step). Start from the same parameters on every rank
(``hvd.broadcast_parameters``); ``sync()`` averages at once (for example before evaluating).

CPU parameters are synced in place through NumPy views; others (CUDA, bfloat16) through a
host copy that is written back.

Must not touch: the gradient-averaging optimizer (``horovod.torch.optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend.local_sgd import Periodic


def _views(params: list[torch.Tensor]) -> tuple[list[np.ndarray], Callable[[], None]]:
    """NumPy arrays of ``params`` and a function writing them back (a no-op for views)."""
    arrays: list[np.ndarray] = []
    copies: list[tuple[torch.Tensor, np.ndarray]] = []
    for p in params:
        t = p.detach()
        if t.device.type == "cpu" and t.dtype != torch.bfloat16 and t.is_contiguous():
            arrays.append(t.numpy())
        else:
            a = t.to("cpu", torch.float32 if t.dtype == torch.bfloat16 else t.dtype).numpy()
            a = np.ascontiguousarray(a)
            arrays.append(a)
            copies.append((p, a))

    def write_back() -> None:
        with torch.no_grad():
            for p, a in copies:
                p.copy_(torch.from_numpy(a))

    return arrays, write_back


class _PeriodicOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, core: Periodic) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._hvd_periodic = core

    def _hvd_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def step(self, closure: Any = None) -> Any:
        core = self._hvd_periodic
        if core.outer_lr is not None and core.global_params is None:
            arrays, _ = _views(self._hvd_params())
            core.before_step(arrays)
        loss = super(self.__class__, self).step(closure)  # type: ignore[misc]
        if loss is not None and core.adaptive:
            core.report_loss(float(loss.detach() if hasattr(loss, "detach") else loss))
        if core.count_step():
            self.sync()
        return loss

    def report_loss(self, loss: Any) -> None:
        """This step's training loss (a number or a one-element tensor), for ``adaptive``;
        a ``step(closure)`` reports the closure's loss itself."""
        self._hvd_periodic.report_loss(float(loss.detach() if hasattr(loss, "detach") else loss))

    def sync(self) -> None:
        """Average the parameters over the ranks now (DiLoCo: and take the outer step)."""
        arrays, write_back = _views(self._hvd_params())
        self._hvd_periodic.sync(arrays)
        write_back()


def _wrap(optimizer: torch.optim.Optimizer, core: Periodic) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{core.what}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_PeriodicOptimizer.__dict__),
    )
    return cls(optimizer.param_groups, core)


def LocalSGD(  # noqa: N802 - a class-like factory, as DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    sync_every: int,
    process_set: ProcessSet = global_process_set,
    adaptive: bool = False,
) -> torch.optim.Optimizer:
    """``optimizer`` taking ``sync_every`` local steps between parameter averages
    (``adaptive``: fewer as the reported loss falls, ``horovod.frontend.local_sgd``)."""
    core = Periodic(sync_every, process_set=process_set, what="LocalSGD", adaptive=adaptive)
    return _wrap(optimizer, core)


def DiLoCo(  # noqa: N802
    optimizer: torch.optim.Optimizer,
    sync_every: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    process_set: ProcessSet = global_process_set,
    adaptive: bool = False,
) -> torch.optim.Optimizer:
    """``optimizer`` as DiLoCo's inner optimizer: ``sync_every`` local steps, then an outer
    Nesterov step (``outer_lr``, ``outer_momentum``) on the ranks' averaged change."""
    core = Periodic(
        sync_every,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        process_set=process_set,
        name="diloco",
        what="DiLoCo",
        adaptive=adaptive,
    )
    return _wrap(optimizer, core)
