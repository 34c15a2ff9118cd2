"""JAX collectives on pyhorovod's engine, eagerly and inside ``jax.jit``.

Eagerly, an array's NumPy view goes straight to the engine; an array on a GPU goes to the
device data plane instead (docs/gpu.md), as a torch view of the same memory (DLPack) through
``horovod.torch``: no host copy. Inside a traced function
(``jax.jit``, ``jax.grad``), each collective is an *ordered* ``io_callback``: XLA runs the
callbacks of one computation in program order, so every rank reaches its collectives in the
order they were written (a collective run out of order on one rank would wait for ever).
Shapes must be known when tracing: inside ``jit``, ``allgather`` needs the same first dimension
on every rank and ``alltoall`` an even split; outside it, any. Gradients are defined with
``jax.custom_vjp`` as upstream's other frontends define them: allreduce -> allreduce of the
cotangent (Sum/Average), allgather -> this rank's rows of the averaged cotangent, broadcast ->
the averaged cotangent on the root and zeros elsewhere, alltoall -> the cotangent sent back,
reducescatter -> the allgather of the cotangent (times the set size for Sum, and the scales).

Must not touch: the engine's internals (it submits through ``horovod.frontend``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product


def _traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


@functools.cache
def _have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _on_device(xs: Sequence[Any]) -> bool:
    """Do these (concrete) arrays go to the device data plane: arrays on a GPU, or any array
    with ``HOROVOD_DEVICE_PLANE_TEST`` (the plane tested without a GPU)?"""
    if not _have_torch():
        return False  # without PyTorch, GPU arrays go through host memory
    if F.device_standin():
        return True
    for x in xs:
        devices = getattr(x, "devices", None)
        if devices is not None and any(d.platform in ("gpu", "cuda") for d in devices()):
            return True
    return False


def _device_call(fn: Callable[..., list], xs: Sequence[Any]) -> list:
    """``fn`` on torch views of ``xs`` (DLPack: no copy, the streams ordered by the
    protocol) through horovod.torch, so the device data plane moves them; the results come
    back as JAX arrays the same way."""
    import torch

    import horovod.torch as api

    results = fn(api, *[torch.from_dlpack(x) for x in xs])
    return [jnp.from_dlpack(r) for r in results]


def _run(fn: Callable[..., list[Any]], xs: Sequence[Any], outs: Sequence[Any]) -> list:
    """``fn(api, *arrays)`` (a list of arrays out) on ``xs``: now if none is traced, else as
    an ordered host callback whose results have the shapes and dtypes ``outs``. ``api`` is
    ``horovod.frontend`` on NumPy arrays, or ``horovod.torch`` on the torch views of arrays
    that live on a GPU (``_device_call``); the two have the same calls."""
    if not _traced(*xs):
        if _on_device(xs):
            return _device_call(fn, xs)
        return [jnp.asarray(r) for r in fn(F, *[np.asarray(x) for x in xs])]

    def host(*arrays: Any) -> list[np.ndarray]:
        results = fn(F, *[np.asarray(a) for a in arrays])
        return [np.asarray(r, dtype=o.dtype) for r, o in zip(results, outs, strict=True)]

    return list(io_callback(host, list(outs), *xs, ordered=True))


def _spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _set_size(ps: ProcessSet) -> int:
    n = ps.size() if ps is not global_process_set else F.size()
    assert n is not None
    return n


def _set_rank(ps: ProcessSet) -> int:
    r = ps.rank() if ps is not global_process_set else F.rank()
    assert r is not None
    return r


# ------------------------------------------------------------------------------- allreduce
def _alone(ps: ProcessSet, pre: float, post: float) -> bool:
    """A reduction over one rank without scale factors is the identity: no host callback
    (one costs about half a millisecond per step under ``jit``)."""
    return pre == 1.0 and post == 1.0 and _set_size(ps) == 1


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _allreduce(x: Any, op: int, pre: float, post: float, name: Any, ps: ProcessSet) -> Any:
    if _alone(ps, pre, post):
        return x
    return _run(
        lambda api, a: [
            api.allreduce(
                a, op=op, prescale_factor=pre, postscale_factor=post, name=name, process_set=ps
            )
        ],
        [x],
        [_spec(x.shape, x.dtype)],
    )[0]


def _allreduce_fwd(x, op, pre, post, name, ps):  # type: ignore[no-untyped-def]
    return _allreduce(x, op, pre, post, name, ps), None


def _allreduce_bwd(op, pre, post, name, ps, _res, ct):  # type: ignore[no-untyped-def]
    if op not in (Average, Sum, Adasum):
        raise NotImplementedError("only Sum, Average and Adasum allreduces have a gradient")
    return (_allreduce(ct, op, pre, post, f"{name}.grad" if name else None, ps),)


_allreduce.defvjp(_allreduce_fwd, _allreduce_bwd)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> jax.Array:
    """Reduce ``tensor`` over the ranks of ``process_set`` (Average by default)."""
    op = F.resolve_op(op, average, "allreduce")
    x = jnp.asarray(tensor)
    return _allreduce(x, op, float(prescale_factor), float(postscale_factor), name, process_set)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _grouped_allreduce(xs: tuple, op: int, pre: float, post: float, name: Any, ps: Any) -> tuple:
    if _alone(ps, pre, post):
        return tuple(xs)
    outs = _run(
        lambda api, *arrays: api.grouped_allreduce(
            list(arrays),
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
            name=name,
            process_set=ps,
        ),
        list(xs),
        [_spec(x.shape, x.dtype) for x in xs],
    )
    return tuple(outs)


def _grouped_fwd(xs, op, pre, post, name, ps):  # type: ignore[no-untyped-def]
    return _grouped_allreduce(xs, op, pre, post, name, ps), None


def _grouped_bwd(op, pre, post, name, ps, _res, cts):  # type: ignore[no-untyped-def]
    if op not in (Average, Sum, Adasum):
        raise NotImplementedError("only Sum, Average and Adasum allreduces have a gradient")
    return (_grouped_allreduce(tuple(cts), op, pre, post, f"{name}.grad" if name else None, ps),)


_grouped_allreduce.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[jax.Array]:
    """Reduce several arrays as one group (fused together, completed together)."""
    op = F.resolve_op(op, average, "grouped_allreduce")
    xs = tuple(jnp.asarray(t) for t in tensors)
    if not xs:
        return []
    return list(
        _grouped_allreduce(
            xs, op, float(prescale_factor), float(postscale_factor), name, process_set
        )
    )


# ------------------------------------------------------------------------------- allgather
def _gather_shape(x: Any, ps: ProcessSet) -> tuple[int, ...]:
    """Inside ``jit`` the result's shape must be known: the same rows on every rank."""
    if x.ndim == 0:
        raise ValueError("allgather: needs an array with at least one dimension, got a scalar")
    return (x.shape[0] * _set_size(ps), *x.shape[1:])


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _allgather(x: Any, name: Any, ps: ProcessSet) -> Any:
    if not _traced(x):
        return _run(lambda api, a: [api.allgather(a, name=name, process_set=ps)], [x], [])[0]

    def host(a: Any) -> list[np.ndarray]:
        a = np.asarray(a)
        out = F.allgather(a, name=name, process_set=ps)
        if out.shape[0] != a.shape[0] * _set_size(ps):
            raise ValueError(
                f"allgather inside jax.jit: rank {F.rank()} has {a.shape[0]} rows but the ranks "
                f"have {out.shape[0]} together; under jit every rank must pass the same first "
                "dimension (the result's shape is fixed when tracing)"
            )
        return [out]

    return io_callback(host, [_spec(_gather_shape(x, ps), x.dtype)], x, ordered=True)[0]


def _allgather_fwd(x, name, ps):  # type: ignore[no-untyped-def]
    return _allgather(x, name, ps), x.shape[0]


def _allgather_bwd(name, ps, rows, ct):  # type: ignore[no-untyped-def]
    # upstream's: this rank's rows of the averaged cotangent (rank-order offsets)
    averaged = _allreduce(ct, Average, 1.0, 1.0, f"{name}.grad" if name else None, ps)
    counts = _allgather(jnp.asarray([rows]), f"{name}.grad.rows" if name else None, ps)
    start = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < _set_rank(ps), counts, 0))
    return (jax.lax.dynamic_slice_in_dim(averaged, start, rows, axis=0),)


_allgather.defvjp(_allgather_fwd, _allgather_bwd)


def allgather(
    tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> jax.Array:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    return _allgather(jnp.asarray(tensor), name, process_set)


# ------------------------------------------------------------------------------- broadcast
@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _broadcast(x: Any, root: int, name: Any, ps: ProcessSet) -> Any:
    return _run(
        lambda api, a: [api.broadcast(a, root, name=name, process_set=ps)],
        [x],
        [_spec(x.shape, x.dtype)],
    )[0]


def _broadcast_fwd(x, root, name, ps):  # type: ignore[no-untyped-def]
    return _broadcast(x, root, name, ps), None


def _broadcast_bwd(root, name, ps, _res, ct):  # type: ignore[no-untyped-def]
    averaged = _allreduce(ct, Average, 1.0, 1.0, f"{name}.grad" if name else None, ps)
    return (averaged if F.rank() == root else jnp.zeros_like(averaged),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> jax.Array:
    """``root_rank``'s ``tensor`` on every rank."""
    return _broadcast(jnp.asarray(tensor), int(root_rank), name, process_set)


# ------------------------------------------------------------------------------- alltoall
@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _alltoall_even(x: Any, name: Any, ps: ProcessSet) -> Any:
    n = _set_size(ps)
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"alltoall: without splits the first dimension ({x.shape[0] if x.ndim else 'none'}) "
            f"must be a multiple of the number of ranks ({n})"
        )
    even = [x.shape[0] // n] * n
    return _run(
        lambda api, a: [api.alltoall(a, even, name=name, process_set=ps)[0]],
        [x],
        [_spec(x.shape, x.dtype)],
    )[0]


def _alltoall_fwd(x, name, ps):  # type: ignore[no-untyped-def]
    return _alltoall_even(x, name, ps), None


def _alltoall_bwd(name, ps, _res, ct):  # type: ignore[no-untyped-def]
    # each rank's rows go back where they came from: the same even exchange
    return (_alltoall_even(ct, f"{name}.grad" if name else None, ps),)


_alltoall_even.defvjp(_alltoall_fwd, _alltoall_bwd)


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows to rank i (even by default) and concatenate what arrives, in rank
    order. Returns the output, or ``(output, received_splits)`` when ``splits`` is given
    (outside ``jit`` only: uneven shapes are not known when tracing)."""
    x = jnp.asarray(tensor)
    if splits is None:
        return _alltoall_even(x, name, process_set)
    if _traced(x, splits):
        raise ValueError(
            "alltoall with splits inside jax.jit: the output's shape depends on the other "
            "ranks' splits; call it outside jit, or without splits (an even split)"
        )
    sizes = np.asarray(splits).tolist()
    out, received = _run(
        lambda api, a: list(api.alltoall(a, sizes, name=name, process_set=process_set)), [x], []
    )
    return out, jnp.asarray(np.asarray(received, np.int32))


# ------------------------------------------------------------------------------- reducescatter
@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _reducescatter(x: Any, op: int, pre: float, post: float, name: Any, ps: ProcessSet) -> Any:
    if x.ndim == 0:
        raise ValueError("reducescatter: needs an array with at least one dimension")
    base, extra = divmod(x.shape[0], _set_size(ps))
    rows = base + (1 if _set_rank(ps) < extra else 0)  # the first d0 % n ranks get one more
    return _run(
        lambda api, a: [
            api.reducescatter(
                a, op=op, prescale_factor=pre, postscale_factor=post, name=name, process_set=ps
            )
        ],
        [x],
        [_spec((rows, *x.shape[1:]), x.dtype)],
    )[0]


def _reducescatter_fwd(x, op, pre, post, name, ps):  # type: ignore[no-untyped-def]
    return _reducescatter(x, op, pre, post, name, ps), x.shape


def _reducescatter_bwd(op, pre, post, name, ps, shape, ct):  # type: ignore[no-untyped-def]
    # upstream's: the allgather of the cotangent, times the set size for Sum, and the scales
    n = _set_size(ps)
    gathered = _run(
        lambda api, a: [api.allgather(a, name=f"{name}.grad" if name else None, process_set=ps)],
        [ct],
        [_spec(shape, ct.dtype)],
    )[0]
    return (gathered * ((n if op == Sum else 1) * pre * post),)


_reducescatter.defvjp(_reducescatter_fwd, _reducescatter_bwd)


def reducescatter(
    tensor: Any,
    op: int = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> jax.Array:
    """Reduce over the ranks, then give rank i the i-th block of rows (the first
    ``d0 % n`` ranks one more)."""
    if op not in (Average, Sum):
        raise ValueError("reducescatter supports only op=Average or op=Sum")
    x = jnp.asarray(tensor)
    return _reducescatter(x, op, float(prescale_factor), float(postscale_factor), name, process_set)
