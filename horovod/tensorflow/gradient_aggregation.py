"""Local gradient aggregation (upstream's ``LocalGradientAggregationHelper``): accumulate the
gradients of ``backward_passes_per_step`` passes locally and reduce them over the ranks once,
on the last pass; the optimizer applies them on that pass only. Works eagerly and in graphs
(the reduction sits in a ``tf.cond`` branch, so no communication happens on the other passes).

Must not touch: the engine; variables other than its own accumulators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from horovod.common.process_sets import ProcessSet, global_process_set


class LocalGradientAggregationHelper:
    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: Callable[[list[Any], list[Any] | None], list[Any]],
        sparse_as_dense: bool = False,
        average_aggregated_gradients: bool = False,
        rank: int | None = None,
        optimizer_type: Any = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_func = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.counter: tf.Variable | None = None
        self.accumulators: list[tf.Variable | None] = []

    def _build(self, grads: Sequence[Any]) -> None:
        if self.counter is not None:
            return
        with tf.init_scope():  # variables created once, outside any tf.function being traced
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_passes")
            self.accumulators = [
                None
                if g is None
                else tf.Variable(
                    tf.zeros(
                        g.dense_shape if isinstance(g, tf.IndexedSlices) else g.shape, g.dtype
                    ),
                    trainable=False,
                    name="hvd_grad_acc",
                )
                for g in grads
            ]

    def is_update_step(self) -> Any:
        """True on the pass where the aggregated gradients are reduced and applied."""
        assert self.counter is not None
        return tf.equal(self.counter, 0)

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any] = ()) -> list[Any]:
        """Add ``grads`` to the accumulators; on the last pass return the aggregated gradients
        reduced over the ranks (and reset the accumulators), else the accumulated values."""
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        self._build(grads)
        assert self.counter is not None
        n = self.backward_passes_per_step
        adds = [
            acc.assign_add(g)
            for acc, g in zip(self.accumulators, grads, strict=True)
            if acc is not None and g is not None
        ]
        with tf.control_dependencies(adds):
            count = self.counter.assign((self.counter + 1) % n)
        present = [i for i, a in enumerate(self.accumulators) if a is not None]

        def reduce() -> list[Any]:
            values = [tf.identity(self.accumulators[i]) for i in present]  # type: ignore[union-attr]
            if self.average_aggregated_gradients:
                values = [v / tf.cast(n, v.dtype) for v in values]
            reduced = self.allreduce_func(
                values, [variables[i] for i in present] if variables else None
            )
            with tf.control_dependencies(reduced):
                resets = [
                    self.accumulators[i].assign(tf.zeros_like(self.accumulators[i]))  # type: ignore[union-attr]
                    for i in present
                ]
            with tf.control_dependencies(resets):
                return [tf.identity(r) for r in reduced]

        def keep() -> list[Any]:
            return [tf.identity(self.accumulators[i]) for i in present]  # type: ignore[union-attr]

        with tf.control_dependencies([count]):
            out = tf.cond(tf.equal(count, 0), reduce, keep) if present else []
        out = out if isinstance(out, list) else list(out)
        result: list[Any] = [None] * len(grads)
        for i, v in zip(present, out, strict=True):
            result[i] = v
        return result

    def apply_gradients(
        self, apply_grads_closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``apply_grads_closure`` only on update passes."""

        def apply() -> Any:
            op = apply_grads_closure()
            with tf.control_dependencies([op] if op is not None else []):
                return tf.constant(True)

        return tf.cond(self.is_update_step(), apply, lambda: tf.constant(False))
