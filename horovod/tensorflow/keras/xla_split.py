"""Keras 3 on TensorFlow with XLA (``model.compile(jit_compile=True)``, and ``"auto"`` where
Keras turns XLA on): the reduction of the gradients placed outside the compiled part.

XLA cannot call back into Python, so Horovod's collectives cannot live inside an XLA cluster
(TensorFlow has outside compilation only on TPUs). For a model whose optimizer is Horovod's
``DistributedOptimizer`` and whose ``train_step`` is Keras's own, the train function is built
as three parts, each doing what Keras's ``train_step`` does, in its order:

1. compiled with XLA: the forward pass, the loss (and its tracker), the gradients;
2. not compiled: the reduction of the gradients over the ranks (Horovod's collectives);
3. compiled with XLA: the wrapped optimizer's own update with the reduced gradients;

then the metrics, as Keras computes them. Keras's loop around the step (``steps_per_execution``,
the iterator, the logs) is Keras's own: only the step function changes. A model with its own
``train_step``, gradient accumulation (``backward_passes_per_step > 1``) or a Keras without the
attributes this relies on keeps Keras's train function, and the collective inside XLA then
fails with an error that says what to do.

Must not touch: Keras's loop, models with their own ``train_step``, anything when the optimizer
is not Horovod's.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

_NEEDED = ("_call_has_training_arg", "_compute_loss", "_loss_tracker", "_make_function")


def install() -> bool:
    """Wrap Keras 3's TensorFlow ``make_train_function`` (once); False where this Keras lacks
    what the split relies on."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:
        return False
    original = TensorFlowTrainer.make_train_function
    if getattr(original, "_hvd_split", False):
        return True

    def make_train_function(self: Any, force: bool = False) -> Any:
        if (self.train_function is None or force) and _applies(self, TensorFlowTrainer):
            # Keras's loop around the step, itself not compiled: the parts inside are
            self.jit_compile = False
            try:
                self.train_function = self._make_function(_split_step(self))
            finally:
                self.jit_compile = True
            return self.train_function
        return original(self, force)

    make_train_function._hvd_split = True  # type: ignore[attr-defined]
    TensorFlowTrainer.make_train_function = make_train_function
    return True


def _applies(model: Any, trainer_cls: Any) -> bool:
    opt = getattr(model, "optimizer", None)
    return (
        not model.run_eagerly
        and bool(model.jit_compile)
        and opt is not None
        and hasattr(opt, "_hvd_reduce")
        and "apply" in type(opt).__dict__  # Keras 3, no gradient accumulation
        and type(model).train_step is trainer_cls.train_step
        and all(hasattr(model, a) for a in _NEEDED)
    )


def _split_step(model: Any) -> Any:
    """The step function that ``_make_function`` wraps in a plain (not XLA) tf.function: it
    calls the two compiled parts around the reduction."""
    from keras.src import tree
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    opt = model.optimizer
    base = opt._hvd_base

    def gradients(x: Any, y: Any, sample_weight: Any) -> Any:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
            )
            loss = opt.scale_loss(loss)
        return y_pred, tape.gradient(loss, model.trainable_weights)

    def update(grads: Any) -> None:
        base.apply(opt, grads, model.trainable_weights)

    compiled_gradients = tf.function(gradients, jit_compile=True, reduce_retracing=True)
    compiled_update = tf.function(update, jit_compile=True, reduce_retracing=True)

    def train_step(data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if not model.trainable_weights:
            return model.train_step(data)  # (Keras warns; nothing to reduce)
        if not opt.built:
            opt.build(model.trainable_weights)
        y_pred, grads = compiled_gradients(x, y, sample_weight)
        reduced = opt._hvd_reduce(list(grads), list(model.trainable_weights))
        compiled_update(reduced)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step
