"""TensorFlow collectives on pyhorovod's engine, eagerly and inside ``tf.function``.

Eagerly, a tensor's NumPy view goes straight to the engine; a tensor on a GPU goes to the
device data plane instead (docs/gpu.md), as a torch view of the same memory (DLPack) through
``horovod.torch``. In a graph (``tf.function``), each
collective is a ``tf.numpy_function`` op; successive collectives of one graph are chained with
control dependencies so every rank runs them in the order they were written (TensorFlow may
otherwise run independent ops in any order, and a blocking collective run out of order on one
rank would wait for ever). Gradients are registered with ``tf.custom_gradient``, as upstream
defines them: the gradient of an allreduce is the allreduce of the gradient, of an allgather
this rank's rows of the averaged gradient, of a broadcast the averaged gradient on the root
(zeros elsewhere), of an alltoall the alltoall of the gradient back with the received splits,
of a reducescatter the allgather of the gradient (times the set size for Sum, and the scale
factors).

Must not touch: the engine's internals (it submits through ``horovod.frontend``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from horovod import frontend as F
from horovod.common.exceptions import CollectiveRejected
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.core import context as _context
from horovod.core.messages import ADASUM_OP, AVERAGE, SUM
from horovod.tensorflow import device_bridge
from horovod.tensorflow.util import _executing_eagerly  # noqa: F401  (upstream's name here)

# Upstream's ``_basics`` object (user code calls ``_get_process_set_ids_and_ranks()`` on it).
_basics = F.BASICS

Average, Sum, Adasum = AVERAGE, SUM, ADASUM_OP

# Our functions run as written inside tf.function (no AutoGraph rewriting of their Python).
_no_autograph = tf.autograph.experimental.do_not_convert

_last_op: weakref.WeakKeyDictionary[Any, list[tf.Tensor]] = weakref.WeakKeyDictionary()
_graph_count: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _graph_name(prefix: str, tensor: Any, name: str | None) -> str | None:
    """The name of an unnamed collective in a graph: ``HorovodAllreduce_<k>`` for the k-th
    collective traced into that graph. Tracing follows program order, so the same code gives
    the same names on every rank (graph tensor names do not: captured tensors are named after
    per-process ids)."""
    if name or tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    k = _graph_count.get(graph, 0) + 1
    _graph_count[graph] = k
    return f"{prefix}_{k}"


@_no_autograph
def _run(
    fn: Callable[..., Sequence[np.ndarray]],
    inputs: Sequence[tf.Tensor],
    touts: Sequence[tf.DType],
    op_name: str,
    device_ok: bool = True,
) -> list[tf.Tensor]:
    """Run ``fn(api, *arrays)`` (arrays out) now if eager, else as a graph op. ``api`` is
    ``horovod.frontend`` on NumPy arrays, or, for eager tensors on a GPU (where
    ``device_ok``), ``horovod.torch`` on torch views of them (``device_bridge``): the two have
    the same calls."""
    if tf.executing_eagerly():
        try:
            if device_ok and device_bridge.on_device(inputs):
                return device_bridge.call(fn, inputs, touts, _to_tensor)
            # np.asarray of a CPU EagerTensor is a view of its buffer: no copy in
            outs = fn(F, *[np.asarray(x) for x in inputs])
        except CollectiveRejected as e:  # ranks disagree: TensorFlow's type, as upstream
            raise tf.errors.FailedPreconditionError(None, None, str(e)) from e
        except (ValueError, TypeError) as e:  # a bad argument, such as a root rank
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from e
        return [_to_tensor(o, d) for o, d in zip(outs, touts, strict=True)]
    if _in_xla(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"{op_name}: Horovod's collectives cannot run inside an XLA-compiled function "
            "(tf.function(jit_compile=True)): XLA cannot call back into Python. Compile the "
            "model's computation with XLA and call the collective (or "
            "DistributedGradientTape.gradient) outside it: tf.function with "
            "tf.xla.experimental.jit_scope() around the step compiles everything but the "
            "collectives. Keras 3's model.fit does this by itself for Horovod's "
            "DistributedOptimizer with Keras's own train_step; a custom train_step or Keras 2 "
            "needs model.compile(jit_compile=False) (docs/tensorflow.md)"
        )
    bound = _context.bind(fn)

    def np_fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(o) for o in bound(F, *arrays)]

    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(_last_op.get(graph, [])):
        outs = tf.numpy_function(np_fn, list(inputs), list(touts), stateful=True, name=op_name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    _last_op[graph] = outs[:1]
    return outs


def _in_xla(graph: Any) -> bool:
    """Is ``graph`` being traced for XLA (``tf.function(jit_compile=True)``)?"""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TensorFlow without the module: cannot tell
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def _to_tensor(value: Any, dtype: tf.DType) -> tf.Tensor:
    """A result array as a tensor: shared through DLPack when TensorFlow can take it (the
    engine allocated it for this call; TensorFlow's kernels need 64-byte aligned buffers, which
    large allocations are), copied otherwise."""
    if (
        isinstance(value, np.ndarray)
        and value.flags.c_contiguous
        and value.ctypes.data % 64 == 0
        and value.dtype == dtype.as_numpy_dtype
        and value.dtype.kind in "biuf"
    ):
        try:
            return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
        except Exception:  # noqa: BLE001 - a dtype or layout DLPack cannot carry: copy
            pass
    return tf.convert_to_tensor(value, dtype=dtype)


def _dense(tensor: Any) -> tf.Tensor:
    return tf.convert_to_tensor(tensor)


# ------------------------------------------------------------------------------- allreduce
def _allreduce_dense(
    tensor: tf.Tensor,
    op: int,
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
) -> tf.Tensor:
    name = _graph_name("HorovodAllreduce", tensor, name)

    @tf.custom_gradient
    def _op(x: tf.Tensor) -> Any:
        def fn(api: Any, a: np.ndarray) -> list[np.ndarray]:
            return [
                api.allreduce(
                    a,
                    name=name,
                    op=op,
                    prescale_factor=prescale,
                    postscale_factor=postscale,
                    process_set=process_set,
                )
            ]

        y = _run(fn, [x], [x.dtype], "HorovodAllreduce")[0]
        y.set_shape(x.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            if op not in (AVERAGE, SUM, ADASUM_OP):
                raise NotImplementedError("only Sum, Average and Adasum allreduces have a gradient")
            return _allreduce_dense(
                dy, op, prescale, postscale, f"{name}.grad" if name else None, process_set
            )

        return y, grad

    return _op(tensor)


@_no_autograph
def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set`` (Average by default).
    ``tf.IndexedSlices`` are reduced as two allgathers (values and indices), Sum/Average only."""
    from horovod.tensorflow.compression import Compression

    compression = compression or Compression.none
    op = F.resolve_op(op, average, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (AVERAGE, SUM):
            raise NotImplementedError(
                "Only Sum and Average ops are supported with tf.IndexedSlices"
            )
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError(
                "pre/postscale factors are not supported with tf.IndexedSlices"
            )
        base = name or None
        values = allgather(
            tensor.values, name=f"{base}.values" if base else None, process_set=process_set
        )
        indices = allgather(
            tensor.indices, name=f"{base}.indices" if base else None, process_set=process_set
        )
        if op == AVERAGE:
            values = values / tf.cast(process_set.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    compressed, ctx = compression.compress(_dense(tensor))
    out = _allreduce_dense(compressed, op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(out, ctx)


@_no_autograph
def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[tf.Tensor]:
    """Allreduce several tensors as one group (fused together, completed together)."""
    from horovod.tensorflow.compression import Compression

    compression = compression or Compression.none
    op = F.resolve_op(op, average, "grouped_allreduce")
    if not tensors:
        return []
    sliced = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sliced:
        # tf.IndexedSlices are reduced each on its own (two allgathers, as allreduce does);
        # the dense tensors as one group. Results keep the input order.
        base = _graph_name("HorovodGroupedAllreduce", None, name)
        out: list[Any] = list(tensors)
        for i in sliced:
            out[i] = allreduce(
                tensors[i],
                op=op,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                name=f"{base}.slices.{i}" if base else None,
                process_set=process_set,
            )
        dense = [i for i in range(len(tensors)) if i not in set(sliced)]
        reduced = grouped_allreduce(
            [tensors[i] for i in dense],
            compression=compression,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
            name=f"{base}.dense" if base else None,
        )
        for i, r in zip(dense, reduced, strict=True):
            out[i] = r
        return out
    packed = [compression.compress(_dense(t)) for t in tensors]
    name = _graph_name("HorovodGroupedAllreduce", packed[0][0], name)
    outs = _grouped_allreduce_dense(
        [p[0] for p in packed], op, prescale_factor, postscale_factor, name, process_set
    )
    return [compression.decompress(o, p[1]) for o, p in zip(outs, packed, strict=True)]


def _grouped_allreduce_dense(
    tensors: list[tf.Tensor],
    op: int,
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
) -> list[tf.Tensor]:
    @tf.custom_gradient
    def _op(*xs: tf.Tensor) -> Any:
        def fn(api: Any, *arrays: np.ndarray) -> list[np.ndarray]:
            return api.grouped_allreduce(
                list(arrays),
                name=name,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=process_set,
            )

        ys = _run(fn, list(xs), [x.dtype for x in xs], "HorovodGroupedAllreduce")
        for y, x in zip(ys, xs, strict=True):
            y.set_shape(x.shape)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            if op not in (AVERAGE, SUM, ADASUM_OP):
                raise NotImplementedError("only Sum, Average and Adasum allreduces have a gradient")
            return _grouped_allreduce_dense(
                list(dys), op, prescale, postscale, f"{name}.grad" if name else None, process_set
            )

        return ys, grad

    return list(_op(*tensors))


# ------------------------------------------------------------------------------- allgather
@_no_autograph
def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order."""
    x = _dense(tensor)
    name = _graph_name("HorovodAllgather", x, name)

    @tf.custom_gradient
    def _op(x: tf.Tensor) -> Any:
        y = _run(
            lambda api, a: [api.allgather(a, name=name, process_set=process_set)],
            [x],
            [x.dtype],
            "HorovodAllgather",
        )[0]
        y.set_shape([None] + list(x.shape[1:]))

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return _allgather_grad(x, dy, name, process_set)

        return y, grad

    return _op(x)


def _allgather_grad(
    x: tf.Tensor, dy: tf.Tensor, name: str | None, process_set: ProcessSet
) -> tf.Tensor:
    """As upstream: every rank's row count, then this rank's rows of the averaged gradient."""
    rows = tf.shape(x, out_type=tf.int64)[:1]
    counts = allgather(rows, name=f"{name}.grad.rows" if name else None, process_set=process_set)
    averaged = _allreduce_dense(
        dy, AVERAGE, 1.0, 1.0, f"{name}.grad" if name else None, process_set
    )
    me = process_set.rank()
    start = tf.reduce_sum(counts[:me])
    return averaged[start : start + counts[me]]


@_no_autograph
def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    xs = [_dense(t) for t in tensors]
    if not xs:
        return []
    name = _graph_name("HorovodGroupedAllgather", xs[0], name)

    @tf.custom_gradient
    def _op(*xs: tf.Tensor) -> Any:
        ys = _run(
            lambda api, *arrays: api.grouped_allgather(
                list(arrays), name=name, process_set=process_set
            ),
            list(xs),
            [x.dtype for x in xs],
            "HorovodGroupedAllgather",
        )
        for y, x in zip(ys, xs, strict=True):
            y.set_shape([None] + list(x.shape[1:]))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            return [
                _allgather_grad(x, dy, f"{name}.{i}" if name else None, process_set)
                for i, (x, dy) in enumerate(zip(xs, dys, strict=True))
            ]

        return ys, grad

    return list(_op(*xs))


# ------------------------------------------------------------------------------- broadcast
@_no_autograph
def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """``root_rank``'s value of ``tensor`` on every rank."""
    x = _dense(tensor)
    name = _graph_name("HorovodBroadcast", x, name)

    @tf.custom_gradient
    def _op(x: tf.Tensor) -> Any:
        y = _run(
            lambda api, a: [api.broadcast(a, root_rank, name=name, process_set=process_set)],
            [x],
            [x.dtype],
            "HorovodBroadcast",
        )[0]
        y.set_shape(x.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            # as upstream: the averaged gradient on the root, zeros elsewhere
            averaged = _allreduce_dense(
                dy, AVERAGE, 1.0, 1.0, f"{name}.grad" if name else None, process_set
            )
            if F.rank() == root_rank:
                return averaged
            return tf.zeros_like(averaged)

        return y, grad

    return _op(x)


def broadcast_(
    variables: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Overwrite ``variables`` (one tf.Variable or a list) with ``root_rank``'s values. Eagerly
    it returns the variables; in a graph, as upstream, the assignments (running them in a
    ``Session`` broadcasts, and gives the new values)."""
    single = isinstance(variables, (tf.Variable, tf.compat.v1.Variable))
    vs = [variables] if single else list(variables)
    assigned = _broadcast_assign(vs, root_rank, process_set, name)
    if assigned is None:
        return variables if single else vs
    return assigned[0] if single else assigned


@_no_autograph
def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
    name: str | None = None,
) -> Any:
    """Assign ``root_rank``'s values to every variable in ``variables`` (one batch of
    broadcasts, completed together). In a graph, the op that does it."""
    assigned = _broadcast_assign(list(variables), root_rank, process_set, name)
    return None if assigned is None else tf.group(*assigned)


def _broadcast_assign(
    vs: list[Any], root_rank: int, process_set: ProcessSet, name: str | None
) -> list[Any] | None:
    """Broadcast ``vs`` from ``root_rank`` and assign: done at once eagerly (None), else the
    graph's assignments, one per variable."""
    if not vs:
        return None
    prefix = name or "broadcast_variables"
    names = [f"{prefix}.{i}.{getattr(v, 'name', 'var')}" for i, v in enumerate(vs)]

    if tf.executing_eagerly():
        handles = [
            F.broadcast_async(
                np.asarray(tf.convert_to_tensor(v)), root_rank, name=n, process_set=process_set
            )
            for v, n in zip(vs, names, strict=True)
        ]
        for v, h in zip(vs, handles, strict=True):
            v.assign(F.synchronize(h))
        return None

    def fn(api: Any, *arrays: np.ndarray) -> list[np.ndarray]:
        hs = [
            F.broadcast_async(np.asarray(a), root_rank, name=n, process_set=process_set)
            for a, n in zip(arrays, names, strict=True)
        ]
        return [F.synchronize(h) for h in hs]

    values = _run(
        fn,
        [tf.convert_to_tensor(v) for v in vs],
        [tf.as_dtype(v.dtype).base_dtype for v in vs],
        "HorovodBroadcastVariables",
        False,
    )
    for v, x in zip(vs, values, strict=True):
        x.set_shape(v.shape)
    return [v.assign(x) for v, x in zip(vs, values, strict=True)]


# ------------------------------------------------------------------------------- alltoall, reducescatter
@_no_autograph
def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter slices of ``tensor`` (first dimension, ``splits`` rows per rank, even by default)
    to every rank and gather theirs; with ``splits`` also returns the received splits."""
    x = _dense(tensor)
    name = _graph_name("HorovodAlltoall", x, name)
    inputs = [x]
    if splits is not None:
        inputs.append(tf.cast(_dense(splits), tf.int32))

    @tf.custom_gradient
    def _op(*inputs: tf.Tensor) -> Any:
        def fn(api: Any, a: Any, s: Any = None) -> list[Any]:
            n = process_set.size() or 1
            if s is None and a.ndim and a.shape[0] % n == 0:
                s = np.full(n, a.shape[0] // n)  # even
            if s is None:  # not splittable evenly: the frontend says why
                return [api.alltoall(a, None, name=name, process_set=process_set), np.zeros(0)]
            sizes = [int(v) for v in s.tolist()]
            out, received = api.alltoall(a, sizes, name=name, process_set=process_set)
            return [out, np.asarray(received, np.int32)]

        out, received = _run(fn, list(inputs), [inputs[0].dtype, tf.int32], "HorovodAlltoall")
        out.set_shape([None] + list(inputs[0].shape[1:]))

        def grad(dy: tf.Tensor, _dreceived: Any = None) -> list[Any]:
            # as upstream: the gradient goes back to where its rows came from
            back = alltoall(
                dy, received, name=f"{name}.grad" if name else None, process_set=process_set
            )[0]
            return [back] + [None] * (len(inputs) - 1)

        return (out, received), grad

    out, received = _op(*inputs)
    return (out, received) if splits is not None else out


@_no_autograph
def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = None,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce over ranks, then give rank i the i-th block of rows (rank-order uneven split)."""
    return grouped_reducescatter(
        [tensor],
        compression=compression,
        op=op,
        name=name,
        process_set=process_set,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )[0]


@_no_autograph
def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[tf.Tensor]:
    from horovod.tensorflow.compression import Compression

    compression = compression or Compression.none
    if op not in (AVERAGE, SUM):
        raise ValueError("reducescatter supports only op=Average or op=Sum")
    packed = [compression.compress(_dense(t)) for t in tensors]
    if not packed:
        return []
    xs = [p[0] for p in packed]
    name = _graph_name("HorovodReducescatter", xs[0], name)

    @tf.custom_gradient
    def _op(*xs: tf.Tensor) -> Any:
        def fn(api: Any, *arrays: np.ndarray) -> list[np.ndarray]:
            return api.grouped_reducescatter(
                list(arrays),
                name=name,
                op=op,
                process_set=process_set,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
            )

        ys = _run(fn, list(xs), [x.dtype for x in xs], "HorovodReducescatter")
        for y, x in zip(ys, xs, strict=True):
            y.set_shape([None] + list(x.shape[1:]))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            # upstream's: the allgather of the gradient, times the set size for Sum, times
            # the scale factors (horovod.torch's too)
            scale = prescale_factor * postscale_factor
            if op == SUM:
                scale *= process_set.size() or 1
            gathered = [
                allgather(d, name=f"{name}.grad.{i}" if name else None, process_set=process_set)
                for i, d in enumerate(dys)
            ]
            return [g * tf.cast(scale, g.dtype) for g in gathered]

        return ys, grad

    ys = _op(*xs)
    return [compression.decompress(y, p[1]) for y, p in zip(ys, packed, strict=True)]


# ------------------------------------------------------------------------------- gradients
def reduce_gradients(
    sources: list[Any],
    grads: list[Any],
    *,
    op: int,
    compression: Any,
    predivide: float,
    sparse_as_dense: bool,
    process_set: ProcessSet,
    local_ids: set[int],
    scale_local: bool,
    name: str | None,
    postscale: float = 1.0,
) -> list[Any]:
    """Gradients reduced over ``process_set``: dense ones in one grouped allreduce, sparse
    ones as allgathers (unless ``sparse_as_dense``), local ones only scaled. ``postscale``
    multiplies the dense results (the sum of aggregated backward passes)."""
    ps = process_set
    if not ps.included() or ps.size() == 1:
        return grads
    n = ps.size()
    out: list[Any] = list(grads)
    dense_idx, dense = [], []
    for i, (s, g) in enumerate(zip(sources, grads, strict=True)):
        if g is None:
            continue
        if id(s) in local_ids:
            if scale_local:
                out[i] = g / tf.cast(n, g.dtype)
            continue
        if isinstance(g, tf.IndexedSlices):
            # (Adasum's coefficients need whole vectors: its sparse gradients go dense)
            if not sparse_as_dense and op != Adasum:
                out[i] = allreduce(
                    g, op=op, process_set=ps, name=f"{name}.sparse.{i}" if name else None
                )
                continue
            g = tf.convert_to_tensor(g)
        dense_idx.append(i)
        dense.append(g)
    if dense and getattr(compression, "exchange", False):
        # int8 / top-k / PowerSGD: the compressor's own exchange (its state per gradient)
        if op not in (Average, Sum):
            raise ValueError(f"compression {type(compression).__name__} needs op Average or Sum")
        key = name or "gradients"

        def exchange(api: Any, *arrays: np.ndarray) -> list[np.ndarray]:
            outs = compression.reduce(
                list(arrays), [f"{key}.{i}" for i in dense_idx], op, ps, name=key
            )
            return [o * postscale for o in outs] if postscale != 1.0 else outs

        reduced = _run(
            exchange, dense, [g.dtype for g in dense], "HorovodCompressedAllreduce", False
        )
        for i, r in zip(dense_idx, reduced, strict=True):
            out[i] = tf.reshape(r, tf.shape(grads[i]) if grads[i] is not None else r.shape)
        return out
    if dense:
        pre, post = 1.0, postscale
        if op == Average and predivide != 1.0:
            pre, post = 1.0 / predivide, predivide * postscale
        reduced = grouped_allreduce(
            dense,
            op=op,
            compression=compression,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=ps,
            name=name,
        )
        for i, r in zip(dense_idx, reduced, strict=True):
            out[i] = r
    return out


# ------------------------------------------------------------------------------- the rest
def join() -> int:
    """This rank has no more data; returns the rank that joined last."""
    return F.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    F.barrier(process_set)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    return F.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Callable[[Any], Any]:
    def fn(obj: Any) -> Any:
        return F.broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return fn


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    return F.allgather_object(obj, name=name, process_set=process_set)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(F.size() if process_set_id == 0 else _set(process_set_id).size())


def rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(F.rank())


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(F.local_size())


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(F.local_rank())


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(int(bool(_set(process_set_id).included())))


def _set(process_set_id: int) -> ProcessSet:
    ctx = _context.require()
    ps = ctx.public_sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"process set {process_set_id} does not exist")
    return ps
