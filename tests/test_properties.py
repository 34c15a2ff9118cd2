"""Hypothesis: each collective equals its NumPy reference for arbitrary sizes, shapes, dtypes
and data."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import horovod.numpy as hvd
from horovod.testing import run_ranks
from horovod.transport.shm.channels import PIECE_ALIGN, piece

DTYPES = st.sampled_from([np.int32, np.int64, np.float32, np.float64, np.uint8])
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def per_rank_arrays(draw, size, dtype, shape):
    elems = st.integers(-50, 50) if np.dtype(dtype).kind != "u" else st.integers(0, 100)
    return [draw(hnp.arrays(dtype, shape, elements=elems)) for _ in range(size)]


@SETTINGS
@given(
    st.data(),
    st.integers(1, 5),
    DTYPES,
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    st.sampled_from(["sum", "min", "max"]),
)
def test_allreduce_matches_numpy(data, size, dtype, shape, opname):
    xs = per_rank_arrays(data.draw, size, dtype, shape)
    op = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max}[opname]
    ref = {"sum": np.add, "min": np.minimum, "max": np.maximum}[opname].reduce(np.stack(xs))
    for got in run_ranks(lambda r: hvd.allreduce(xs[r], op=op), size):
        np.testing.assert_array_equal(got, ref.astype(dtype))


@SETTINGS
@given(
    st.data(),
    st.integers(1, 5),
    DTYPES,
    st.lists(st.integers(0, 5), min_size=5, max_size=5),
    st.integers(0, 3),
)
def test_allgather_matches_concatenate(data, size, dtype, rows, width):
    xs = [data.draw(hnp.arrays(dtype, (rows[r], width))) for r in range(size)]
    ref = np.concatenate(xs)
    for got in run_ranks(lambda r: hvd.allgather(xs[r]), size):
        np.testing.assert_array_equal(got, ref)


@SETTINGS
@given(st.data(), st.integers(1, 5), DTYPES, st.integers(0, 9))
def test_broadcast_matches_root(data, size, dtype, n):
    root = data.draw(st.integers(0, size - 1))
    xs = per_rank_arrays(data.draw, size, dtype, (n,))
    for got in run_ranks(lambda r: hvd.broadcast(xs[r], root), size):
        np.testing.assert_array_equal(got, xs[root])


@SETTINGS
@given(st.data(), st.integers(1, 4))
def test_alltoall_matches_reference(data, size):
    splits = [[data.draw(st.integers(0, 3)) for _ in range(size)] for _ in range(size)]
    xs = [np.arange(sum(sp), dtype=np.int64) + 1000 * r for r, sp in enumerate(splits)]

    def body(r):
        return hvd.alltoall(xs[r], splits=splits[r])

    for r, (out, recv) in enumerate(run_ranks(body, size)):
        parts = []
        for s in range(size):
            start = sum(splits[s][:r])
            parts.append(xs[s][start : start + splits[s][r]])
        np.testing.assert_array_equal(out, np.concatenate(parts))
        assert recv.tolist() == [splits[s][r] for s in range(size)]


@SETTINGS
@given(st.data(), st.integers(1, 5), st.integers(0, 12), st.integers(1, 3))
def test_reducescatter_matches_reference(data, size, rows, width):
    xs = per_rank_arrays(data.draw, size, np.int64, (rows, width))
    total = np.add.reduce(np.stack(xs))
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    starts = np.cumsum([0] + counts)
    for r, got in enumerate(run_ranks(lambda r: hvd.reducescatter(xs[r], op=hvd.Sum), size)):
        np.testing.assert_array_equal(got, total[starts[r] : starts[r + 1]])


@given(
    st.integers(0, 1 << 26),
    st.integers(64, 1 << 22).map(lambda c: c // 64 * 64),
    st.integers(1, 16),
)
def test_a_message_moves_in_pieces_that_fit_the_slots(nbytes, chunk, nslots):
    """``piece``: never more than a slot; one chunk for a message of at most one slot or at
    least all of them; otherwise whole pages (or the chunk) and at most one piece per slot."""
    got = piece(nbytes, chunk, nslots)
    assert 0 < got <= chunk
    if nbytes <= chunk or nbytes >= chunk * nslots:
        assert got == chunk
    else:
        assert got == chunk or got % PIECE_ALIGN == 0
        assert -(-nbytes // got) <= nslots


CHANGES = ["none", "count", "kind", "ids", "other ids", "fewer bytes", "slot", "slot, no bytes"]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["allreduce", "allgather", "broadcast"]),
    st.integers(0, 3),
    st.booleans(),
    st.lists(st.sampled_from(CHANGES), min_size=1, max_size=4),
)
def test_an_express_calls_decision_is_the_rounds_decision(opname, root, plane, changes):
    """``decide_lone``, the express way's check of its posts, answers what ``decide`` answers
    for the same op alone in its round, whatever the peers posted: each peer's post is the
    one that matches, or that with one thing changed."""
    from horovod.core.messages import ALLGATHER, ALLREDUCE, BROADCAST, Response
    from horovod.core.peer_rounds import decide, decide_lone, posted_bytes

    op = {"allreduce": ALLREDUCE, "allgather": ALLGATHER, "broadcast": BROADCAST}[opname]
    n = len(changes) + 1
    resp = Response(
        op,
        0,
        [f"{opname}.x"],
        dtype=7,
        shapes=[(2, 3)],
        root=root % n if op == BROADCAST else -1,
        dim0s=[[1 + r for r in range(n)]] if op == ALLGATHER else None,
    )
    sizes = tuple(posted_bytes(resp, r) for r in range(n))
    mem = memoryview(bytes(400))
    tag = 6 << 1 | plane
    posts = []
    for r, change in enumerate(changes, start=1):
        t, ids, nb, out = tag, [4], 0 if plane else sizes[r], -1
        if change == "count":
            t = 5 << 1 | plane
        elif change == "kind":
            t = tag ^ 1
        elif change == "ids":
            ids = [4, 5]
        elif change == "other ids":
            ids = [5]
        elif change == "fewer bytes":
            nb = max(0, nb - 4)
        elif change == "slot":
            out = 0
        elif change == "slot, no bytes":
            out, nb = 1, 0
        posts.append((r, t, ids, mem[:nb], out))
    want = decide([(None, resp)], [4], tag, posts, sizes)
    assert decide_lone(4, op, tag, posts, sizes) == want
