"""``hvd.DistributedOptimizer``: averages gradients over ranks, overlapping communication with
the backward pass.

Parameters get a post-accumulate-grad hook. The moment autograd has accumulated a parameter's
gradient for the ``backward_passes_per_step``-th time, the hook submits an asynchronous
in-place allreduce of it (of its bucket, once the bucket is complete), so communication runs
while the rest of backward is still computing. The tail bucket, which backward completes last,
is reduced by ``step()`` itself (see ``_register_hooks``). ``step()`` waits only for what is
still in flight. Parameters whose gradient never appeared in a step (unused branches) are
reduced as zeros, so no rank waits for them.

Must not touch: the engine (it submits through ``mpi_ops`` and ``horovod.frontend``);
parameters' values (only their gradients).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.util import split_list
from horovod.torch.compression import Compression, NoneCompressor, _CastCompressor
from horovod.torch.mpi_ops import (
    Adasum,
    Average,
    allreduce_,
    allreduce_async_,
    allreduce_batch_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)

# Without buckets (HOROVOD_GRADIENT_BUCKET_BYTES=0, or a compressor that is not elementwise),
# ready gradients are queued and submitted together (each keeps its own name): at 8 MiB or 256
# tensors, whichever comes first, and at step(). Measured on 2 CPU ranks (docs/benchmarks.md):
# per-tensor submission reached half of DDP's throughput on a 200-tensor MLP; these batches
# reach DDP's, while large models still overlap communication with backward batch by batch.
FLUSH_BYTES = 8 << 20
FLUSH_COUNT = 256
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


def _elementwise(compression: Any) -> bool:
    """Compressors that act element by element (none, fp16, bf16) give the same result on a
    flat bucket as on each gradient; any other one is applied per gradient (no buckets)."""
    cls = compression if isinstance(compression, type) else type(compression)
    methods = (
        inspect.getattr_static(cls, "compress", None),
        inspect.getattr_static(cls, "decompress", None),
    )
    return any(
        methods == (vars(c)["compress"], vars(c)["decompress"])
        for c in (NoneCompressor, _CastCompressor)
    )


def _no_count(t: torch.Tensor) -> int:
    return -1


def _storage_count(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``t``'s memory."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# torch's count of references to a tensor's memory (private, but long-standing); without it,
# averages are copied back into the gradients instead of handed over as views of the bucket.
_use_count = _storage_count if hasattr(torch._C, "_storage_Use_Count") else _no_count


def _refs(views: list[torch.Tensor], i: int) -> int:
    v = views[i]
    return sys.getrefcount(v)


# What ``_refs`` and the map in ``_shared`` count for a view held by its list alone (measured,
# not assumed: the references an interpreter makes to call them may differ between versions).
_ALONE = _refs([torch.empty(0)], 0)
_ALONE_MAPPED = max(map(sys.getrefcount, [torch.empty(0)]))


def _shared(kept: tuple, grads: list[torch.Tensor]) -> bool:
    """Is the bucket's flat tensor held by anything that expects it not to change: another
    tensor over its memory (torch's count), or a reference to a view of it that is no longer
    its parameter's gradient (say a gradient of the last step that the caller kept)? A view
    still in ``p.grad`` was accumulated into in place, which its holders expect."""
    _, flat, views, count = kept
    if _use_count(flat) != count:
        return True
    if max(map(sys.getrefcount, views)) <= _ALONE_MAPPED:
        return False  # no view referenced from anywhere else (one pass in C)
    for i in range(len(views)):
        if grads[i] is not views[i] and _refs(views, i) > _ALONE:
            return True
    return False


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int = 1,
        op: int = Average,
        gradient_predivide_factor: float = 1.0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) for x in named):
                raise ValueError(
                    "named_parameters should be a sequence of tuples (name, "
                    "parameter), usually produced by model.named_parameters()."
                )
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(
                    "Parameter names in named_parameters must be unique. Found "
                    f"duplicates: {', '.join(dups)}"
                )
            known = {id(p) for _, p in named}
            unnamed = [id(p) for p in all_params if id(p) not in known]
            if unnamed:
                raise ValueError(
                    "named_parameters was specified, but one or more model "
                    "parameters were not named. Python object ids: "
                    f"{', '.join(map(str, unnamed))}"
                )
            self._names = {id(p): n for n, p in named}
        else:
            # Upstream's names (it restarts the count in every param group, so two groups
            # would share names; here the count runs over all groups).
            self._names = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(all_params)}
        # Upstream's mapping, which user code and tools read: parameter -> its name.
        self._parameter_names = {p: self._names[id(p)] for p in all_params}
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {id(p): backward_passes_per_step for p in all_params}
        self._handles: dict[int, tuple[Any, Any]] = {}  # id(p) -> (handle or None, ctx)
        self._densified: dict[int, int] = {}  # sparse gradients reduced dense: their sparse_dim
        self._params = {id(p): p for p in all_params}
        self._index = {id(p): i for i, p in enumerate(all_params)}
        self._requires_update: set[int] = set()
        self._loose_ids: list[int] | None = None  # _loose()
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: list[Any] = []
        self._pending: list[torch.Tensor] = []
        self._pending_bytes = 0
        self._flush_bytes, self._flush_count = FLUSH_BYTES, FLUSH_COUNT
        # Buckets (see _make_buckets): members (ids), names, gradients still to come this
        # step, what is in flight (handle, parameters, their gradients, the tensor sent,
        # compression ctx; () when the bucket's gradients went under their own names) and
        # buckets not submitted yet.
        self._buckets: list[list[int]] = []
        self._bucket_of: dict[int, int] = {}
        self._bucket_names: list[str] = []
        self._bucket_params: list[list[Any]] = []  # members (parameters)
        self._bucket_left: list[int] = []
        self._bucket_flight: list[Any] = []
        self._bucket_flat: list[Any] = []  # (members key, flat tensor, views, use count), kept
        self._tail: int | None = None  # the bucket reduced by synchronize() (see _register_hooks)
        # groups: id(p) -> group index; members in model order
        self._group_of: dict[int, int] = {}
        self._groups: list[list[int]] = []
        self._group_ready: dict[int, set[int]] = {}
        trainable = [p for p in all_params if p.requires_grad]
        if isinstance(groups, int) and groups > 0:
            chunks = [c for c in split_list(trainable, groups) if c]
            self._groups = [[id(p) for p in c] for c in chunks]
        elif groups is not None and not isinstance(groups, int):
            seen: set[int] = set()
            for g in groups:
                ids = []
                for p in g:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
                    ids.append(id(p))
                self._groups.append(ids)
        for gi, ids in enumerate(self._groups):
            for pid in ids:
                self._group_of[pid] = gi
        from horovod.core.context import require

        config = require().config
        elastic = config.elastic  # hooks even at size 1: the job may grow
        if process_set.included() and (F.size() > 1 or elastic):
            if config.gradient_bucket_bytes > 0 and _elementwise(compression):
                self._make_buckets(
                    [p for p in trainable if id(p) not in self._group_of],
                    config.gradient_bucket_bytes,
                )
            self._register_hooks()

    def _make_buckets(self, params: list[torch.Tensor], limit: int) -> None:
        """Fixed buckets of gradients, the same on every rank: parameters in reverse order
        (about the order in which backward produces their gradients), one dtype and device per
        bucket, up to ``limit`` bytes each (a larger parameter alone). A bucket's gradients go
        out as one flat tensor once all of them are ready, so the engine handles one tensor
        where it would handle dozens or hundreds (each costs Python work per step), and each
        gradient is copied once into the flat tensor and once back, by torch in C++."""
        open_: dict[tuple, int] = {}  # (dtype, device) -> index of the bucket being filled
        size: dict[int, int] = {}
        for p in reversed(params):
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            bi = open_.get(key)
            if bi is None or size[bi] + nbytes > limit:
                bi = open_[key] = len(self._buckets)
                self._buckets.append([])
                size[bi] = 0
            self._buckets[bi].append(id(p))
            size[bi] += nbytes
        for bi, ids in enumerate(self._buckets):
            first, last = self._names[ids[0]], self._names[ids[-1]]
            self._bucket_names.append(
                first if len(ids) == 1 else f"bucket.{bi}.{len(ids)}[{first}..{last}]"
            )
            for pid in ids:
                self._bucket_of[pid] = bi
            self._bucket_params.append([self._params[pid] for pid in ids])
        self._bucket_left = [len(ids) for ids in self._buckets]
        self._bucket_flight = [None] * len(self._buckets)
        self._bucket_flat = [None] * len(self._buckets)
        self._tail = len(self._buckets) - 1 if self._buckets else None

    # ----------------------------------------------------------------- hooks
    def _register_hooks(self) -> None:
        """A hook on every trainable parameter but those of the tail bucket: the last one
        built, which holds the model's first parameters, whose gradients backward produces
        last. Nothing is left to overlap it with once they are ready, so ``synchronize()``
        reduces it (synchronously: with nothing else in flight, the engine's express way),
        and hooks on its parameters would only cost autograd a call into Python each (on a
        model of 200 small tensors, about as long as copying its gradients). One of them
        keeps its hook, so that ``zero_grad()`` between backward and ``step()`` and more
        backward passes than ``backward_passes_per_step`` are still refused."""
        tail = self._bucket_params[self._tail][1:] if self._tail is not None else []
        quiet = set(map(id, tail))
        for p in self._params.values():
            if p.requires_grad:
                self._requires_update.add(id(p))
                if id(p) not in quiet:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_hook(self) -> Any:
        def hook(p: torch.Tensor) -> None:
            pid = id(p)
            delay = self._delay[pid]
            if delay <= 0:  # already reduced (or queued) since the last step()
                raise AssertionError(_TOO_MANY_PASSES)
            self._delay[pid] = delay - 1
            bi = self._bucket_of.get(pid)
            if bi is not None:
                if delay == 1:  # its last pass: one more gradient of the bucket is ready
                    left = self._bucket_left[bi] = self._bucket_left[bi] - 1
                    if left == 0 and bi != self._tail:
                        self._submit_bucket(bi)
                return
            if delay > 1:  # still accumulating locally
                self._handles[pid] = (None, None)
                return
            gi = self._group_of.get(pid)
            if gi is None:
                self._queue(p)
                return
            ready = self._group_ready.setdefault(gi, set())
            ready.add(pid)
            if len(ready) == len(self._groups[gi]):
                self._submit_group(gi)

        return hook

    def _scales(self) -> tuple[float, float]:
        if self._op == Average:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _queue(self, p: torch.Tensor) -> None:
        """Queue a ready gradient; the queue is submitted as one batch of independently named
        allreduces once it holds FLUSH_BYTES or FLUSH_COUNT gradients (and at synchronize()).
        One engine call per batch instead of per tensor; batch composition may differ between
        ranks, since every tensor keeps its own name."""
        pid = id(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            self._handles[pid] = self._allreduce_grad_async(p)
            return
        self._handles[pid] = (None, "queued")
        self._pending.append(p)
        self._pending_bytes += p.grad.numel() * p.grad.element_size()
        if self._pending_bytes >= self._flush_bytes or len(self._pending) >= self._flush_count:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        packed = [self._compression.compress(p.grad) for p in pending]
        pre, post = self._scales()
        handle = allreduce_batch_async_(
            [c for c, _ in packed],
            [self._names[id(p)] for p in pending],
            op=self._op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        )
        token = ("batch", handle)
        for p, (compressed, ctx) in zip(pending, packed, strict=True):
            self._handles[id(p)] = (token, (ctx, compressed))

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        name = self._names.get(id(p))
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                handle = sparse_allreduce_async(grad, f"sparse.{name}", self._op, self._process_set)
                return handle, ("sparse", grad)
            grad = self._densify(p)
        compressed, ctx = self._compression.compress(grad)
        pre, post = self._scales()
        handle = allreduce_async_(
            compressed,
            name=name,
            op=self._op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        )
        return handle, (ctx, compressed)

    def _submit_bucket(self, bi: int, now: bool = False) -> None:
        """Submit bucket ``bi``: its dense gradients copied into the bucket's flat tensor and
        reduced under the bucket's name (a gradient alone goes under its own name); sparse
        ones each on their own (or densified first, with ``sparse_as_dense``). Missing
        gradients (unused parameters) count as zeros. What a bucket holds depends on the model
        only, so every rank submits the same. ``now``: reduce the flat tensor synchronously
        (the engine's express way when nothing else is in flight)."""
        members = self._bucket_params[bi]
        grads = [p.grad for p in members]
        dense = members
        if any(g is None or g.is_sparse for g in grads):
            dense = []
            for p in members:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif p.grad.is_sparse:
                    if not self._sparse_as_dense:
                        self._handles[id(p)] = self._allreduce_grad_async(p)
                        continue
                    self._densify(p)
                dense.append(p)
            grads = [p.grad for p in dense]
        if len(grads) < 2:
            for p in dense:
                self._handles[id(p)] = self._allreduce_grad_async(p)
            self._bucket_flight[bi] = ()
            return
        # (torch keeps every gradient in its parameter's shape, dtype and device)
        key = None if dense is members else tuple(map(id, dense))
        kept = self._bucket_flat[bi]
        if kept is None or kept[0] != key or _shared(kept, grads):
            # The bucket's flat tensor, kept from step to step (a fresh one would cost the
            # page faults of new memory every step), and a view of it per gradient. A new
            # one when anything but these views still holds the old one's memory (say a
            # gradient of the last step kept by the caller): what it sees must not change.
            flat = torch.empty(
                sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device
            )
            views = _unflatten_dense_tensors(flat, grads)
            kept = self._bucket_flat[bi] = (key, flat, views, _use_count(flat))
        _, flat, views, _ = kept
        if not all(g is v for g, v in zip(grads, views, strict=True)):
            torch._foreach_copy_(views, grads)  # else accumulated in place (not set to None)
        compressed, ctx = self._compression.compress(flat)
        pre, post = self._scales()
        args: dict[str, Any] = dict(
            name=self._bucket_names[bi],
            op=self._op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        )
        handle: int | None = None  # None: done
        if now:
            allreduce_(compressed, **args)
        else:
            handle = allreduce_async_(compressed, **args)
        self._bucket_flight[bi] = (handle, dense, grads, compressed, ctx)

    def _finish_bucket(self, bi: int) -> None:
        """Wait for bucket ``bi`` and hand the averages to its parameters: each ``p.grad``
        becomes its view of the flat tensor (no copy back); gradients that are part of a
        graph (``create_graph=True``) get the averages copied into them instead."""
        handle, dense, grads, compressed, ctx = self._bucket_flight[bi]
        if handle is not None:
            synchronize(handle)
        _, flat, views, _ = self._bucket_flat[bi]
        out = self._compression.decompress(compressed, ctx)
        if out is not flat:
            flat.copy_(out)
        if _use_count is _no_count:
            torch._foreach_copy_(grads, views)
            return
        for p, g, v in zip(dense, grads, views, strict=True):
            if g is not v:
                if g.requires_grad or p.grad is not g:
                    g.copy_(v)
                else:
                    p.grad = v

    def _submit_group(self, gi: int) -> None:
        members = [self._params[pid] for pid in self._groups[gi]]
        grads = []
        ctxs = []
        for p in members:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            compressed, ctx = self._compression.compress(p.grad)
            grads.append(compressed)
            ctxs.append((ctx, compressed))
        pre, post = self._scales()
        handle = grouped_allreduce_async_(
            grads,
            name=self._names.get(id(members[0])),
            op=self._op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        )
        for p, c in zip(members, ctxs, strict=True):
            self._handles[id(p)] = (("group", gi, handle), c)
        self._group_ready.pop(gi, None)

    # ----------------------------------------------------------------- public
    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for pid in self._delay:
            self._delay[pid] = passes

    def synchronize(self) -> None:
        """Finish every gradient allreduce and write the averages into ``p.grad``."""
        if not self._process_set.included():
            self._synchronized = True
            return
        # This thread waits for what it submits here right below and runs the engine itself
        # meanwhile: waking the engine thread would only have the two fight over the GIL.
        with F.waited():
            # Gradients that never arrived (unused parameters) and partially accumulated ones.
            for pid in self._loose():
                entry = self._handles.get(pid)
                if entry is None or (entry[0] is None and entry[1] != "queued"):
                    self._queue(self._params[pid])
            self._flush()
            tail = self._tail
            for bi, flight in enumerate(self._bucket_flight):
                if flight is None and bi != tail:  # gradients missing (unused, or still
                    self._submit_bucket(bi)  # accumulating)
            for gi in range(len(self._groups)):
                if any(
                    self._handles.get(pid, (None,))[0] is None
                    for pid in self._groups[gi]
                    if pid in self._requires_update
                ):
                    self._submit_group(gi)
            if tail is not None:
                # The tail bucket, synchronously: after the submissions above (in flight
                # meanwhile; the express way is not taken then), before waiting for anything.
                self._submit_bucket(tail, now=True)
        done: dict[Any, Any] = {}
        for pid, (handle, ctx) in list(self._handles.items()):
            p = self._params[pid]
            if isinstance(handle, tuple) and handle and handle[0] in ("group", "batch"):
                key = handle[:2]
                if key not in done:
                    done[key] = synchronize(handle[-1])
                self._write_grad(p, ctx)
            elif isinstance(ctx, tuple) and ctx and ctx[0] == "sparse":
                p.grad = handle()
            else:
                synchronize(handle)
                self._write_grad(p, ctx)
            self._delay[pid] = self.backward_passes_per_step
        self._handles.clear()
        if self._buckets:
            for bi, flight in enumerate(self._bucket_flight):
                if flight:  # flat (() when its gradients went under their own names)
                    self._finish_bucket(bi)
            self._delay.update(dict.fromkeys(self._bucket_of, self.backward_passes_per_step))
            self._reset_buckets()
        for pid, sparse_dim in self._densified.items():
            p = self._params[pid]
            assert p.grad is not None
            p.grad = p.grad.to_sparse(sparse_dim).coalesce()
        self._densified.clear()
        self._synchronized = True

    def _loose(self) -> list[int]:
        """Trainable parameters in neither a bucket nor a group, in model order."""
        if self._loose_ids is None:
            self._loose_ids = [
                pid
                for pid in sorted(self._requires_update, key=self._index.__getitem__)
                if pid not in self._group_of and pid not in self._bucket_of
            ]
        return self._loose_ids

    def _reset_buckets(self) -> None:
        for bi, ids in enumerate(self._buckets):
            self._bucket_left[bi] = len(ids)
            self._bucket_flight[bi] = None

    def _densify(self, p: torch.Tensor) -> torch.Tensor:
        """``sparse_as_dense``: reduce this sparse gradient as a dense one; ``synchronize``
        gives it back sparse (an optimizer such as SparseAdam takes only sparse gradients)."""
        assert p.grad is not None
        self._densified[id(p)] = p.grad.sparse_dim()
        p.grad = p.grad.to_dense()
        return p.grad

    def _write_grad(self, p: torch.Tensor, ctx: Any) -> None:
        cctx, compressed = ctx
        if compressed is not p.grad:
            p.grad.copy_(self._compression.decompress(compressed, cctx))  # type: ignore[union-attr]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` yourself
        first, e.g. to clip or unscale gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if (
            self._pending
            or any(h is not None for h, _ in self._handles.values())
            or any(left < len(b) for left, b in zip(self._bucket_left, self._buckets, strict=True))
        ):
            raise AssertionError(_ZERO_GRAD_RACE)
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict) -> None:
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]
        self._handles.clear()
        self._group_ready.clear()
        self._reset_buckets()
        self._pending, self._pending_bytes = [], 0
        self._synchronized = False
        for pid in self._delay:
            self._delay[pid] = self.backward_passes_per_step


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,  # noqa: N802 - upstream's name
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Returns an object of a subclass of the optimizer's own class (same class name), built over
    the same parameter groups.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if getattr(compression, "exchange", False):
        # int8 / top-k / PowerSGD: the compressor runs the exchange at synchronize()
        from horovod.torch.compressed_optimizer import compressed_optimizer

        if op not in (Average, F.Sum):
            raise ValueError(
                f"compression={type(compression).__name__} works with op=hvd.Average or hvd.Sum"
            )
        return compressed_optimizer(optimizer, named_parameters, compression, op, process_set)
    if op == Adasum and (process_set.size() or 1) > 1:
        # upstream's delta optimizer: Adasum of the parameters' changes after a local step
        from horovod.torch.adasum_optimizer import adasum_optimizer

        return adasum_optimizer(optimizer, compression, process_set)
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if groups is not None and not (
        (isinstance(groups, int) and groups > 0)
        or (
            isinstance(groups, Sequence)
            and not isinstance(groups, str)
            and all(isinstance(g, Sequence) for g in groups)
        )
    ):
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor."
        )
    cls = type(
        optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__)
    )
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
