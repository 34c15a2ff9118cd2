"""``hvd.LocalSGD(variables, sync_every=H)`` and ``hvd.DiLoCo(variables, ...)`` for TensorFlow
custom training loops: apply your optimizer's update on each rank's own gradients, then call
``step()``; every H-th call averages the variables over the ranks (DiLoCo: with an outer
Nesterov step on the averaged change). For ``model.fit``, use
``horovod.tensorflow.keras.callbacks.LocalSGDCallback``/``DiLoCoCallback``. The rule and its
numerics: ``horovod.frontend.local_sgd``. Eager only (``step()`` runs Python).

Must not touch: the gradient tape and the optimizers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend.local_sgd import Periodic


class LocalSGD:
    """Average ``variables`` (``tf.Variable``s) over the ranks every ``sync_every`` steps."""

    _what = "LocalSGD"

    def __init__(
        self,
        variables: Iterable[Any],
        sync_every: int,
        process_set: ProcessSet = global_process_set,
        adaptive: bool = False,
        **outer: Any,
    ) -> None:
        self.variables = list(variables)
        for i, v in enumerate(self.variables):
            if not hasattr(v, "assign") or not v.dtype.is_floating:
                raise TypeError(
                    f"{self._what}: variable {i} must be a floating-point tf.Variable, got "
                    f"{type(v).__name__}"
                )
        self.core = Periodic(
            sync_every,
            process_set=process_set,
            name=self._what.lower(),
            what=self._what,
            adaptive=adaptive,
            **outer,
        )

    def _arrays(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self.variables]

    def step(self, loss: Any = None) -> bool:
        """One local step was applied (``loss``: its training loss, for ``adaptive``); True
        if the variables were synced now."""
        if loss is not None:
            self.core.report_loss(float(loss))
        if not self.core.count_step():
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average the variables over the ranks now (DiLoCo: and take the outer step)."""
        arrays = self._arrays()
        self.core.sync(arrays)
        for v, a in zip(self.variables, arrays, strict=True):
            v.assign(a)


class DiLoCo(LocalSGD):
    """DiLoCo over ``variables``: create it once they are the same on every rank
    (``hvd.broadcast_variables``); their values then are the outer (global) parameters."""

    _what = "DiLoCo"

    def __init__(
        self,
        variables: Iterable[Any],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        process_set: ProcessSet = global_process_set,
        adaptive: bool = False,
    ) -> None:
        super().__init__(
            variables,
            sync_every,
            process_set,
            adaptive,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
        )
        self.core.before_step(self._arrays())
