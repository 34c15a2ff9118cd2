"""Average and the scale factors with upstream's arithmetic, bit for bit, at 3 and 5 ranks, on
every path: direct and ring algorithms, fused and unfused, grouped, with a joined rank,
reducescatter, and on shared memory the peer rounds, the express way and eager allreduce.

Upstream averages in framework code: the sum divided by the number of ranks, a correctly
rounded division in the tensor's type (``torch.div``, TensorFlow's ``/``). Its scale factors
multiply in the tensor's type (float16 through float32; integers in float64, truncated). Sums
fold in rank order on the direct algorithms (small buffers) and in ring order on the ring, so
the data here is exactly summable where the ring runs: the comparison then checks the scaling
alone, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.testing import run_ranks

FLOATS = [np.float32, np.float16, np.float64, ml_dtypes.bfloat16]
INTS = [np.int32, np.int64]
SMALL = 1000  # elements: the direct algorithm in every dtype


def sizes_of(dtype) -> dict[str, int]:
    """Elements per rank for each algorithm over more than 2 ranks: the direct exchange (up
    to 128 KiB), the rank-order reduction (up to 512 KiB) and the ring."""
    item = np.dtype(dtype).itemsize
    return {"direct": SMALL, "ordered": (256 << 10) // item, "ring": (640 << 10) // item}


def exact_data(rank: int, size: int, dtype, seed: int = 0) -> np.ndarray:
    """Multiples of 1/8 in [-8, 8]: any sum of 5 is exact in every float type here."""
    rng = np.random.default_rng(1000 * seed + rank)
    return (rng.integers(-64, 65, size) / 8).astype(dtype)


def random_data(rank: int, size: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.standard_normal(size).astype(dtype)


def exact_sum(parts: list[np.ndarray]) -> np.ndarray:
    return np.sum([p.astype(np.float64) for p in parts], 0).astype(parts[0].dtype)


def correctly_rounded_quotient(total: np.ndarray, n: int) -> np.ndarray:
    """``total / n`` rounded once to ``total``'s type (the quotient in float64 is close
    enough that rounding it gives the correctly rounded result for these n)."""
    return (total.astype(np.float64) / n).astype(total.dtype)


def scaled(x: np.ndarray, f: float) -> np.ndarray:
    """Upstream's ScaleBuffer: in the type, float16 and bfloat16 through float32; integers
    in float64, truncated toward zero."""
    if x.dtype.kind in "iu":
        return np.trunc(x.astype(np.float64) * f).astype(x.dtype)
    if x.dtype.itemsize >= 4:
        return x * x.dtype.type(f)
    return (x.astype(np.float32) * np.float32(f)).astype(x.dtype)


def rank_order_sum(parts: list[np.ndarray]) -> np.ndarray:
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = (acc + p).astype(acc.dtype)
    return acc


@pytest.mark.parametrize("n", [3, 4, 5])  # 4: a power of two multiplies by the exact 1/n
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_average_is_the_correctly_rounded_quotient_on_every_algorithm(n, dtype):
    sizes = sizes_of(dtype)

    def body(rank):
        out = {}
        for path, size in sizes.items():
            x = exact_data(rank, size, dtype)
            out[path] = hvd.allreduce(x, op=hvd.Average, name=f"avg.{path}")
            out[path + ".grouped"] = hvd.grouped_allreduce(
                [x[:7], x, x[:3]], op=hvd.Average, name=f"grouped.{path}"
            )
            out[path + ".rs"] = hvd.reducescatter(x, op=hvd.Average, name=f"rs.{path}")
        return out

    results = run_ranks(body, n)
    for path, size in sizes.items():
        want = correctly_rounded_quotient(
            exact_sum([exact_data(r, size, dtype) for r in range(n)]), n
        )
        bounds = np.cumsum([0] + [size // n + (r < size % n) for r in range(n)])
        for rank, got in enumerate(results):
            assert got[path].tobytes() == want.tobytes(), (path, rank)
            grouped = [a.tobytes() for a in got[path + ".grouped"]]
            assert grouped == [want[:7].tobytes(), want.tobytes(), want[:3].tobytes()]
            assert got[path + ".rs"].tobytes() == want[bounds[rank] : bounds[rank + 1]].tobytes()


@pytest.mark.parametrize("n", [3, 5])
def test_mid_size_allreduces_fold_in_rank_order_like_a_peer_round(n):
    """From the ring threshold up to ``ORDERED_BYTES`` over more than 2 ranks, the data plane
    reduces each element in rank order (segments go straight to their owner, which folds
    them): on random float32 data, which is not exactly summable, a Sum is bit for bit the
    rank-order sum and an Average its correctly rounded quotient, the bits a peer round's
    data round computes. Sizes that do not split evenly over the ranks included; the ring
    above it still adds in its own order (the comparison is for the ordered range only)."""
    from horovod.collectives import algorithms as alg

    sizes = [40_001, 70_000, alg.ORDERED_BYTES // 4]

    def body(rank):
        out = []
        for size in sizes:
            x = random_data(rank, size, np.float32, seed=size)
            out.append(hvd.allreduce(x, op=hvd.Sum, name=f"sum.{size}"))
            out.append(hvd.allreduce(x, op=hvd.Average, name=f"avg.{size}"))
        return out

    results = run_ranks(body, n)
    for k, size in enumerate(sizes):
        total = rank_order_sum([random_data(r, size, np.float32, seed=size) for r in range(n)])
        mean = correctly_rounded_quotient(total, n)
        for rank, got in enumerate(results):
            assert got[2 * k].tobytes() == total.tobytes(), (size, rank)
            assert got[2 * k + 1].tobytes() == mean.tobytes(), (size, rank)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("size", [3, 1000])  # (3 < n too: the data plane pairs those up too)
def test_folds_outside_the_data_plane_pair_up_where_it_does(n, size):
    """At a power of two above 2 the data plane's small allreduce is recursive doubling, which
    combines pair by pair ((0, 1), (2, 3), then the pairs): the fold of rank 0's eager path
    and of the peer rounds (``numerics.fold``) must give its bits, on random float32 data
    (not exactly summable), for Sum, Min and Average."""
    from horovod.common.dtypes import CODE_OF
    from horovod.core.messages import ALLREDUCE, AVERAGE, MIN, SUM, Response
    from horovod.core.numerics import fold

    def body(rank):
        x = random_data(rank, size, np.float32, seed=n)
        return [hvd.allreduce(x, op=op, name=f"p{op}") for op in (hvd.Sum, hvd.Min, hvd.Average)]

    results = run_ranks(body, n)
    parts = [random_data(r, size, np.float32, seed=n) for r in range(n)]
    for k, op in enumerate((SUM, MIN, AVERAGE)):
        resp = Response(ALLREDUCE, 0, ["x"], CODE_OF[np.dtype(np.float32)], [(size,)], op)
        want = fold(parts, resp, n)
        for rank, got in enumerate(results):
            assert got[k].tobytes() == want.tobytes(), (op, rank)


def test_average_matches_torch_div():
    """The issue's statement: at 3 ranks, Average equals torch.div(sum, n)."""
    torch = pytest.importorskip("torch")

    def body(rank):
        return hvd.allreduce(exact_data(rank, SMALL, np.float32, seed=3), op=hvd.Average)

    total = sum(torch.from_numpy(exact_data(r, SMALL, np.float32, seed=3)) for r in range(3))
    for got in run_ranks(body, 3):
        assert torch.equal(torch.from_numpy(got), torch.div(total, 3))


# 4 ranks sum by recursive doubling, not in rank order: integers only there (exact sums)
SCALE_CASES = [(n, d) for n in (3, 4, 5) for d in FLOATS + INTS if n != 4 or d in INTS]


@pytest.mark.parametrize(
    "n, dtype", SCALE_CASES, ids=[f"{np.dtype(d).name}-{n}" for n, d in SCALE_CASES]
)
def test_scale_factors_as_upstream_on_allreduce_and_reducescatter(n, dtype):
    """Random data (direct algorithm: rank-order sums): prescale each rank's data, sum in rank
    order, postscale, and for Average divide, as upstream; every rank gets the same bits."""
    pre, post = 0.7, 1.3
    integer = np.dtype(dtype).kind == "i"

    def data(rank):
        if integer:
            return np.random.default_rng(rank).integers(-1000, 1000, SMALL).astype(dtype)
        return random_data(rank, SMALL, dtype)

    def body(rank):
        x = data(rank)
        kw = {"prescale_factor": pre, "postscale_factor": post}
        return (
            hvd.allreduce(x, op=hvd.Sum, name="sum", **kw),
            hvd.allreduce(x, op=hvd.Average, name="avg", **kw),
            hvd.reducescatter(x, op=hvd.Sum, name="rs", **kw),
        )

    want_sum = scaled(rank_order_sum([scaled(data(r), pre) for r in range(n)]), post)
    if integer:
        want_avg = np.trunc(want_sum.astype(np.float64) / n).astype(dtype)
    else:
        want_avg = correctly_rounded_quotient(want_sum, n)
    bounds = np.cumsum([0] + [SMALL // n + (r < SMALL % n) for r in range(n)])
    for rank, (s, a, rs) in enumerate(run_ranks(body, n)):
        assert s.tobytes() == want_sum.tobytes(), rank
        assert a.tobytes() == want_avg.tobytes(), rank
        assert rs.tobytes() == want_sum[bounds[rank] : bounds[rank + 1]].tobytes(), rank


def test_average_with_a_joined_rank_divides_by_every_rank():
    """Ranks 1 and 2 average while rank 0 has joined (it contributes zeros): the sum of two
    divided by 3, correctly rounded."""

    def body(rank):
        if rank == 0:
            hvd.join()
            return None
        out = hvd.allreduce(exact_data(rank, SMALL, np.float32), op=hvd.Average, name="j")
        hvd.join()
        return out

    total = exact_data(1, SMALL, np.float32) + exact_data(2, SMALL, np.float32)
    want = correctly_rounded_quotient(total, 3)
    for got in run_ranks(body, 3)[1:]:
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [3, 5])
def test_average_on_shared_memory_paths(n):
    """Engines on real shared memory: a small cached Average goes through peer rounds, the
    quick and express ways and eager data; a postscaled one through the rounds too. Every
    call, on every rank, gives the correctly rounded quotient."""
    from test_engine import _race, _shm_engines, _stop_all, _sync

    from horovod.common.dtypes import code_of
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import ALLREDUCE, AVERAGE, Request

    engines = _shm_engines(n)
    steps = 12
    parts = [[exact_data(r, 64, np.float32, seed=s) for r in range(n)] for s in range(steps)]
    totals = [exact_sum(ps) for ps in parts]
    try:

        def rank(r, eng):
            for s in range(steps):
                x = parts[s][r]
                got, _ = _sync(eng, ALLREDUCE, "allreduce.avg", x, reduce_op=AVERAGE)
                assert got.tobytes() == correctly_rounded_quotient(totals[s], n).tobytes(), (r, s)
                h = Handle(1)
                code = code_of(x.dtype, "op")
                req = Request(0, "allreduce.post", ALLREDUCE, code, x.shape, AVERAGE, postscale=1.3)
                eng.submit([Entry(req, x, np.empty_like(x), h)], wake=False)
                want = correctly_rounded_quotient(totals[s] * np.float32(1.3), n)
                assert h.wait()[0].tobytes() == want.tobytes(), (r, s, "post")

        _race(rank, engines, 120)
        assert sum(e.stats["rounds_run"] + e.stats["express"] for e in engines) > 0
    finally:
        _stop_all(engines)
