"""Data-parallel training with JAX: gradients of a pytree averaged over the ranks, an optax
``GradientTransformation`` that does it before the wrapped optimizer's update, and parameters
broadcast from one rank. Pytrees are checked across ranks (outside ``jit``): a leaf that is not
an array, or a structure that differs on some rank, is named by its path.

Must not touch: the engine (it uses the collectives of ``mpi_ops`` and ``horovod.frontend``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.jax import mpi_ops


def _leaves(tree: Any, what: str) -> tuple[list[tuple[str, Any]], Any]:
    """(path, leaf) pairs and the tree's structure; ValueError naming a leaf that is not an
    array."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in with_paths:
        key = jax.tree_util.keystr(path) or "<root>"
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, int)):
            raise ValueError(
                f"{what}: the leaf at {key} is a {type(leaf).__name__}, not an array; pass a "
                "pytree of arrays (jax.Array or NumPy)"
            )
        leaves.append((key, leaf))
    return leaves, treedef


def _check_same_everywhere(
    leaves: list[tuple[str, Any]], what: str, process_set: ProcessSet
) -> None:
    """Outside ``jit``: every rank must hold the same paths, shapes and dtypes (else a
    collective would pair different arrays). ValueError naming the first difference."""
    if any(isinstance(leaf, jax.core.Tracer) for _, leaf in leaves):
        return  # (traced: the ranks run the same program; nothing to compare eagerly)
    mine = [(key, tuple(np.shape(leaf)), str(jnp.result_type(leaf))) for key, leaf in leaves]
    everyone = F.allgather_object(mine, name=f"{what}.layout", process_set=process_set)
    ranks = process_set.ranks if process_set is not global_process_set else range(F.size())
    first = everyone[0]
    for rank, theirs in zip(ranks, everyone, strict=True):
        if theirs == first:
            continue
        for a, b in zip(first, theirs, strict=False):
            if a != b:
                raise ValueError(
                    f"{what}: the pytrees differ between ranks: rank {ranks[0]} has {a[0]} "
                    f"with shape {a[1]} and dtype {a[2]}, rank {rank} has {b[0]} with shape "
                    f"{b[1]} and dtype {b[2]}; every rank must pass the same structure"
                )
        raise ValueError(
            f"{what}: the pytrees differ between ranks: rank {ranks[0]} has {len(first)} "
            f"leaves, rank {rank} has {len(theirs)}; every rank must pass the same structure"
        )


# (name, process set id, job size) of the allreduce_gradients calls whose pytrees were compared
# across ranks: the first eager call of each is; later ones only by the engine's own checks
_CHECKED: set[tuple[Any, Any, Any]] = set()


def allreduce_gradients(
    grads: Any,
    op: int = mpi_ops.Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``grads`` (a pytree of arrays) reduced over the ranks with one grouped allreduce (the
    average by default), eagerly or inside ``jit``."""
    leaves, treedef = _leaves(grads, "allreduce_gradients")
    if not leaves:
        return grads
    key = (name, process_set.process_set_id, F.size())
    if key not in _CHECKED:  # the first call of a training loop (every rank's first: aligned)
        _check_same_everywhere(leaves, "allreduce_gradients", process_set)
        if not any(isinstance(leaf, jax.core.Tracer) for _, leaf in leaves):
            _CHECKED.add(key)
    reduced = mpi_ops.grouped_allreduce(
        [leaf for _, leaf in leaves],
        op=op,
        name=name or "allreduce_gradients",
        process_set=process_set,
    )
    return jax.tree_util.tree_unflatten(treedef, reduced)


def broadcast_parameters(
    params: Any, root_rank: int = 0, process_set: ProcessSet = global_process_set
) -> Any:
    """``params`` (a pytree of arrays) with ``root_rank``'s values on every rank (JAX arrays
    are immutable: use the returned tree)."""
    leaves, treedef = _leaves(params, "broadcast_parameters")
    _check_same_everywhere(leaves, "broadcast_parameters", process_set)
    out = [
        mpi_ops.broadcast(
            leaf, root_rank, name=f"broadcast_parameters.{key}", process_set=process_set
        )
        for key, leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


class DistributedState(NamedTuple):
    inner: Any  # the wrapped optimizer's state


def DistributedOptimizer(
    optimizer: Any,
    op: int = mpi_ops.Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """An optax ``GradientTransformation`` that reduces the gradients over the ranks (the
    average by default) and hands them to ``optimizer``'s update: every rank applies the same
    update. Usable inside ``jit``."""
    import optax

    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            f"DistributedOptimizer: expected an optax.GradientTransformation (for example "
            f"optax.adam(1e-3)), got {type(optimizer).__name__}"
        )
    if op not in (mpi_ops.Average, mpi_ops.Sum, mpi_ops.Adasum):
        raise ValueError("DistributedOptimizer: op must be hvd.Average, hvd.Sum or hvd.Adasum")

    def init(params: Any) -> DistributedState:
        return DistributedState(optimizer.init(params))

    def update(grads: Any, state: DistributedState, params: Any = None) -> Any:
        reduced = allreduce_gradients(
            grads, op=op, name=name or "DistributedOptimizer", process_set=process_set
        )
        updates, inner = optimizer.update(reduced, state.inner, params)
        return updates, DistributedState(inner)

    return optax.GradientTransformation(init, update)
