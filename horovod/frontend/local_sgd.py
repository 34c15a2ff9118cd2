"""Local SGD and DiLoCo: communicate every ``sync_every`` steps instead of every step.

``Periodic`` is the framework-free part, on a list of NumPy arrays (the parameters, updated in
place); the frameworks wrap it (``horovod.torch.LocalSGD``/``DiLoCo``) and ``horovod.numpy``
exports it as ``LocalSGD``/``DiLoCo``.

- **Local SGD** (Stich, 2019; Lin et al., 2020): each rank takes ``sync_every`` optimizer steps
  on its own data, then the parameters are averaged over the ranks (one grouped allreduce).
- **DiLoCo** (Douillard et al., 2023): the same inner steps; at a sync, the *outer gradient* is
  the global parameters minus the ranks' average, and an outer SGD step with Nesterov momentum
  (``outer_lr``, ``outer_momentum``) moves the global parameters, which every rank then takes.
  With ``outer_lr=1`` and ``outer_momentum=0`` it is Local SGD.

**Adaptive period** (``adaptive=True``; AdaComm, Wang and Joshi, 2019): with losses reported
between syncs (``report_loss``), the period shrinks as the loss falls,
``H = max(1, ceil(sqrt(L / L0) * H0))``, where ``H0`` is ``sync_every``, ``L0`` the ranks'
average loss at the first sync and ``L`` at the latest: few syncs early, when the loss is high
and the models agree anyway; more as the loss approaches its floor. The loss travels in the
sync's own allreduce, so every rank picks the same next period.

Every rank computes the outer step from the same averaged values, so the ranks stay bitwise
identical after each sync. The global parameters are taken at the first step (after the user's
``broadcast_parameters``), and the outer momentum lives in float64 beside them.

Must not touch: the optimizers (the frameworks' wrappers call ``after_step``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend.arguments import Average
from horovod.frontend.collectives import grouped_allreduce_


def check_arguments(
    what: str, sync_every: int, outer_lr: float | None = None, outer_momentum: float = 0.0
) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"{what}: sync_every must be an int >= 1 (steps between syncs), got {sync_every!r}"
        )
    if outer_lr is not None and not (outer_lr > 0):
        raise ValueError(f"{what}: outer_lr must be > 0, got {outer_lr!r}")
    if not (0.0 <= outer_momentum < 1.0):
        raise ValueError(f"{what}: outer_momentum must be in [0, 1), got {outer_momentum!r}")


class Periodic:
    """Averaging (or DiLoCo's outer step) every ``sync_every`` calls of ``after_step``."""

    def __init__(
        self,
        sync_every: int,
        *,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
        nesterov: bool = True,
        process_set: ProcessSet = global_process_set,
        name: str = "local_sgd",
        what: str = "LocalSGD",
        adaptive: bool = False,
    ) -> None:
        check_arguments(what, sync_every, outer_lr, outer_momentum)
        self.what = what
        self.sync_every = sync_every
        self.initial_every = sync_every
        self.adaptive = adaptive
        self.since_sync = 0
        self.losses: list[float] = []
        self.first_loss: float | None = None
        self.periods: list[int] = [sync_every]  # the period chosen at each sync
        self.outer_lr = outer_lr  # None: plain averaging (Local SGD)
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.process_set = process_set
        self.name = name
        self.steps = 0
        self.syncs = 0
        self.global_params: list[np.ndarray] | None = None
        self.momentum: list[np.ndarray] | None = None

    def before_step(self, params: Sequence[np.ndarray]) -> None:
        """Call before the first local step: DiLoCo's global parameters start from them."""
        if self.outer_lr is not None and self.global_params is None:
            self.global_params = [np.array(p, dtype=np.float64) for p in params]
            self.momentum = [np.zeros(p.shape, np.float64) for p in params]

    def count_step(self) -> bool:
        """Count a local step; True when a sync is due now."""
        self.steps += 1
        self.since_sync += 1
        return self.since_sync >= self.sync_every

    def report_loss(self, value: float) -> None:
        """A training loss seen since the last sync (for ``adaptive``)."""
        v = float(value)
        if math.isfinite(v):
            self.losses.append(v)

    def after_step(self, params: Sequence[np.ndarray]) -> bool:
        """Count a local step; sync ``params`` (in place) when one is due. True if it synced."""
        if not self.count_step():
            return False
        self.sync(params)
        return True

    def _adapt(self, loss: np.ndarray) -> None:
        """AdaComm's next period from the ranks' average loss (module docstring)."""
        if loss[1] <= 0:
            return
        mean = float(loss[0] / loss[1])
        if self.first_loss is None:
            self.first_loss = mean
        elif self.first_loss > 0 and mean >= 0:
            ratio = math.sqrt(mean / self.first_loss)
            self.sync_every = max(1, min(self.initial_every, math.ceil(ratio * self.initial_every)))
        self.periods.append(self.sync_every)

    def sync(self, params: Sequence[np.ndarray]) -> None:
        """Average ``params`` over the ranks now (DiLoCo: and take the outer step)."""
        arrays = [p for p in params if p.size]
        self.since_sync = 0
        loss = None
        if self.adaptive:  # (loss sum, count) travel with the parameters
            loss = np.array([sum(self.losses), len(self.losses)], np.float64)
            self.losses.clear()
            arrays.append(loss)
        if not arrays:
            return
        grouped_allreduce_(
            arrays,
            op=Average,
            name=self.name,
            process_set=self.process_set,
        )
        self.syncs += 1
        if loss is not None:
            self._adapt(loss)
        if self.outer_lr is None:
            return
        if self.global_params is None:
            self.before_step(params)
            return
        assert self.momentum is not None
        mu, lr = self.outer_momentum, self.outer_lr
        for p, g, v in zip(params, self.global_params, self.momentum, strict=True):
            delta = g - p.astype(np.float64)  # the outer gradient
            v *= mu
            v += delta
            g -= lr * (delta + mu * v if self.nesterov else v)
            np.copyto(p, g, casting="unsafe")


class LocalSGD:
    """Local SGD on NumPy parameters (``horovod.numpy.LocalSGD``): update ``params`` in place
    with your own optimizer, then call ``step()``; every ``sync_every``-th call averages them
    over the ranks. ``sync()`` averages now (for example at the end of training)."""

    def __init__(
        self,
        params: Sequence[np.ndarray],
        sync_every: int,
        process_set: ProcessSet = global_process_set,
        adaptive: bool = False,
    ) -> None:
        self.params = _arrays(params, "LocalSGD")
        self.core = Periodic(
            sync_every, process_set=process_set, what="LocalSGD", adaptive=adaptive
        )

    def step(self, loss: float | None = None) -> bool:
        """One local step was taken (``loss``: its training loss, for ``adaptive``); True if
        the parameters were synced now."""
        if loss is not None:
            self.core.report_loss(loss)
        return self.core.after_step(self.params)

    def sync(self) -> None:
        self.core.sync(self.params)


class DiLoCo(LocalSGD):
    """DiLoCo on NumPy parameters (``horovod.numpy.DiLoCo``): as ``LocalSGD``, with an outer
    Nesterov step on the averaged change at each sync (module docstring). Create it after the
    parameters are the same on every rank (``broadcast_``)."""

    def __init__(
        self,
        params: Sequence[np.ndarray],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        process_set: ProcessSet = global_process_set,
        adaptive: bool = False,
    ) -> None:
        self.params = _arrays(params, "DiLoCo")
        self.core = Periodic(
            sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            process_set=process_set,
            name="diloco",
            what="DiLoCo",
            adaptive=adaptive,
        )
        self.core.before_step(self.params)


def _arrays(params: Sequence[np.ndarray], what: str) -> list[np.ndarray]:
    out = list(params.values()) if isinstance(params, dict) else list(params)
    for i, p in enumerate(out):
        if not isinstance(p, np.ndarray) or p.dtype.kind != "f" or not p.flags.writeable:
            raise TypeError(
                f"{what}: parameter {i} must be a writable floating-point NumPy array (updated "
                f"in place), got {type(p).__name__}"
                + (f" of {p.dtype}" if isinstance(p, np.ndarray) else "")
            )
    return out
