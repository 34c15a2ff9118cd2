"""Hierarchical allreduce/allgather (HOROVOD_HIERARCHICAL_*): within each host, then across the
hosts' leaders, then back within the host. Checked against NumPy and against the flat
algorithms, over in-process transports whose ranks claim host names (loopback threads, and
real shared memory within a host plus TCP across), for host layouts that are uneven,
interleaved and of one rank per host."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from horovod.collectives import algorithms as alg
from horovod.transport.base import Scratch, SubTransport
from horovod.transport.loopback import LoopbackWorld
from tests.test_transports import _close, _create, _run

LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "a", "a", "b"],  # uneven
    ["a", "b", "a", "b", "c"],  # interleaved (ranks of a host not contiguous), three hosts
]
# Hosts of as many ranks each (the pipelined allreduce's layouts)
EVEN = [
    ["a", "a", "b", "b"],
    ["a", "b", "a", "b"],  # interleaved
    ["a", "a", "a", "b", "b", "b"],  # three parts folded within a host
    ["a", "b", "c", "c", "b", "a"],  # three hosts, the ranks of each in another order
]


@pytest.fixture
def hierarchical(monkeypatch):
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLREDUCE", True)
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLGATHER", True)


def _loopback(hosts):
    world = LoopbackWorld(len(hosts))
    ts = [world.transport(r, 0) for r in range(len(hosts))]
    for t in ts:
        t.hosts = list(hosts)
    return ts


def _collectives(elems):
    def fn(r, t):
        n = t.size
        x = (np.arange(elems) % 11 + 3 * r).astype(np.float32)
        alg.allreduce(t, x, np.add, Scratch())
        y = (np.arange(elems) % 5 - r).astype(np.int64)
        alg.allreduce(t, y, np.maximum, Scratch())
        sizes = [(elems + 3 * k) % 50_001 for k in range(n)]  # includes empty blocks
        out = np.zeros(sum(sizes), np.uint8)
        off = sum(sizes[:r])
        out[off : off + sizes[r]] = r + 1
        alg.allgatherv(t, out, sizes)
        return x.tobytes(), y.tobytes(), out.tobytes()

    return fn


@pytest.mark.parametrize("hosts", LAYOUTS, ids=lambda h: "".join(h))
@pytest.mark.parametrize("elems", [1, 1000, 100_003])
def test_hierarchical_matches_numpy_and_the_flat_algorithms(hosts, elems, monkeypatch):
    n = len(hosts)
    ts = _loopback(hosts)
    flat = _run(ts, _collectives(elems))
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLREDUCE", True)
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLGATHER", True)
    calls = {"allreduce": 0, "allgatherv": 0}
    real_ar, real_ag = alg.hierarchical_allreduce, alg.hierarchical_allgatherv

    def count_ar(*a, **k):
        calls["allreduce"] += 1
        return real_ar(*a, **k)

    def count_ag(*a, **k):
        calls["allgatherv"] += 1
        return real_ag(*a, **k)

    monkeypatch.setattr(alg, "hierarchical_allreduce", count_ar)
    monkeypatch.setattr(alg, "hierarchical_allgatherv", count_ag)
    hier = _run(ts, _collectives(elems))
    assert calls == {"allreduce": 2 * n, "allgatherv": n}  # the two-level path really ran
    want_x = sum((np.arange(elems) % 11 + 3 * k).astype(np.float32) for k in range(n))
    want_y = np.arange(elems) % 5
    for r in range(n):
        # integer-valued data: every summation order gives the same bits
        assert hier[r] == flat[r]
        assert np.array_equal(np.frombuffer(hier[r][0], np.float32), want_x)
        assert np.array_equal(np.frombuffer(hier[r][1], np.int64), want_y)
    assert len({h[2] for h in hier}) == 1


def test_every_rank_gets_the_same_bits_for_float_sums(hierarchical):
    hosts = ["a", "a", "a", "b", "b"]
    ts = _loopback(hosts)
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(30_001).astype(np.float32) * 1e3 for _ in hosts]

    def fn(r, t):
        x = data[r].copy()
        alg.allreduce(t, x, np.add, Scratch())
        return x.tobytes()

    out = _run(ts, fn)
    assert len(set(out)) == 1
    np.testing.assert_allclose(np.frombuffer(out[0], np.float32), sum(data), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("elems", [1000, 100_003])
def test_scaled_result_is_the_leaders_scaled_sum(hierarchical, elems):
    """``post`` (Average's division) is applied once, among the leaders, and reaches every
    rank through the host's broadcast."""
    hosts = ["a", "a", "a", "b", "b"]
    ts = _loopback(hosts)

    def fn(r, t):
        x = (np.arange(elems) % 11 + 3 * r).astype(np.float32)
        alg.allreduce(t, x, np.add, Scratch(), 0.25)
        return x.tobytes()

    out = _run(ts, fn)
    want = sum((np.arange(elems) % 11 + 3 * k).astype(np.float32) for k in range(len(hosts)))
    assert len(set(out)) == 1
    assert np.array_equal(np.frombuffer(out[0], np.float32), want * np.float32(0.25))


def test_flat_when_two_levels_cannot_help(hierarchical, monkeypatch):
    """One host, or one rank per host: the flat algorithm runs (a leader step would only add
    latency)."""

    def boom(*a, **k):
        raise AssertionError("hierarchical path taken")

    monkeypatch.setattr(alg, "hierarchical_allreduce", boom)
    monkeypatch.setattr(alg, "hierarchical_allgatherv", boom)
    for hosts in (["a", "a", "a"], ["a", "b", "c"]):
        ts = _loopback(hosts)
        out = _run(ts, _collectives(100))
        assert len({o[0] for o in out}) == 1


def test_process_set_views_keep_their_hosts(hierarchical):
    """A process set over ranks 1..4 of a 5-rank job: host names follow the set's ranks."""
    hosts = ["a", "a", "a", "b", "b"]
    ts = _loopback(hosts)
    views = [SubTransport(t, [1, 2, 3, 4]) for t in ts[1:]]
    assert views[0].hosts == ["a", "a", "b", "b"]

    def fn(r, v):
        x = np.full(10, float(r + 1))
        alg.allreduce(v, x, np.add, Scratch())
        return float(x[0])

    assert _run(views, fn) == [10.0] * 4


def test_reduce_to_any_root(hierarchical):
    ts = _loopback(["a"] * 3)
    for elems in (5, 200_000):

        def fn(r, t, elems=elems):
            x = (np.arange(elems) % 3 + r).astype(np.float64)
            alg.reduce(t, x, np.add, Scratch(), root=1)
            return x.copy() if r == 1 else None

        got = _run(ts, fn)[1]
        assert np.array_equal(got, 3 * (np.arange(elems) % 3) + 3.0)


@contextlib.contextmanager
def _planes(hosts):
    """Ranks on ``hosts`` over the real planes: shared memory within a host, TCP across."""
    ts = _create(hosts)
    try:
        for t in ts:
            t.hosts = list(hosts)
        yield ts
    finally:
        _close(ts)


def test_over_shared_memory_within_hosts_and_tcp_across(hierarchical):
    with _planes(["a", "a", "b", "b"]) as ts:
        out = _run(ts, _collectives(100_003), timeout=60)
    assert len(set(out)) == 1
    want = sum((np.arange(100_003) % 11 + 3 * k).astype(np.float32) for k in range(4))
    assert np.array_equal(np.frombuffer(out[0][0], np.float32), want)


@pytest.fixture
def pipelined(hierarchical, monkeypatch):
    """Pieces of 256 bytes, so that small buffers run the pipeline; counts its runs."""
    monkeypatch.setattr(alg, "HIERARCHICAL_PIECE_BYTES", 256)
    runs = []
    real = alg._hierarchical_pipeline

    def counted(t, buf, op, scratch, hosts, post, pieces, src=None):
        runs.append(pieces)
        return real(t, buf, op, scratch, hosts, post, pieces, src)

    monkeypatch.setattr(alg, "_hierarchical_pipeline", counted)
    return runs


@pytest.mark.parametrize("hosts", EVEN, ids=lambda h: "".join(h))
@pytest.mark.parametrize("elems", [64, 300, 1000, 100_003])
def test_pipelined_matches_numpy_and_the_flat_algorithms(hosts, elems, pipelined, monkeypatch):
    """Pieces in flight at four stages (reduce within the host, the leaders' reduce-scatter and
    allgather, the host's broadcast), over every layout and a piece count from 2 to the most."""
    n = len(hosts)
    ts = _loopback(hosts)
    hier = _run(ts, _collectives(elems))
    # (each allreduce of 4- and 8-byte elements: as many pieces as 256 bytes fit, at least 2,
    # at most 64)
    want_pieces = [min(alg.HIERARCHICAL_PIECES, max(2, elems * size // 256)) for size in (4, 8)]
    assert pipelined == [p for p in want_pieces for _ in range(n)]
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLREDUCE", False)
    monkeypatch.setattr(alg, "HIERARCHICAL_ALLGATHER", False)
    flat = _run(ts, _collectives(elems))
    want_x = sum((np.arange(elems) % 11 + 3 * k).astype(np.float32) for k in range(n))
    for r in range(n):
        assert hier[r] == flat[r]
        assert np.array_equal(np.frombuffer(hier[r][0], np.float32), want_x)
        assert np.array_equal(np.frombuffer(hier[r][1], np.int64), np.arange(elems) % 5)


@pytest.mark.parametrize("hosts", EVEN, ids=lambda h: "".join(h))
def test_pipelined_average_and_float_sums_are_the_same_bits_everywhere(hosts, pipelined):
    n = len(hosts)
    ts = _loopback(hosts)
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(20_011).astype(np.float32) * 1e3 for _ in hosts]
    post = alg.average_post(1.0, n)

    def fn(r, t):
        x = data[r].copy()
        alg.allreduce(t, x, np.add, Scratch(), post)
        return x.tobytes()

    out = _run(ts, fn)
    assert pipelined and len(set(out)) == 1
    np.testing.assert_allclose(
        np.frombuffer(out[0], np.float32), sum(data) / n, rtol=1e-4, atol=1e-2
    )


def test_pipelined_gives_the_unpipelined_bits_with_two_ranks_per_host(pipelined, monkeypatch):
    """Two ranks a host, two hosts: every fold has two operands, so the pipeline's results are
    the bits the three steps one after the other gave (checkpoints do not change with it)."""
    hosts = ["a", "a", "b", "b"]
    ts = _loopback(hosts)
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(300_007).astype(np.float32) for _ in hosts]

    def fn(r, t):
        x = data[r].copy()
        alg.allreduce(t, x, np.add, Scratch(), 0.25)
        return x.tobytes()

    monkeypatch.setattr(alg, "HIERARCHICAL_PIECES", 1)  # (HOROVOD_HIERARCHICAL_ALLREDUCE_PIECES=1)
    before = _run(ts, fn)
    assert pipelined == []
    monkeypatch.setattr(alg, "HIERARCHICAL_PIECES", 64)
    after = _run(ts, fn)
    assert pipelined == [64] * 4
    assert len(set(after)) == 1 and after == before


def test_pipeline_needs_an_element_per_rank_in_every_piece(pipelined, monkeypatch):
    """Fewer elements than pieces x ranks: the three steps one after the other."""
    monkeypatch.setattr(alg, "HIERARCHICAL_PIECE_BYTES", 8)
    ts = _loopback(["a", "b", "a", "b"])

    def fn(r, t):
        x = np.full(5, float(r), np.float64)  # 5 pieces of one element, 4 ranks
        alg.allreduce(t, x, np.add, Scratch())
        return x.tobytes()

    out = _run(ts, fn)
    assert pipelined == [] and len(set(out)) == 1
    assert np.frombuffer(out[0], np.float64).tolist() == [6.0] * 5


@pytest.mark.parametrize("hosts", [LAYOUTS[1], LAYOUTS[2]], ids=lambda h: "".join(h))
def test_hosts_of_different_sizes_take_the_three_steps(pipelined, hosts):
    ts = _loopback(hosts)
    out = _run(ts, _collectives(100_003))
    want = sum((np.arange(100_003) % 11 + 3 * k).astype(np.float32) for k in range(len(hosts)))
    assert pipelined == [] and len({o[0] for o in out}) == 1
    assert np.array_equal(np.frombuffer(out[0][0], np.float32), want)


def test_pipelined_over_shared_memory_within_hosts_and_tcp_across(pipelined, monkeypatch):
    """The real planes at the default piece size: 10 MB a rank, 9 pieces, four in flight."""
    monkeypatch.setattr(alg, "HIERARCHICAL_PIECE_BYTES", 1 << 20)
    elems = 2_500_003

    def fn(r, t):
        x = (np.arange(elems) % 7 + r).astype(np.float32)
        alg.allreduce(t, x, np.add, Scratch(), 0.5)
        return x.tobytes()

    with _planes(["a", "a", "b", "b"]) as ts:
        out = _run(ts, fn, timeout=60)
    assert pipelined == [9] * 4 and len(set(out)) == 1
    want = sum((np.arange(elems) % 7 + k).astype(np.float32) for k in range(4)) / 2
    assert np.array_equal(np.frombuffer(out[0], np.float32), want)


@pytest.mark.parametrize("piece_bytes", [256, 1 << 30], ids=["pipelined", "three-steps"])
@pytest.mark.parametrize(
    "hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b", "c"], ["a", "b", "c", "a", "b", "c"]]
)
def test_result_into_another_buffer_leaves_the_input_alone(
    hierarchical, monkeypatch, hosts, piece_bytes
):
    """``src``: the input stays as it was and the result lands in ``buf``, whichever algorithm
    runs (the pipeline reads the input piece by piece, the others copy it first)."""
    monkeypatch.setattr(alg, "HIERARCHICAL_PIECE_BYTES", piece_bytes)
    ts = _loopback(hosts)
    elems = 10_007

    def fn(r, t):
        x = (np.arange(elems) % 13 + r).astype(np.float32)
        keep = x.copy()
        out = np.full(elems, np.nan, np.float32)
        alg.allreduce(t, out, np.add, Scratch(), 0.5, src=x)
        assert np.array_equal(x, keep)
        return out.tobytes()

    out = _run(ts, fn)
    want = sum((np.arange(elems) % 13 + k).astype(np.float32) for k in range(len(hosts))) / 2
    assert len(set(out)) == 1
    assert np.array_equal(np.frombuffer(out[0], np.float32), want)
