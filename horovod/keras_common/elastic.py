"""Elastic training for Keras models, shared by ``horovod.tensorflow.keras`` (tf.keras) and
``horovod.keras`` (standalone Keras): ``KerasState`` (upstream's ``TensorFlowKerasState``)
and the callbacks that keep a state's counters and commits in step with ``model.fit``
(``CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``).
``build()`` makes them over a given ``Callback`` base class and variable-broadcast function.

Must not touch: a Keras module of its own choosing (the frontend hands it its classes).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from horovod.elastic.state import ObjectState


def _variables(holder: Any) -> list[Any]:
    """A model's or optimizer's variables (a property in Keras 3, a method in legacy Keras)."""
    vs = getattr(holder, "variables", [])
    return list(vs() if callable(vs) else vs)


def _values(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def build(base: Any, broadcast_variables: Callable[..., Any]) -> SimpleNamespace:
    class KerasState(ObjectState):
        """``KerasState(model, optimizer=None, epoch=0, batch=0)``: the model's and the
        optimizer's variables plus plain attributes. The model must be built."""

        def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs):
            if not getattr(model, "built", True):
                raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
            self.model = model
            self.optimizer = optimizer if optimizer is not None else model.optimizer
            self._saved_model: list[np.ndarray] = []
            self._saved_optimizer: list[np.ndarray] = []
            super().__init__(**kwargs)
            self._save_variables()

        def _save_variables(self) -> None:
            self._saved_model = _values(_variables(self.model))
            self._saved_optimizer = (
                _values(_variables(self.optimizer)) if self.optimizer is not None else []
            )

        def save(self) -> None:
            self._save_variables()
            super().save()

        def restore(self) -> None:
            for v, x in zip(_variables(self.model), self._saved_model, strict=False):
                v.assign(x)
            if self.optimizer is not None:
                current = _variables(self.optimizer)
                if len(current) == len(self._saved_optimizer):
                    for v, x in zip(current, self._saved_optimizer, strict=True):
                        v.assign(x)
            super().restore()

        def sync(self) -> None:
            root = self.newest_holder()
            opt = self.optimizer
            if opt is not None and hasattr(opt, "build") and not getattr(opt, "built", True):
                # A new worker's optimizer has no slot variables yet: make them, so that its
                # variables line up with the root's.
                opt.build(self.model.trainable_variables)
            broadcast_variables(_variables(self.model), root, name="elastic.model")
            if opt is not None:
                broadcast_variables(_variables(opt), root, name="elastic.optimizer")
            self.sync_objects(root)
            self._save_variables()

    class CommitStateCallback(base):
        """Commit the state every ``batches_per_commit`` batches and at the end of each
        epoch (put it after the Update*StateCallbacks)."""

        def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
            super().__init__()
            self.state = state
            self.batches_per_commit = batches_per_commit
            self.batches_remaining = batches_per_commit

        def on_train_begin(self, logs: Any = None) -> None:
            # Every rank enters fit() afresh after a reset: count from there on all of them,
            # so survivors and new workers commit at the same batches.
            self.batches_remaining = self.batches_per_commit

        def on_batch_end(self, batch: int, logs: Any = None) -> None:
            self.batches_remaining -= 1
            if self.batches_remaining == 0:
                self.state.commit()
                self.batches_remaining = self.batches_per_commit

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.state.commit()

    class UpdateBatchStateCallback(base):
        """Keep ``state.batch`` at the batch that finished (0 at an epoch's end); after a
        reset, the first epoch is shortened by the batches already done (where Keras reads
        ``params['steps']``)."""

        def __init__(self, state: Any) -> None:
            super().__init__()
            self.state = state
            self.steps_per_epoch: int | None = None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            steps = self.params.get("steps") if isinstance(self.params, dict) else None
            if steps:
                if self.steps_per_epoch is None:
                    self.steps_per_epoch = steps
                self.params["steps"] = self.steps_per_epoch - self.state.batch

        def on_batch_end(self, batch: int, logs: Any = None) -> None:
            self.state.batch = batch + 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.state.batch = 0

    class UpdateEpochStateCallback(base):
        """Keep ``state.epoch`` at the next epoch to run (pass ``initial_epoch=state.epoch``
        to ``model.fit``)."""

        def __init__(self, state: Any) -> None:
            super().__init__()
            self.state = state

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.state.epoch = epoch + 1

    return SimpleNamespace(
        KerasState=KerasState,
        CommitStateCallback=CommitStateCallback,
        UpdateBatchStateCallback=UpdateBatchStateCallback,
        UpdateEpochStateCallback=UpdateEpochStateCallback,
    )
