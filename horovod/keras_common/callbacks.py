"""Keras callbacks of upstream Horovod, shared by ``horovod.tensorflow.keras`` (tf.keras) and
``horovod.keras`` (standalone Keras on any backend): start every rank from the same weights,
average metrics over ranks, and scale the learning rate for the number of ranks. ``build()``
makes the classes over a given ``Callback`` base class and variable-broadcast function.

Must not touch: a Keras module of its own choosing (the frontend hands it its classes).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from horovod import frontend as F


def _get_lr(optimizer: Any) -> float:
    lr = optimizer.learning_rate
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def _momentum_buffers(optimizer: Any, variables: Any) -> list[Any]:
    """The velocity variables of a momentum optimizer (Keras 3 ``momentums``, Keras 2 slots)."""
    if not float(getattr(optimizer, "momentum", 0.0) or 0.0):
        return []
    buffers = getattr(optimizer, "momentums", None)
    if buffers:
        return list(buffers)
    if hasattr(optimizer, "get_slot_names") and "momentum" in optimizer.get_slot_names():
        return [optimizer.get_slot(v, "momentum") for v in variables]
    return []


def _set_lr(optimizer: Any, value: float) -> None:
    lr = optimizer.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


def build(
    base: Any, broadcast_variables: Callable[..., Any], checkpoint_base: Any = None
) -> SimpleNamespace:
    class BroadcastGlobalVariablesCallback(base):
        """Broadcast the model's (and optimizer's) variables from ``root_rank`` when training
        starts, and once more at the end of the first batch, when the optimizer's slot variables
        exist, so every rank trains the same model."""

        def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
            super().__init__()
            self.root_rank = root_rank
            self.local_ids = {id(v) for v in (local_variables or [])}
            self.broadcast_done = False

        def _variables(self) -> list[Any]:
            vs = list(self.model.variables)
            opt = getattr(self.model, "optimizer", None)
            if opt is not None:
                vs += list(getattr(opt, "variables", []) or [])
            return [v for v in vs if id(v) not in self.local_ids]

        def on_train_begin(self, logs: Any = None) -> None:
            broadcast_variables(
                self._variables(), self.root_rank, name="BroadcastGlobalVariablesCallback.begin"
            )

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.broadcast_done:
                return
            broadcast_variables(
                self._variables(), self.root_rank, name="BroadcastGlobalVariablesCallback"
            )
            self.broadcast_done = True

    class MetricAverageCallback(base):
        """At the end of every epoch, replace each metric in ``logs`` by its average over ranks
        (each rank saw only its shard of the data)."""

        def __init__(self, device: str = "") -> None:
            super().__init__()

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            if not logs:
                return
            for key in sorted(logs):
                value = np.asarray(logs[key], dtype=np.float64)
                avg = F.allreduce(value, op=F.Average, name=f"MetricAverageCallback.{key}")
                logs[key] = float(avg)

    class LearningRateScheduleCallback(base):
        """lr = ``initial_lr * multiplier`` between ``start_epoch`` and ``end_epoch``;
        ``multiplier`` is a function of the (fractional) epoch or a constant ``c`` meaning
        ``c ** (epoch - start_epoch)``. ``staircase`` changes it at epoch starts only."""

        def __init__(
            self,
            initial_lr: float,
            multiplier: float | Callable[[float], float],
            start_epoch: int = 0,
            end_epoch: int | None = None,
            staircase: bool = True,
            momentum_correction: bool = True,
            steps_per_epoch: int | None = None,
        ) -> None:
            super().__init__()
            self.momentum_correction = momentum_correction
            self.initial_lr = initial_lr
            self.start_epoch, self.end_epoch = start_epoch, end_epoch
            self.staircase = staircase
            self.steps_per_epoch = steps_per_epoch
            self.epoch = 0
            if callable(multiplier):
                self.multiplier = multiplier
            else:
                c = float(multiplier)
                self.multiplier = lambda epoch: c ** (epoch - start_epoch)

        def _active(self, epoch: float) -> bool:
            return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch
            if self.steps_per_epoch is None:
                self.steps_per_epoch = (self.params or {}).get("steps")

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self.staircase:
                if batch != 0:
                    return
                epoch: float = self.epoch
            else:
                steps = self.steps_per_epoch or 1
                epoch = self.epoch + batch / steps
            if self._active(epoch):
                self._change_lr(self.initial_lr * self.multiplier(epoch))

        def _change_lr(self, new: float) -> None:
            opt = self.model.optimizer
            old = _get_lr(opt)
            if self.momentum_correction and old > 0 and new != old:
                # upstream's momentum correction: momentum x new/old for this step, i.e. the
                # velocity scaled by new/old before the step (no retrace needed)
                for m in _momentum_buffers(opt, self.model.trainable_variables):
                    m.assign(m * (new / old))
            _set_lr(opt, new)

    class LearningRateWarmupCallback(LearningRateScheduleCallback):
        """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over
        ``warmup_epochs`` (the "large batch" recipe: start at the single-worker rate)."""

        def __init__(
            self,
            initial_lr: float,
            warmup_epochs: int = 5,
            momentum_correction: bool = True,
            steps_per_epoch: int | None = None,
            verbose: int = 0,
        ) -> None:
            n = F.size()

            def multiplier(epoch: float) -> float:
                return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

            super().__init__(
                initial_lr,
                multiplier,
                start_epoch=0,
                end_epoch=warmup_epochs,
                staircase=False,
                momentum_correction=momentum_correction,
                steps_per_epoch=steps_per_epoch,
            )
            self.verbose = verbose
            self.warmup_epochs = warmup_epochs

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == self.warmup_epochs - 1:
                self._change_lr(self.initial_lr)
                if self.verbose and F.rank() == 0:
                    print(
                        f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                        f"{self.initial_lr:g}."
                    )

    best: Any = None
    if checkpoint_base is not None:

        class BestModelCheckpoint(checkpoint_base):
            """``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``),
            written by rank 0 alone. ``filepath`` may also be set later (``cb.filepath = ...``),
            as upstream's estimators do."""

            def __init__(
                self,
                monitor: str = "val_loss",
                verbose: int = 0,
                save_weights_only: bool = False,
                mode: str = "auto",
                save_freq: Any = "epoch",
                filepath: str | None = None,
            ) -> None:
                if filepath is None:
                    filepath = "best.weights.h5" if save_weights_only else "best.keras"
                super().__init__(
                    filepath=filepath,
                    monitor=monitor,
                    verbose=verbose,
                    save_best_only=True,
                    save_weights_only=save_weights_only,
                    mode=mode,
                    save_freq=save_freq,
                )

            def _save_model(self, *args: Any, **kwargs: Any) -> None:
                if F.rank() == 0:
                    super()._save_model(*args, **kwargs)

        best = BestModelCheckpoint

    class LocalSGDCallback(base):
        """Local SGD in ``model.fit`` (docs/communication.md): the model trains on each rank's
        own batches (no DistributedOptimizer) and its trainable weights are averaged over the
        ranks every ``sync_every`` batches and at the end of training. Put it after
        ``BroadcastGlobalVariablesCallback``."""

        def __init__(
            self, sync_every: int, process_set: Any = None, adaptive: bool = False, **outer: Any
        ) -> None:
            super().__init__()
            from horovod.common.process_sets import global_process_set
            from horovod.frontend.local_sgd import Periodic

            kind = "DiLoCo" if outer else "LocalSGD"
            self.core = Periodic(
                sync_every,
                process_set=process_set or global_process_set,
                name=f"{kind}Callback",
                what=f"{kind}Callback",
                adaptive=adaptive,
                **outer,
            )

        def _arrays(self) -> list[np.ndarray]:
            return [np.array(v.numpy(), copy=True) for v in self.model.trainable_weights]

        def _sync(self) -> None:
            arrays = self._arrays()
            self.core.sync(arrays)
            for v, a in zip(self.model.trainable_weights, arrays, strict=True):
                v.assign(a)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self.core.outer_lr is not None and self.core.global_params is None:
                self.core.before_step(self._arrays())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.core.adaptive and logs and "loss" in logs:
                self.core.report_loss(float(logs["loss"]))
            if self.core.count_step():
                self._sync()

        def on_train_end(self, logs: Any = None) -> None:
            if self.core.since_sync:
                self._sync()  # end with the same weights on every rank

    class DiLoCoCallback(LocalSGDCallback):
        """DiLoCo in ``model.fit``: as ``LocalSGDCallback``, with an outer Nesterov step
        (``outer_lr``, ``outer_momentum``) on the ranks' averaged change at each sync."""

        def __init__(
            self,
            sync_every: int,
            outer_lr: float = 0.7,
            outer_momentum: float = 0.9,
            nesterov: bool = True,
            process_set: Any = None,
            adaptive: bool = False,
        ) -> None:
            super().__init__(
                sync_every,
                process_set,
                adaptive,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                nesterov=nesterov,
            )

    return SimpleNamespace(
        DiLoCoCallback=DiLoCoCallback,
        LocalSGDCallback=LocalSGDCallback,
        BestModelCheckpoint=best,
        BroadcastGlobalVariablesCallback=BroadcastGlobalVariablesCallback,
        MetricAverageCallback=MetricAverageCallback,
        LearningRateScheduleCallback=LearningRateScheduleCallback,
        LearningRateWarmupCallback=LearningRateWarmupCallback,
    )
