"""Every collective at world sizes 1, 2, 3 and 5, with rank-dependent inputs and expectations
computed from formulas."""

import math

import numpy as np
import pytest
from conftest import ALL_DTYPES, LENGTHS, NUMERIC, rank_data

import horovod.numpy as hvd
from horovod.common.dtypes import BFLOAT16
from horovod.testing import run_ranks


def expected_reduce(size, n, dtype, op):
    parts = [rank_data(r, n, np.float64) for r in range(size)]
    if op == hvd.Sum:
        return sum(parts)
    if op == hvd.Average:
        return sum(parts) / size
    if op == hvd.Min:
        return np.minimum.reduce(parts)
    if op == hvd.Max:
        return np.maximum.reduce(parts)
    return np.multiply.reduce(parts)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_ops(size, n, op):
    dtype = np.float64
    if op == hvd.Product:
        n = min(n, 17)

    def body(rank):
        return hvd.allreduce(rank_data(rank, n, dtype), op=op, name="x")

    want = expected_reduce(size, n, dtype, op)
    for got in run_ranks(body, size):
        assert got.dtype == dtype and got.shape == (n,)
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize(
    "dtype", NUMERIC + ([BFLOAT16] if BFLOAT16 is not None else []), ids=lambda d: np.dtype(d).name
)
def test_allreduce_dtypes_sum(size, dtype):
    def body(rank):
        return hvd.allreduce(rank_data(rank, 17, dtype), op=hvd.Sum)

    want = expected_reduce(size, 17, dtype, hvd.Sum).astype(dtype)
    for got in run_ranks(body, size):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


def test_allreduce_identical_bits_on_every_rank():
    """Float sums of random data must be bitwise identical everywhere (one reduction order)."""

    def body(rank):
        x = np.random.default_rng(rank).standard_normal(200_003).astype(np.float32)
        return hvd.allreduce(x, op=hvd.Sum)

    results = run_ranks(body, 3)
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()


def test_allreduce_bool_min_max(size):
    def body(rank):
        a = np.array([True, rank == 0, rank % 2 == 1, False])
        return hvd.allreduce(a, op=hvd.Min), hvd.allreduce(a, op=hvd.Max)

    rows = [np.array([True, r == 0, r % 2 == 1, False]) for r in range(size)]
    for mn, mx in run_ranks(body, size):
        np.testing.assert_array_equal(mn, np.logical_and.reduce(rows))
        np.testing.assert_array_equal(mx, np.logical_or.reduce(rows))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
def test_prescale_postscale(size, dtype):
    pre, post = 0.5, 3.0

    def body(rank):
        return hvd.allreduce(
            rank_data(rank, 17, dtype), op=hvd.Average, prescale_factor=pre, postscale_factor=post
        )

    for got in run_ranks(body, size):
        if np.dtype(dtype).kind == "i":
            # upstream: integers are scaled in float64 and truncated toward zero at each step
            parts = [np.trunc(rank_data(r, 17, np.float64) * pre) for r in range(size)]
            want = np.trunc(sum(parts) * (post / size))
            np.testing.assert_array_equal(got, want.astype(dtype))
        else:
            want = sum(rank_data(r, 17, np.float64) for r in range(size)) * pre * post / size
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3)


def test_allreduce_in_place_and_async(size):
    def body(rank):
        a = rank_data(rank, 17, np.float32)
        out = hvd.allreduce_(a, op=hvd.Sum)
        assert out is a
        h = hvd.allreduce_async(rank_data(rank, 5, np.float32), op=hvd.Max)
        h2 = hvd.allreduce_async_(b := rank_data(rank, 5, np.float32), op=hvd.Min)
        return a, hvd.synchronize(h), hvd.synchronize(h2), b

    want = expected_reduce(size, 17, np.float32, hvd.Sum)
    for a, mx, mn, b in run_ranks(body, size):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(mx, expected_reduce(size, 5, np.float32, hvd.Max))
        np.testing.assert_array_equal(mn, expected_reduce(size, 5, np.float32, hvd.Min))
        assert mn is b


def test_allreduce_leaves_input_untouched():
    def body(rank):
        a = rank_data(rank, 17, np.float64)
        before = a.copy()
        hvd.allreduce(a)
        return np.array_equal(a, before)

    assert all(run_ranks(body, 3))


@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (2, 0, 3)])
def test_allreduce_shapes(shape):
    n = math.prod(shape)

    def body(rank):
        return hvd.allreduce(rank_data(rank, n, np.float32, shape), op=hvd.Sum)

    want = expected_reduce(3, n, np.float32, hvd.Sum).reshape(shape)
    for got in run_ranks(body, 3):
        assert got.shape == shape
        np.testing.assert_array_equal(got, want)


def test_grouped_allreduce(size):
    def body(rank):
        ts = [rank_data(rank, n, np.float64) for n in (1, 17, 0, 300)]
        out = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp")
        inplace = [t.copy() for t in ts]
        res = hvd.grouped_allreduce_(inplace, op=hvd.Average)
        assert all(a is b for a, b in zip(res, inplace, strict=False))
        h = hvd.grouped_allreduce_async(ts, op=hvd.Max)
        return out, inplace, hvd.synchronize(h)

    for out, avg, mx in run_ranks(body, size):
        for n, o, a, m in zip((1, 17, 0, 300), out, avg, mx, strict=False):
            np.testing.assert_array_equal(o, expected_reduce(size, n, np.float64, hvd.Sum))
            np.testing.assert_allclose(a, expected_reduce(size, n, np.float64, hvd.Average))
            np.testing.assert_array_equal(m, expected_reduce(size, n, np.float64, hvd.Max))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_uneven(size, dtype):
    def body(rank):
        rows = rank * 2 + (1 if rank % 2 else 0)  # 0, 3, 4, 7, 8 rows: includes empty
        return hvd.allgather(rank_data(rank, rows * 3, dtype, (rows, 3)))

    want = np.concatenate(
        [rank_data(r, (r * 2 + r % 2) * 3, dtype, (r * 2 + r % 2, 3)) for r in range(size)]
    )
    for got in run_ranks(body, size):
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_allgather_large_and_grouped(size):
    def body(rank):
        big = rank_data(rank, 50_000 + rank, np.float32)
        small = rank_data(rank, 2 * (rank + 1), np.int64, (rank + 1, 2))
        return hvd.allgather(big), hvd.grouped_allgather([small, big])

    want_big = np.concatenate([rank_data(r, 50_000 + r, np.float32) for r in range(size)])
    want_small = np.concatenate(
        [rank_data(r, 2 * (r + 1), np.int64, (r + 1, 2)) for r in range(size)]
    )
    for big, (g_small, g_big) in run_ranks(body, size):
        np.testing.assert_array_equal(big, want_big)
        np.testing.assert_array_equal(g_small, want_small)
        np.testing.assert_array_equal(g_big, want_big)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", LENGTHS)
def test_broadcast(size, dtype, n):
    root = size - 1

    def body(rank):
        a = rank_data(rank, n, dtype)
        b = hvd.broadcast(a, root_rank=root)
        c = rank_data(rank, n, dtype)
        hvd.broadcast_(c, root_rank=0)
        return b, c, np.array_equal(a, rank_data(rank, n, dtype))

    for b, c, untouched in run_ranks(body, size):
        np.testing.assert_array_equal(b, rank_data(root, n, dtype))
        np.testing.assert_array_equal(c, rank_data(0, n, dtype))
        assert untouched


def test_alltoall_with_splits(size):
    # rank r sends (r + p) % 3 rows to rank p; row values encode (sender, receiver)
    def splits_of(r):
        return [(r + p) % 3 for p in range(size)]

    def body(rank):
        sp = splits_of(rank)
        rows = (
            np.concatenate([np.full((k, 2), 100 * rank + p, np.int32) for p, k in enumerate(sp)])
            if sum(sp)
            else np.zeros((0, 2), np.int32)
        )
        return hvd.alltoall(rows, splits=sp)

    for rank, (out, received) in enumerate(run_ranks(body, size)):
        assert received.dtype == np.int32
        assert received.tolist() == [splits_of(s)[rank] for s in range(size)]
        want = [np.full((splits_of(s)[rank], 2), 100 * s + rank, np.int32) for s in range(size)]
        np.testing.assert_array_equal(out, np.concatenate(want))


def test_alltoall_even_without_splits(size):
    def body(rank):
        return hvd.alltoall(np.arange(size * 2, dtype=np.float64) + 10 * rank)

    for rank, out in enumerate(run_ranks(body, size)):
        want = np.concatenate(
            [np.arange(size * 2)[2 * rank : 2 * rank + 2] + 10 * s for s in range(size)]
        )
        np.testing.assert_array_equal(out, want)


def test_alltoall_splits_sum_smaller_than_rows():
    def body(rank):
        return hvd.alltoall(np.arange(5) + 10 * rank, splits=[1, 1])  # rows 2..4 not sent

    (o0, r0), (o1, r1) = run_ranks(body, 2)
    assert o0.tolist() == [0, 10] and o1.tolist() == [1, 11]


@pytest.mark.parametrize("rows", [0, 1, 17, 40_001])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_reducescatter_uneven(size, rows, op):
    def body(rank):
        return hvd.reducescatter(rank_data(rank, rows * 2, np.float64, (rows, 2)), op=op)

    total = sum(rank_data(r, rows * 2, np.float64, (rows, 2)) for r in range(size))
    if op == hvd.Average:
        total = total / size
    base, extra = divmod(rows, size)
    start = 0
    for rank, got in enumerate(run_ranks(body, size)):
        n = base + (1 if rank < extra else 0)
        np.testing.assert_allclose(got, total[start : start + n])
        start += n


def test_grouped_reducescatter(size):
    def body(rank):
        a = rank_data(rank, 7 * 3, np.float32, (7, 3))
        b = rank_data(rank, 4, np.float32, (4,))
        return hvd.grouped_reducescatter([a, b], op=hvd.Sum)

    ta = sum(rank_data(r, 21, np.float32, (7, 3)) for r in range(size))
    tb = sum(rank_data(r, 4, np.float32, (4,)) for r in range(size))
    sa = sb = 0
    for rank, (ga, gb) in enumerate(run_ranks(body, size)):
        na = 7 // size + (1 if rank < 7 % size else 0)
        nb = 4 // size + (1 if rank < 4 % size else 0)
        np.testing.assert_array_equal(ga, ta[sa : sa + na])
        np.testing.assert_array_equal(gb, tb[sb : sb + nb])
        sa += na
        sb += nb


def test_barrier_and_objects(size):
    def body(rank):
        hvd.barrier()
        obj = hvd.broadcast_object({"rank": rank, "data": list(range(rank))}, root_rank=size - 1)
        objs = hvd.allgather_object(("r", rank, "x" * rank))
        return obj, objs

    for obj, objs in run_ranks(body, size):
        assert obj == {"rank": size - 1, "data": list(range(size - 1))}
        assert objs == [("r", r, "x" * r) for r in range(size)]


def test_size_one_without_launcher():
    """A plain `python train.py` (no launcher variables) runs as a job of size 1."""
    hvd.init()
    try:
        assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank()) == (1, 0, 1, 0)
        assert (hvd.cross_size(), hvd.cross_rank()) == (1, 0)
        assert hvd.is_homogeneous()
        np.testing.assert_array_equal(hvd.allreduce(np.arange(3.0)), np.arange(3.0))
        np.testing.assert_array_equal(hvd.allgather(np.arange(3)), np.arange(3))
        assert hvd.broadcast_object("x") == "x"
    finally:
        hvd.shutdown()


def test_size_one_runs_ops_on_the_calling_thread_and_async_ops_on_the_engine_thread():
    """A one-process job has nobody to wait for: a synchronous op is negotiated and executed by
    the thread that waits for it (no hand-off to the engine thread); ops submitted without
    waiting (as backward hooks do) are picked up by the woken engine thread; shutdown stops it."""
    import threading

    from horovod.core.context import current

    hvd.init()
    try:
        eng = current().engine
        for i in range(50):
            np.testing.assert_array_equal(hvd.allreduce(np.full(3, i), name="s"), np.full(3, i))
        assert eng.stats["responses_run_by_caller"] >= 50
        before = eng.stats["responses_run_by_caller"]
        h = hvd.allreduce_async(np.arange(4.0), name="a")
        done = threading.Event()
        threading.Thread(target=lambda: (time_wait(lambda: hvd.poll(h), 10), done.set())).start()
        assert done.wait(15) and hvd.poll(h)  # completed without anybody waiting on it
        np.testing.assert_array_equal(hvd.synchronize(h), np.arange(4.0))
        assert eng.stats["responses_run_by_caller"] == before  # the engine thread ran it
        assert type(eng.transport).__name__ == "SoloTransport"
    finally:
        hvd.shutdown()
    assert not eng.alive()


def time_wait(cond, timeout: float) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.001)
    return False
