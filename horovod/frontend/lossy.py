"""Lossy gradient compressors that change what is exchanged, not only its type:
``Compression.int8``, ``Compression.topk(ratio)`` and ``Compression.powersgd(rank)``, with
error feedback, on NumPy arrays (the frameworks hand theirs over as arrays).

Unlike ``fp16`` (compress, allreduce, decompress), these cannot be summed on the wire as they
are, so a compressor runs the whole exchange itself (``reduce``):

- ``int8``: each rank scales every bucket of ``bucket`` elements by its largest magnitude to
  [-127, 127] and rounds; the int8 values and the float32 scales of all ranks are allgathered
  and every rank decodes and sums them. 1 byte per element and rank (plus a scale per bucket)
  instead of the ring's ~8 (n-1)/n: a gain up to about 8 ranks.
- ``topk(ratio)``: per tensor, the ``ceil(ratio * size)`` largest magnitudes are sent as
  values (float32) and indices (int32) and allgathered, never densified on the wire; every rank
  adds them into a dense result.
- ``powersgd(rank)`` (Vogels et al., 2019): each matrix (a tensor of 2 or more dimensions,
  seen as ``shape[0] x rest``) M becomes P Q^T: P = M Q is averaged over the ranks and
  orthonormalised, Q = M^T P is averaged, with Q kept from the last step (warm start; the first
  Q is the same random matrix on every rank). Vectors and matrices too small to gain are
  averaged exactly, in the same allreduce as P. Two grouped allreduces per step.

**Error feedback**: what a rank's compressed gradient leaves out (its ``residual``) is added
to its next gradient of the same name before compressing, so nothing is lost, only delayed.
The first ``warmup_steps`` exchanges of a name are exact. The residuals and PowerSGD's Q are
kept per name; they are dropped when the process set's size changes (an elastic reset: the
averages of the old membership no longer apply) or on ``reset()``.

Every rank decodes the same bytes in the same order, so results are bitwise identical.

Must not touch: the engine (it uses the public collectives).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.common.blas import one_blas_thread
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.frontend.arguments import Average, Sum

BUCKET = 4096


class ExchangeCompressor:
    """The base of the lossy compressors (module docstring)."""

    exchange = True  # tells the frontends to call ``reduce`` instead of an allreduce
    kind = "exchange"

    def __init__(self, warmup_steps: int = 0, error_feedback: bool = True) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"Compression.{self.kind}: warmup_steps must be an int >= 0, got {warmup_steps!r}"
            )
        self.warmup_steps = warmup_steps
        self.error_feedback = error_feedback
        self.residuals: dict[str, np.ndarray] = {}
        self.calls: dict[str, int] = {}
        self._size: int | None = None
        self._shapes: list[tuple[int, int] | None] = []

    # upstream's interface, for code that calls it directly: nothing to do on one array
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor

    def fresh(self) -> ExchangeCompressor:
        """A compressor with the same settings and no state (one per optimizer)."""
        raise NotImplementedError

    def __call__(self, **kwargs: Any) -> ExchangeCompressor:
        return type(self)(**{**self.settings(), **kwargs})

    def settings(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "error_feedback": self.error_feedback}

    def reset(self) -> None:
        self.residuals.clear()
        self.calls.clear()

    # ------------------------------------------------------------------ the exchange
    def reduce(
        self,
        arrays: Sequence[np.ndarray],
        names: Sequence[str],
        op: int = Average,
        process_set: ProcessSet = global_process_set,
        name: str = "compressed",
    ) -> list[np.ndarray]:
        """The ``op`` (Average or Sum) of every rank's ``arrays`` (floating point), compressed
        on the way; new arrays of the inputs' shapes and types."""
        if op not in (Average, Sum):
            raise ValueError(f"Compression.{self.kind}: only op=hvd.Average or hvd.Sum, got {op}")
        for a, key in zip(arrays, names, strict=True):
            if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
                raise TypeError(
                    f"Compression.{self.kind} compresses floating-point gradients; {key!r} is "
                    f"{a.dtype.name}: leave integer tensors uncompressed"
                )
        n = process_set.size() or 1
        if n != self._size:
            self.reset()
            self._size = n
        inputs = []
        exact = []
        for a, key in zip(arrays, names, strict=True):
            x = np.asarray(a, dtype=np.float32).reshape(-1)
            self.calls[key] = self.calls.get(key, 0) + 1
            exact.append(self.calls[key] <= self.warmup_steps)
            if self.error_feedback and key in self.residuals and not exact[-1]:
                x = x + self.residuals[key]
            inputs.append(x)
        summed = self._exchange(inputs, list(names), exact, n, process_set, name)
        out = []
        for a, s in zip(arrays, summed, strict=True):
            if op == Average:
                s = s / n
            out.append(s.astype(a.dtype, copy=False).reshape(a.shape))
        return out

    def _keep(self, key: str, sent_local: np.ndarray, x: np.ndarray) -> None:
        """Error feedback: what of ``x`` this rank's compressed form left out."""
        if self.error_feedback:
            self.residuals[key] = x - sent_local

    def _exchange(
        self,
        xs: list[np.ndarray],
        keys: list[str],
        exact: list[bool],
        n: int,
        ps: ProcessSet,
        name: str,
    ) -> list[np.ndarray]:
        """The sums over the ranks of ``xs`` (float32, flat), compressed where not ``exact``."""
        raise NotImplementedError


def _span(row: str, what: str, t0: float) -> None:
    """Show ``what`` (COMPRESS, DECOMPRESS) from ``t0`` until now on the timeline's ``row``."""
    from horovod.core.context import current

    ctx = current()
    tl = getattr(ctx, "timeline", None) if ctx is not None else None
    if tl is not None:
        tl.span(row, what, t0, time.monotonic())


def _allgather_bytes(payload: np.ndarray, ps: ProcessSet, name: str) -> list[np.ndarray]:
    """Every rank's ``payload`` (uint8; the same length on every rank), in rank order."""
    from horovod.frontend.collectives import allgather

    data = allgather(payload, name=name, process_set=ps)
    n = data.size // payload.size if payload.size else (ps.size() or 1)
    return [data[r * payload.size : (r + 1) * payload.size] for r in range(n)]


def _exact_sums(xs: list[np.ndarray], ps: ProcessSet, name: str) -> list[np.ndarray]:
    from horovod.frontend.collectives import grouped_allreduce

    if not xs:
        return []
    return grouped_allreduce(xs, op=Sum, name=name, process_set=ps)


class Gathered(ExchangeCompressor):
    """A compressor whose encoded tensors are allgathered and decoded by every rank: it
    gives ``encode`` (one tensor to byte arrays, keeping its residual), ``payload`` (bytes of
    one encoded tensor) and ``add_decoded`` (add one rank's encoded tensor into a sum)."""

    def encode(self, x: np.ndarray, key: str) -> list[np.ndarray]:
        raise NotImplementedError

    def payload(self, size: int) -> int:
        raise NotImplementedError

    def add_decoded(self, blob: np.ndarray, size: int, into: np.ndarray) -> None:
        raise NotImplementedError

    def _exchange(
        self,
        xs: list[np.ndarray],
        keys: list[str],
        exact: list[bool],
        n: int,
        ps: ProcessSet,
        name: str,
    ) -> list[np.ndarray]:
        tag = self.kind.upper()
        t0 = time.monotonic()
        parts = [
            part
            for x, key, ex in zip(xs, keys, exact, strict=True)
            if not ex
            for part in self.encode(x, key)
        ]
        _span(name, f"COMPRESS_{tag}", t0)
        out: list[np.ndarray | None] = [None] * len(xs)
        if parts:
            gathered = _allgather_bytes(np.concatenate(parts), ps, f"{name}.{self.kind}")
            t0 = time.monotonic()
            for i, (x, ex) in enumerate(zip(xs, exact, strict=True)):
                if not ex:
                    out[i] = np.zeros(x.size, np.float32)
            for blob in gathered:  # every rank decodes the same bytes in rank order
                off = 0
                for x, ex, total in zip(xs, exact, out, strict=True):
                    if ex:
                        continue
                    size = self.payload(x.size)
                    self.add_decoded(blob[off : off + size], x.size, total)  # type: ignore[arg-type]
                    off += size
            _span(name, f"DECOMPRESS_{tag}", t0)
        exact_idx = [i for i, ex in enumerate(exact) if ex]
        sums = _exact_sums([xs[i] for i in exact_idx], ps, f"{name}.exact")
        for i, total in zip(exact_idx, sums, strict=True):
            out[i] = total
        return out  # type: ignore[return-value]  # (every entry filled)


class Int8(Gathered):
    """int8 values with a float32 scale per bucket of ``bucket`` elements (module docstring)."""

    kind = "int8"

    def __init__(self, bucket: int = BUCKET, warmup_steps: int = 0, error_feedback: bool = True):
        super().__init__(warmup_steps, error_feedback)
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"Compression.int8: bucket must be an int >= 1, got {bucket!r}")
        self.bucket = bucket

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "bucket": self.bucket}

    def fresh(self) -> Int8:
        return Int8(**self.settings())

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 values, float32 scale per bucket)."""
        nb = -(-x.size // self.bucket)
        padded = np.zeros(nb * self.bucket, np.float32)
        padded[: x.size] = x
        blocks = padded.reshape(nb, self.bucket)
        scales = (np.abs(blocks).max(axis=1) / 127.0).astype(np.float32)
        scales[scales == 0] = 1.0
        q = np.rint(blocks / scales[:, None]).astype(np.int8)
        return q.reshape(-1)[: x.size], scales

    def dequantize(self, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
        nb = scales.size
        padded = np.zeros(nb * self.bucket, np.float32)
        padded[: q.size] = q
        return (padded.reshape(nb, self.bucket) * scales[:, None]).reshape(-1)[: q.size]

    def encode(self, x: np.ndarray, key: str) -> list[np.ndarray]:
        q, scales = self.quantize(x)
        self._keep(key, self.dequantize(q, scales), x)
        return [q.view(np.uint8), scales.view(np.uint8)]

    def payload(self, size: int) -> int:
        return size + 4 * -(-size // self.bucket)

    def add_decoded(self, blob: np.ndarray, size: int, into: np.ndarray) -> None:
        into += self.dequantize(blob[:size].view(np.int8), blob[size:].view(np.float32))


class TopK(Gathered):
    """The largest ``ratio`` of each tensor's entries, as values and indices (docstring)."""

    kind = "topk"

    def __init__(self, ratio: float = 0.01, warmup_steps: int = 0, error_feedback: bool = True):
        super().__init__(warmup_steps, error_feedback)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"Compression.topk: ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "ratio": self.ratio}

    def fresh(self) -> TopK:
        return TopK(**self.settings())

    def k(self, size: int) -> int:
        return min(size, max(1, math.ceil(self.ratio * size))) if size else 0

    def encode(self, x: np.ndarray, key: str) -> list[np.ndarray]:
        k = self.k(x.size)
        idx = np.argpartition(np.abs(x), x.size - k)[x.size - k :] if k else np.zeros(0, int)
        idx = np.sort(idx).astype(np.int32)
        vals = x[idx].astype(np.float32)
        sent = np.zeros_like(x)
        sent[idx] = vals
        self._keep(key, sent, x)
        return [vals.view(np.uint8), idx.view(np.uint8)]

    def payload(self, size: int) -> int:
        return 8 * self.k(size)

    def add_decoded(self, blob: np.ndarray, size: int, into: np.ndarray) -> None:
        half = blob.size // 2
        into[blob[half:].view(np.int32)] += blob[:half].view(np.float32)  # distinct indices


class PowerSGD(ExchangeCompressor):
    """Rank-``rank`` approximations of the gradient matrices, warm-started (docstring)."""

    kind = "powersgd"

    def __init__(self, rank: int = 2, warmup_steps: int = 0, error_feedback: bool = True):
        super().__init__(warmup_steps, error_feedback)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"Compression.powersgd: rank must be an int >= 1, got {rank!r}")
        self.rank = rank
        self.qs: dict[str, np.ndarray] = {}

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "rank": self.rank}

    def fresh(self) -> PowerSGD:
        return PowerSGD(**self.settings())

    def reset(self) -> None:
        super().reset()
        self.qs.clear()

    def matrix_shape(self, shape_key: tuple[int, int]) -> bool:
        rows, cols = shape_key
        r = self.rank
        return min(rows, cols) > r and (rows + cols) * r < rows * cols

    def _exchange(
        self,
        xs: list[np.ndarray],
        keys: list[str],
        exact: list[bool],
        n: int,
        ps: ProcessSet,
        name: str,
    ) -> list[np.ndarray]:
        shapes: dict[int, tuple[int, int]] = {}
        for i, (ex, s) in enumerate(zip(exact, self._shapes, strict=True)):
            if not ex and s is not None and self.matrix_shape(s):
                shapes[i] = s
        low = sorted(shapes)
        rest = [i for i in range(len(xs)) if i not in shapes]
        ms = {i: xs[i].reshape(shapes[i]) for i in low}
        qs = {i: self._q(keys[i], shapes[i][1]) for i in low}
        t0 = time.monotonic()
        with one_blas_thread():
            ps_ = [ms[i] @ qs[i] for i in low]
        _span(name, "COMPRESS_POWERSGD_P", t0)
        first = _exact_sums(ps_ + [xs[i] for i in rest], ps, f"{name}.powersgd.p")
        out: list[np.ndarray | None] = [None] * len(xs)
        for i, total in zip(rest, first[len(low) :], strict=True):
            out[i] = total
        if not low:
            return out  # type: ignore[return-value]  # (every entry filled)
        t0 = time.monotonic()
        with one_blas_thread():
            pmats = [_orthonormal(p / n) for p in first[: len(low)]]
            qmats = [ms[i].T @ p for i, p in zip(low, pmats, strict=True)]
        _span(name, "COMPRESS_POWERSGD_Q", t0)
        second = _exact_sums(qmats, ps, f"{name}.powersgd.q")
        t0 = time.monotonic()
        with one_blas_thread():
            for i, p, q_sum, q_local in zip(low, pmats, second, qmats, strict=True):
                approx_sum = p @ q_sum.T  # the sum over ranks of their approximations
                self.qs[keys[i]] = q_sum / n
                self._keep(keys[i], (p @ q_local.T).reshape(-1), xs[i])
                out[i] = approx_sum.reshape(-1)
        _span(name, "DECOMPRESS_POWERSGD", t0)
        return out  # type: ignore[return-value]  # (every entry filled)

    def _q(self, key: str, cols: int) -> np.ndarray:
        q = self.qs.get(key)
        if q is None or q.shape != (cols, self.rank):
            seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
            q = np.random.default_rng(seed).standard_normal((cols, self.rank)).astype(np.float32)
        return q

    def reduce(
        self,
        arrays: Sequence[np.ndarray],
        names: Sequence[str],
        op: int = Average,
        process_set: ProcessSet = global_process_set,
        name: str = "compressed",
    ) -> list[np.ndarray]:
        self._shapes = [
            (a.shape[0], int(np.prod(a.shape[1:]))) if a.ndim >= 2 else None for a in arrays
        ]
        return super().reduce(arrays, names, op, process_set, name)


def _orthonormal(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns of ``p`` in float64 (the same bits on every rank)."""
    m = p.astype(np.float64)
    for j in range(m.shape[1]):
        for i in range(j):
            m[:, j] -= (m[:, i] @ m[:, j]) * m[:, i]
        norm = np.linalg.norm(m[:, j])
        m[:, j] = m[:, j] / norm if norm > 1e-12 else 0.0
    return m.astype(np.float32)
