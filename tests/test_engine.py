"""Engine behaviour: real asynchrony, ordering, Tensor Fusion, the response cache, join,
re-initialisation."""

import importlib.util
import threading
import time

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.core.context import current
from horovod.core.messages import ALLGATHER, ALLREDUCE, BROADCAST
from horovod.testing import run_ranks


def test_poll_is_false_until_the_op_completes():
    """Rank 1 holds back its part; rank 0's handle must stay incomplete meanwhile."""
    go = threading.Event()

    def body(rank):
        if rank == 0:
            h = hvd.allreduce_async(np.ones(4), name="held", op=hvd.Sum)
            polls = [hvd.poll(h) for _ in range(20)]
            go.set()
            out = hvd.synchronize(h)
            return polls, out
        go.wait(10)
        return None, hvd.allreduce(np.ones(4), name="held", op=hvd.Sum)

    (polls, out), (_, out1) = run_ranks(body, 2)
    assert polls == [False] * 20
    np.testing.assert_array_equal(out, 2 * np.ones(4))
    np.testing.assert_array_equal(out1, 2 * np.ones(4))


def test_poll_true_after_completion_and_handle_cleared():
    def body(rank):
        h = hvd.allreduce_async(np.ones(2))
        hvd.synchronize(h)
        with pytest.raises(ValueError, match="not created or has been cleared"):
            hvd.poll(h)
        h2 = hvd.allreduce_async(np.ones(2))
        while not hvd.poll(h2):
            pass
        return hvd.synchronize(h2)

    run_ranks(body, 2)


def test_ranks_may_submit_named_tensors_in_different_orders():
    names = [f"t{i}" for i in range(12)]

    def body(rank):
        order = names if rank % 2 == 0 else names[::-1]
        rng = np.random.default_rng(rank)
        order = list(order) if rank < 2 else list(rng.permutation(names))
        handles = {
            n: hvd.allreduce_async(np.full(3, int(n[1:]) + rank, np.int64), name=n, op=hvd.Sum)
            for n in order
        }
        return {n: hvd.synchronize(h) for n, h in handles.items()}

    size = 3
    for res in run_ranks(body, size):
        for n in names:
            k = int(n[1:])
            np.testing.assert_array_equal(res[n], np.full(3, size * k + sum(range(size))))


def test_unnamed_ops_match_by_call_order():
    def body(rank):
        a = hvd.allreduce(np.array([rank]), op=hvd.Sum)
        b = hvd.allreduce(np.array([10 * rank]), op=hvd.Sum)
        return int(a[0]), int(b[0])

    assert run_ranks(body, 3) == [(3, 30)] * 3


def test_bursts_are_fused_into_one_buffer_that_is_reused():
    def body(rank):
        eng = current().engine
        for _step in range(5):
            hs = [
                hvd.allreduce_async(np.full(100, rank + i, np.float32), name=f"g{i}", op=hvd.Sum)
                for i in range(30)
            ]
            outs = [hvd.synchronize(h) for h in hs]
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o, np.full(100, 3 * i + 3, np.float32))
        return eng.stats["fused_responses"], eng.buffers.fusion_allocations

    # Long rounds: a burst arrives in one or two rounds. Eager allreduce off: this is about the
    # data plane's fusion buffer (the eager path is tested below).
    env = {"HOROVOD_CYCLE_TIME": "20", "HOROVOD_EAGER_ALLREDUCE_BYTES": "0"}
    for fused, allocations in run_ranks(body, 3, env=env):
        assert fused >= 5  # every step fused at least once
        assert allocations <= 2  # the fusion buffer is not reallocated per cycle


def test_fusion_threshold_zero_disables_fusion():
    def body(rank):
        hs = [hvd.allreduce_async(np.ones(10), name=f"g{i}") for i in range(20)]
        [hvd.synchronize(h) for h in hs]
        return current().engine.stats["fused_responses"]

    env = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "20"}
    assert run_ranks(body, 2, env=env) == [0, 0]


def test_fusion_respects_the_threshold():
    """Tensors of 4000 bytes with a 10000-byte threshold: at most 2 per fused response."""
    from horovod.core import ops

    seen = []
    orig = ops.execute

    def spy(resp, entries, t, buffers, *rest):
        if t.rank == 0 and resp.op == 0:  # allreduce responses only
            seen.append(len(resp.names))
        return orig(resp, entries, t, buffers, *rest)

    def body(rank):
        hs = [hvd.allreduce_async(np.ones(1000, np.float32), name=f"g{i}") for i in range(9)]
        [hvd.synchronize(h) for h in hs]

    ops.execute = spy
    try:
        run_ranks(body, 2, env={"HOROVOD_FUSION_THRESHOLD": "10000", "HOROVOD_CYCLE_TIME": "30"})
    finally:
        ops.execute = orig
    assert max(seen) == 2 and sum(seen) == 9


def test_response_cache_fast_path_in_steady_state():
    def body(rank):
        for _step in range(6):
            hs = [hvd.allreduce_async(np.ones(8) * rank, name=f"w{i}") for i in range(10)]
            [hvd.synchronize(h) for h in hs]
        return dict(current().engine.stats)  # copied before the harness's closing barrier

    stats = run_ranks(body, 3)
    for s in stats[1:]:
        # the first step sends full requests, later steps only cache ids
        assert s["requests_sent"] == 10
        assert s["cache_hits_sent"] == 50


def test_cache_disabled_sends_full_requests():
    def body(rank):
        for _step in range(3):
            hvd.allreduce(np.ones(8), name="w")
        return dict(current().engine.stats)

    stats = run_ranks(body, 2, env={"HOROVOD_CACHE_CAPACITY": "0"})
    assert stats[1]["requests_sent"] == 3 and stats[1]["cache_hits_sent"] == 0


def test_cache_invalidated_when_a_name_changes_shape():
    def body(rank):
        a = hvd.allreduce(np.ones(4), name="w", op=hvd.Sum)
        b = hvd.allreduce(np.ones(6), name="w", op=hvd.Sum)
        c = hvd.allreduce(np.ones(6), name="w", op=hvd.Sum)
        return a.shape, b.shape, float(c[0])

    assert run_ranks(body, 3) == [((4,), (6,), 3.0)] * 3


def test_cache_eviction_with_small_capacity_stays_correct():
    def body(rank):
        out = []
        for _step in range(4):
            hs = [
                hvd.allreduce_async(np.full(3, i + rank), name=f"n{i}", op=hvd.Sum)
                for i in range(7)
            ]
            out.append([int(hvd.synchronize(h)[0]) for h in hs])
        return out

    env = {"HOROVOD_CACHE_CAPACITY": "3"}
    for res in run_ranks(body, 3, env=env):
        assert res == [[3 * i + 3 for i in range(7)]] * 4


@pytest.mark.parametrize("eager", ["0", "16384"])
def test_cache_ids_stay_valid_when_a_full_response_in_the_same_list_evicts_them(eager):
    """Unfused responses in one list: a full response placed before a cache-id item evicts
    that id from a small cache while the list runs; every rank still resolves it."""

    def body(rank):
        out = []
        for step in range(6):
            hs = [
                hvd.allreduce_async(
                    np.full(3, i + rank), name=f"n{i}_{step % 3 == 0 and i}", op=hvd.Sum
                )
                for i in range(5)
            ]
            out.append([int(hvd.synchronize(h)[0]) for h in hs])
        return out

    env = {
        "HOROVOD_CACHE_CAPACITY": "2",
        "HOROVOD_FUSION_THRESHOLD": "0",
        "HOROVOD_CYCLE_TIME": "20",
        "HOROVOD_EAGER_ALLREDUCE_BYTES": eager,
    }
    for res in run_ranks(body, 3, env=env):
        assert res == [[3 * i + 3 for i in range(5)]] * 6


def test_allgather_cached_with_changing_first_dim():
    def body(rank):
        outs = []
        for step in range(4):
            rows = 1 + (rank + step) % 3
            outs.append(hvd.allgather(np.full((rows, 2), rank), name="ag").shape[0])
        return outs

    res = run_ranks(body, 3)
    assert res[0] == [sum(1 + (r + s) % 3 for r in range(3)) for s in range(4)]


def test_join_contributes_zeros_and_returns_last_rank():
    def body(rank):
        steps = rank + 1  # rank r has r + 1 batches
        sums = []
        for i in range(steps):
            sums.append(float(hvd.allreduce(np.array([1.0]), op=hvd.Sum, name=f"b{i}")[0]))
        last = hvd.join()
        return sums, last

    res = run_ranks(body, 3)
    assert res[0] == ([3.0], 2)
    assert res[1] == ([3.0, 2.0], 2)
    assert res[2] == ([3.0, 2.0, 1.0], 2)


def test_join_average_divides_by_full_size():
    def body(rank):
        if rank == 0:
            return hvd.join(), None
        out = hvd.allreduce(np.array([6.0]), op=hvd.Average, name="a")
        return hvd.join(), float(out[0])

    res = run_ranks(body, 3)
    assert [r[0] for r in res] == [2, 2, 2] or [r[0] for r in res] == [1, 1, 1]
    assert res[1][1] == pytest.approx(4.0)  # (6 + 6 + 0) / 3


def test_allgather_with_joined_rank_is_an_error():
    from horovod.common.exceptions import HorovodInternalError

    def body(rank):
        if rank == 0:
            return hvd.join()
        with pytest.raises(HorovodInternalError, match="ranks \\[0\\] have called join"):
            hvd.allgather(np.ones(1), name="g")
        return hvd.join()

    assert run_ranks(body, 2) == [1, 1]


@pytest.mark.parametrize("n", [3, 5])
def test_join_rounds_back_to_back_with_every_collective(n):
    """Each rank in turn joins while the others run every collective, unnamed as user code
    does: allgather, broadcast, alltoall and reducescatter raise at once (a rank that joined
    earlier has other auto-names, so waiting for matching names could wait forever), allreduce
    and barrier run with the joined rank contributing zeros. No state of one join leaks into
    the next."""
    from horovod.common.exceptions import HorovodInternalError

    refused = {
        "allgather": lambda: hvd.allgather(np.ones((2, 3))),
        "broadcast": lambda: hvd.broadcast(np.ones(3), root_rank=0),
        "alltoall": lambda: hvd.alltoall(np.ones(n)),
        "reducescatter": lambda: hvd.reducescatter(np.ones(n)),
    }

    def body(rank):
        lasts = []
        for j in range(n):
            if rank != j:
                for call in refused.values():
                    with pytest.raises(HorovodInternalError, match="have called join") as e:
                        call()
                    # rank j, and maybe ranks refused a moment earlier that have joined since
                    joined = str(e.value).split("ranks [", 1)[1].split("]", 1)[0].split(", ")
                    assert str(j) in joined, e.value
                total = hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum, name=f"sum{j}")
                assert float(total[0]) == n * (n + 1) / 2 - (j + 1), (rank, j, total)
                hvd.barrier()
            lasts.append(hvd.join())
        return lasts

    results = run_ranks(body, n, timeout=60)
    assert all(len(r) == n for r in results)
    assert results[0] == results[1]  # every rank hears the same last joiner of each round


def test_barrier_blocks_until_everyone_arrives():
    arrived = []

    def body(rank):
        if rank == 1:
            import time

            time.sleep(0.2)
        arrived.append(rank)
        hvd.barrier()
        return sorted(arrived)

    assert run_ranks(body, 3) == [[0, 1, 2]] * 3


def test_init_is_idempotent_and_reinit_after_shutdown_works():
    def body(rank):
        hvd.init()  # second call: no-op
        a = hvd.allreduce(np.array([1]), op=hvd.Sum)
        hvd.shutdown()
        assert not hvd.is_initialized()
        hvd.init()
        b = hvd.allreduce(np.array([2]), op=hvd.Sum)
        h = hvd.allreduce_async(np.array([3]), op=hvd.Sum)
        assert h == 2  # handles restart after re-init
        return int(a[0]), int(b[0]), int(hvd.synchronize(h)[0])

    assert run_ranks(body, 3) == [(3, 6, 9)] * 3


def test_shutdown_fails_pending_ops_with_the_shutdown_message():
    from horovod.common.exceptions import HorovodInternalError

    def body(rank):
        if rank == 1:
            hvd.shutdown()
            return None
        with pytest.raises(HorovodInternalError, match="rank 1 called shutdown"):
            hvd.synchronize(hvd.allreduce_async(np.ones(1), name="orphan"))
        return "ok"

    assert run_ranks(body, 2)[0] == "ok"


def test_topology_from_host_names():
    hosts = ["a", "a", "b", "b", "b"]

    def body(rank):
        return (
            hvd.local_rank(),
            hvd.local_size(),
            hvd.cross_rank(),
            hvd.cross_size(),
            hvd.is_homogeneous(),
        )

    res = run_ranks(body, 5, hosts=hosts)
    assert res == [
        (0, 2, 0, 2, False),
        (1, 2, 0, 2, False),
        (0, 3, 1, 2, False),
        (1, 3, 1, 2, False),
        (2, 3, 0, 1, False),
    ]
    assert run_ranks(body, 4, hosts=["a", "a", "b", "b"])[3] == (1, 2, 1, 2, True)


def test_build_and_enabled_flags():
    def body(rank):
        assert hvd.gloo_built() and hvd.gloo_enabled()
        assert hvd.mpi_built() is (importlib.util.find_spec("mpi4py") is not None)
        assert not hvd.mpi_enabled()  # ranks as threads: the built-in planes
        assert hvd.nccl_built() == 0 and not hvd.cuda_built() and not hvd.rocm_built()
        assert not hvd.ddl_built() and not hvd.ccl_built()
        with pytest.raises(ValueError, match="MPI is not enabled"):
            hvd.mpi_threads_supported()
        assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (
            0,
            1,
            2,
            3,
            4,
            5,
        )

    run_ranks(body, 1)


def test_compression_fp16_and_bf16():
    def body(rank):
        x = np.linspace(0, 1, 9, dtype=np.float32) * (rank + 1)
        a = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="a")
        b = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16, name="b")
        i = hvd.allreduce(np.arange(3), op=hvd.Sum, compression=hvd.Compression.fp16, name="i")
        return a, b, i

    want = np.linspace(0, 1, 9) * 3
    for a, b, i in run_ranks(body, 2):
        assert a.dtype == b.dtype == np.float32 and i.dtype == np.int64
        np.testing.assert_allclose(a, want, atol=2e-3)
        np.testing.assert_allclose(b, want, atol=2e-2)


def test_large_group_submits_quickly_and_correctly():
    def body(rank):
        ts = [np.full(2, i, np.int32) for i in range(3000)]
        out = hvd.grouped_allreduce(ts, op=hvd.Sum)
        return all(int(o[0]) == 2 * i for i, o in enumerate(out))

    assert run_ranks(body, 2) == [True, True]


def test_response_cache_memoised_signatures_follow_replacement_and_set_rank():
    """The cache keeps each entry's expected request per set rank (computed once); a new
    response for the same name gets a new id and a new signature."""
    from horovod.core.cache import ResponseCache
    from horovod.core.messages import ALLGATHER, ALLREDUCE, Response

    cache = ResponseCache(4)
    r1 = Response(ALLREDUCE, 0, ["allreduce.g"], dtype=7, shapes=[(3,)])
    cid = cache.put(r1)
    sig = r1.request_for(0)
    assert cache.lookup("allreduce.g", sig, 0) == cid
    assert cache.lookup("allreduce.g", sig, 0) == cid  # memoised, same answer
    changed = (sig[0], sig[1], (4,)) + sig[3:]
    assert cache.lookup("allreduce.g", changed, 0) is None
    r2 = Response(ALLREDUCE, 0, ["allreduce.g"], dtype=7, shapes=[(4,)])
    cid2 = cache.put(r2)
    assert cid2 != cid and cache.lookup("allreduce.g", changed, 0) == cid2
    assert cache.lookup("allreduce.g", sig, 0) is None
    # Allgather: what each set rank sent differs (its own first dimension).
    g = Response(ALLGATHER, 0, ["allgather.x"], dtype=7, shapes=[(2, 5)], dim0s=[[2, 3]])
    gid = cache.put(g)
    assert cache.lookup("allgather.x", g.request_for(1), 1) == gid
    assert cache.lookup("allgather.x", g.request_for(1), 0) is None
    assert cache.lookup("allgather.x", g.request_for(0), 0) == gid


def test_response_nbytes_memo_follows_replaced_shapes():
    from horovod.core.messages import ALLREDUCE, Response

    r = Response(ALLREDUCE, 0, ["a", "b"], dtype=7, shapes=[(2, 3), (4,)])
    assert r.nbytes(4) == 40 and r.nbytes(4) == 40 and r.nbytes(8) == 80
    r.shapes = [(1,)]
    assert r.nbytes(4) == 4
    used = Response(ALLREDUCE, 0, ["a"], shapes=[(1,)])
    used.nbytes(4)
    assert used == Response(ALLREDUCE, 0, ["a"], shapes=[(1,)])  # the memo is not compared


EAGER_CASES = [
    # (dtype, op, prescale, postscale)
    (np.float32, hvd.Average, 1.0, 1.0),
    (np.float32, hvd.Sum, 0.5, 3.0),
    (np.float64, hvd.Product, 1.0, 1.0),
    (np.float16, hvd.Sum, 1.0, 0.25),
    (np.int32, hvd.Average, 1.0, 1.0),
    (np.int64, hvd.Min, 1.0, 1.0),
    (np.uint8, hvd.Max, 1.0, 1.0),
    (np.bool_, hvd.Max, 1.0, 1.0),
]


def _eager_run(eager: str, size: int = 3, process_set_ranks=None):
    def body(rank):
        rng = np.random.default_rng(100 + rank)
        ps = hvd.global_process_set
        if process_set_ranks is not None:
            ps = hvd.add_process_set(process_set_ranks)
            if rank not in process_set_ranks:
                hvd.remove_process_set(ps)
                return None, current().engine.stats["eager_responses"]
        outs = []
        for _step in range(3):  # steps 2 and 3 hit the response cache
            for i, (dtype, op, pre, post) in enumerate(EAGER_CASES):
                if dtype is np.bool_:
                    x = rng.random(7) > 0.5
                elif np.dtype(dtype).kind == "f":
                    x = (rng.standard_normal(7) * 10).astype(dtype)
                else:
                    x = rng.integers(0, 50, 7).astype(dtype)
                outs.append(
                    hvd.allreduce(
                        x,
                        name=f"c{i}",
                        op=op,
                        prescale_factor=pre,
                        postscale_factor=post,
                        process_set=ps,
                    )
                )
        eager_count = current().engine.stats["eager_responses"]
        if process_set_ranks is not None:
            hvd.remove_process_set(ps)
        return outs, eager_count

    env = {"HOROVOD_EAGER_ALLREDUCE_BYTES": eager, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    return run_ranks(body, size, env=env)


def test_eager_allreduce_equals_the_data_plane_bit_for_bit():
    """Cached small allreduces are reduced by the coordinator (every dtype and reduce op, scale
    factors, Average's division, integer truncation): the same bits on every rank as the data
    plane's direct exchange gives."""
    eager = _eager_run("16384")
    plain = _eager_run("0")
    for (outs, n_eager), (ref, n_plain) in zip(eager, plain, strict=True):
        assert n_plain == 0
        assert n_eager == 2 * len(EAGER_CASES)  # every cache hit went eager
        for a, b in zip(outs, ref, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for outs, _ in eager[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(outs, eager[0][0], strict=True))


def test_eager_allreduce_on_a_process_set_without_the_coordinator():
    eager = _eager_run("16384", process_set_ranks=[1, 2])
    plain = _eager_run("0", process_set_ranks=[1, 2])
    assert eager[0] == (None, 0)
    for rank in (1, 2):
        (outs, n), (ref, _) = eager[rank], plain[rank]
        assert n == 2 * len(EAGER_CASES)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(outs, ref, strict=True))


def test_eager_bursts_fuse_and_large_tensors_use_the_data_plane():
    """A burst of small cached tensors comes back as fused eager results; a tensor above
    HOROVOD_EAGER_ALLREDUCE_BYTES never goes eager; a burst larger than the budget is split
    between both paths; every result is exact."""

    def body(rank):
        eng = current().engine
        for _step in range(4):
            hs = [
                hvd.allreduce_async(np.full(100, rank + i, np.float32), name=f"s{i}", op=hvd.Sum)
                for i in range(30)  # 30 x 400 bytes: more than the 4 KiB budget
            ]
            big = hvd.allreduce_async(np.full(2000, rank, np.float32), name="big", op=hvd.Sum)
            for i, h in enumerate(hs):
                np.testing.assert_array_equal(hvd.synchronize(h), np.full(100, 2 * i + 1))
            np.testing.assert_array_equal(hvd.synchronize(big), np.full(2000, 1))
        return dict(eng.stats)

    env = {"HOROVOD_CYCLE_TIME": "20", "HOROVOD_EAGER_ALLREDUCE_BYTES": "4096"}
    for stats in run_ranks(body, 2, env=env):
        # 3 cached steps of 31 tensors: some small ones eager (fused), "big" never.
        assert 0 < stats["eager_responses"] < 3 * 31
        assert stats["responses"] - stats["eager_responses"] >= 3
        assert stats["fused_responses"] >= 3


# ---------------------------------------------------------------- peer rounds (shared memory)
def _shm_engines(n: int, **kw):
    """``n`` engines on real shared-memory transports (threads of this process)."""
    from test_transports import _make

    from horovod.core.engine import Engine

    ts = _make("shm", n, spin_us=50.0)
    engines = [
        Engine(
            r,
            n,
            ts[r],
            fusion_threshold=1 << 20,
            cycle_time_ms=1.0,
            cache_capacity=64,
            eager_bytes=16384,
            **kw,
        )
        for r in range(n)
    ]
    for e in engines:
        # (the data rounds' allreduce budget these tests' sizes were chosen against; by
        # default 2 ranks carry up to 2 MiB: test_the_allreduce_budget_of_a_data_round...)
        e.round_budget = 16384
        e.start()
    return engines


def _submit(eng, name: str, x: np.ndarray):
    from horovod.common.dtypes import code_of
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import SUM, Request

    h = Handle(1)
    req = Request(0, name, ALLREDUCE, code_of(x.dtype, "allreduce"), x.shape, SUM)
    eng.submit([Entry(req, x, np.empty_like(x), h)])
    return h


def _exercised(engines, stat: str) -> None:
    """The path a race test is about was taken at all (on some rank). How often depends on
    timing (a loaded CI machine posts fewer rounds): the tests assert exact results and no
    hang; how often a fast path is taken is the benchmarks' business."""
    assert sum(e.stats[stat] for e in engines) > 0, [e.stats for e in engines]


def _race(body, engines, timeout: float, calls=None) -> None:
    """Run ``body(r, engines[r])`` for every rank (or ``body(*args)`` for every tuple in
    ``calls``) on its own thread; fail on a hang (aborting the engines, so the threads end)
    or on anything a call raised."""
    errors: list[str] = []

    def run(*args):
        try:
            body(*args)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    if calls is None:
        calls = [(r, e) for r, e in enumerate(engines)]
    threads = [threading.Thread(target=run, args=args) for args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        for e in engines:
            e._abort("test: a rank hung")
        pytest.fail(f"a rank hung: {errors}")
    assert errors == []


def _stop_all(engines) -> None:
    threads = [threading.Thread(target=e.stop, args=("test done", 10.0)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def test_a_peer_round_nobody_answers_is_reported_with_the_op_and_the_silent_rank(caplog):
    """A rank's posted op waits for its peers' posts; when a peer's engine does not answer
    (here: held), the waiting rank says which op waits for which rank, and the op completes
    through rank 0 once the peer answers and submits it."""
    engines = _shm_engines(2, stall_check_seconds=0.3)
    try:

        def both(name, v):
            hs = [_submit(e, name, np.full(3, v + r, np.float32)) for r, e in enumerate(engines)]
            deadline = time.monotonic() + 10
            while not all(h.done() for h in hs) and time.monotonic() < deadline:
                time.sleep(0.001)
            return [h.wait()[0] for h in hs]

        for step in range(3):  # the first negotiates, the others hit the cache
            assert all((out == 2 * step + 1).all() for out in both("w", step))
        assert all(e.stats["rounds_run"] >= 1 for e in engines)
        with engines[1].drive:  # rank 1's engine cannot run: nobody answers rank 0's post
            with caplog.at_level("WARNING", logger="horovod"):
                h0 = _submit(engines[0], "w", np.full(3, 10.0, np.float32))
                time.sleep(0.8)
            assert not h0.done()
        msgs = [r.getMessage() for r in caplog.records if "peer round" in r.getMessage()]
        assert msgs and msgs[0].startswith("rank 0: allreduce 'w'"), msgs
        assert "for rank 1 to post" in msgs[0], msgs
        h1 = _submit(engines[1], "w", np.full(3, 5.0, np.float32))
        for h in (h0, h1):
            assert (h.wait()[0] == 15.0).all()
    finally:
        _stop_all(engines)


def test_peer_rounds_run_every_rank_alike_and_fall_back_when_posts_differ():
    """Three ranks post async ops in different orders (their rounds disagree: everything goes
    through rank 0) and then in the same order (rounds run them); one rank with peer rounds
    off still answers the others. Every result is exact."""
    for off_on in (None, 2):
        engines = _shm_engines(3)
        if off_on is not None:
            engines[off_on].peer_rounds = False
        try:

            def rank(r, eng):
                for step in range(30):
                    names = ["a", "b"] if (r + step) % 2 else ["b", "a"]
                    hs = {n: _submit(eng, n, np.full(2, r + step, np.int64)) for n in names}
                    for n, h in hs.items():
                        assert (h.wait()[0] == 3 + 3 * step).all(), (r, step, n)
                    out = _submit(eng, "c", np.full(2, r * step, np.float64)).wait()[0]
                    assert (out == 3 * step).all(), (r, step)

            _race(rank, engines, 60)
            posted = [e.stats["rounds_posted"] for e in engines]
            run = [e.stats["rounds_run"] for e in engines]
            if off_on is None:
                assert all(p > rn for p, rn in zip(posted, run, strict=True))  # some fell back
                assert all(rn >= 1 for rn in run)
            else:
                assert posted[off_on] == 0 and run == [0, 0, 0]
        finally:
            _stop_all(engines)


def _submit_op(
    eng, op: int, name: str, x: np.ndarray, root: int = -1, ps_id: int = 0, wake: bool = True
):
    """Submit one op; ``wake=False``: as the frontend's synchronous calls do (the caller
    waits at once, and a lone small cached op may run its round on the calling thread)."""
    from horovod.common.dtypes import code_of
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import SUM, Request

    h = Handle(1)
    req = Request(ps_id, name, op, code_of(x.dtype, "op"), x.shape, SUM, root)
    out = np.empty_like(x) if op != ALLGATHER else None
    eng.submit([Entry(req, x, out, h)], wake=wake)
    return h


def _cache_w(engines) -> None:
    """Three asynchronous allreduces of "w" (2 int64) on every rank: the first negotiates at
    rank 0, then the response is cached."""
    for step in range(3):
        outs = [_submit_op(e, ALLREDUCE, "w", np.full(2, step, np.int64)) for e in engines]
        assert all((h.wait()[0] == 2 * step).all() for h in outs)


def _waited(eng, op: int, name: str, x: np.ndarray, root: int = -1):
    """A synchronous call: submit with ``wake=False`` and wait at once."""
    return _submit_op(eng, op, name, x, root, wake=False).wait()[0]


@pytest.mark.parametrize("n", [2, 3])
def test_lone_waited_ops_run_their_round_on_the_calling_thread(n):
    """Synchronous small cached allreduces, allgathers and broadcasts, one at a time on every
    rank: once cached, each runs its data round on the thread that waits for it (``_quick``),
    and every result is exact."""
    engines = _shm_engines(n)
    try:

        def rank(r, eng):
            for step in range(40):
                out = _waited(eng, ALLREDUCE, "s", np.full(3, r + step, np.int64))
                assert (out == n * step + n * (n - 1) // 2).all(), (r, step, out)
                g = _waited(eng, ALLGATHER, "g", np.full((r + 1, 2), r * step, np.float32))
                want = np.concatenate([np.full((q + 1, 2), q * step) for q in range(n)])
                assert g.shape == want.shape and (g == want).all(), (r, step, g)
                b = _waited(eng, BROADCAST, "b", np.full(5, r + 10 * step, np.int32), 1)
                assert (b == 1 + 10 * step).all(), (r, step, b)

        _race(rank, engines, 60)
        for e in engines:
            # The first call of each op negotiates at rank 0; nearly all others go quick (a
            # rank that finds its engine thread busy for a moment takes the general way).
            assert e.stats["quick_rounds"] >= 60, e.stats
            assert e.stats["rounds_run"] >= e.stats["quick_rounds"] - 10, e.stats
    finally:
        _stop_all(engines)


def _lone(way: str, eng, op: int, name: str, x: np.ndarray, root: int = -1):
    """A synchronous call the ``way`` given: "quick" (submitted, ``_quick``) or "express"
    (``Engine.express``, submitted only if it does not qualify)."""
    if way == "quick":
        return _waited(eng, op, name, x, root)
    return _sync(eng, op, name, x, root=root)[0]


LONE = {"quick": "quick_rounds", "express": "express"}  # way -> its counter


@pytest.mark.parametrize("way", sorted(LONE))
def test_a_lone_round_that_the_peers_answer_differently_goes_through_rank_0(way):
    """Rank 0 runs lone synchronous ops the quick or express way while rank 1 submits the
    same two ops asynchronously in the other order (its round, if any, is for the other op,
    and while it has ops in flight it answers rank 0's rounds with nothing): rank 0's rounds
    fall back to rank 0 (an express call gets its entry then) and every result is exact.
    Rank 1 never runs a quick round."""
    engines = _shm_engines(2)
    try:

        def rank(r, eng):
            for step in range(30):
                if r == 0:
                    a = _lone(way, eng, ALLREDUCE, "a", np.full(2, step, np.float64))
                    b = _lone(way, eng, ALLREDUCE, "b", np.full(2, 2 * step, np.float64))
                else:
                    # In the other order: rank 1 posts a round for "b" (or "b" and "a")
                    # that rank 0's round for "a" disagrees with.
                    hb = _submit_op(eng, ALLREDUCE, "b", np.full(2, 2.0, np.float64))
                    ha = _submit_op(eng, ALLREDUCE, "a", np.full(2, 1.0, np.float64))
                    a, b = ha.wait()[0], hb.wait()[0]
                assert (a == step + 1).all() and (b == 2 * step + 2).all(), (r, step, a, b)

        _race(rank, engines, 60)
        assert engines[0].stats[LONE[way]] >= 20, engines[0].stats
        assert engines[1].stats["quick_rounds"] == 0, engines[1].stats
        assert engines[0].stats["rounds_run"] <= 2, engines[0].stats  # fallbacks, not rounds
    finally:
        _stop_all(engines)


@pytest.mark.parametrize("way", sorted(LONE))
def test_a_lone_round_whose_peer_posts_late_is_finished_by_the_general_path(way):
    """Rank 1 reaches each op 20 ms after rank 0, far past rank 0's spin: rank 0's quick
    round (or express call, which makes its entry then) stops waiting and the general path
    (its waiting thread, then its engine thread) finishes it once rank 1 posts. The rounds
    still run (no fallback), results are exact, nothing is left in the table."""
    engines = _shm_engines(2)
    try:

        def rank(r, eng):
            for step in range(12):
                if r == 1:
                    time.sleep(0.02)
                out = _lone(way, eng, ALLREDUCE, "late", np.full(4, r + step, np.float32))
                assert (out == 2 * step + 1).all(), (r, step, out)

        _race(rank, engines, 60)
        for e in engines:
            assert e.stats[LONE[way]] >= 10, e.stats
            assert e.stats["rounds_run"] >= 10, e.stats
            assert not e.table
    finally:
        _stop_all(engines)


def test_no_quick_round_while_another_op_is_in_flight_on_the_rank():
    """An asynchronous op still pending on the rank (a broadcast, new to the cache, waiting
    at rank 0 for its root) keeps a synchronous call off the quick way: it goes the general
    way, and both complete once the root submits."""
    engines = _shm_engines(2)
    try:
        _cache_w(engines)
        quick = [e.stats["quick_rounds"] for e in engines]
        pending = _submit_op(engines[1], BROADCAST, "p", np.full(2, 1, np.int64), 0)
        got: list = []
        t = threading.Thread(
            target=lambda: got.append(_waited(engines[1], ALLREDUCE, "w", np.full(2, 5, np.int64)))
        )
        t.start()
        time.sleep(0.05)
        assert engines[1].stats["quick_rounds"] == quick[1]
        assert (_waited(engines[0], ALLREDUCE, "w", np.full(2, 4, np.int64)) == 9).all()
        t.join(10)
        assert got and (got[0] == 9).all()
        root = _submit_op(engines[0], BROADCAST, "p", np.full(2, 7, np.int64), 0)
        assert (root.wait()[0] == 7).all() and (pending.wait()[0] == 7).all()
        assert engines[1].stats["quick_rounds"] == quick[1]
    finally:
        _stop_all(engines)


def test_a_failure_while_checking_for_the_quick_way_leaves_the_engine_free():
    """``_alone`` takes the engine's ``drive`` lock before its last checks: if one of them
    raises, the lock is released again (a held lock would hang every later wait), the call
    fails with the error, and the next synchronous calls work."""
    engines = _shm_engines(2)
    try:
        _cache_w(engines)
        t = engines[1].transport

        def broken():
            raise RuntimeError("ctrl_idle broke")

        t.ctrl_idle = broken
        with pytest.raises(RuntimeError, match="ctrl_idle broke"):
            _submit_op(engines[1], ALLREDUCE, "w", np.full(2, 1, np.int64), wake=False)
        assert engines[1].drive.acquire(blocking=False)
        engines[1].drive.release()
        del t.ctrl_idle
        got: list = []
        th = threading.Thread(
            target=lambda: got.append(_waited(engines[0], ALLREDUCE, "w", np.full(2, 4, np.int64)))
        )
        th.start()
        assert (_waited(engines[1], ALLREDUCE, "w", np.full(2, 5, np.int64)) == 9).all()
        th.join(10)
        assert got and (got[0] == 9).all()
    finally:
        _stop_all(engines)


def test_synchronous_ops_from_several_threads_of_each_rank_are_exact():
    """Two application threads per rank make synchronous calls on their own names at the same
    time: whichever takes the quick way, the others queue behind it, the ranks' rounds often
    disagree (fall back to rank 0), and nothing hangs or mixes up results."""
    engines = _shm_engines(2)
    try:

        def worker(r, k, eng):
            for step in range(40):
                x = np.full(3, 100 * k + r + step, np.int64)
                out = _waited(eng, ALLREDUCE, f"t{k}", x)
                assert (out == 200 * k + 1 + 2 * step).all(), (r, k, step, out)

        _race(worker, engines, 60, [(r, k, engines[r]) for r in (0, 1) for k in (0, 1)])
        assert sum(e.stats["quick_rounds"] for e in engines) > 0
    finally:
        _stop_all(engines)


SITE = "train.py:7 in step"


def _sync(eng, op: int, name: str, x: np.ndarray, out=None, reduce_op: int = 1, root: int = -1):
    """A frontend's synchronous call: the express way, or (``NOT_EXPRESS``) submitted with
    ``wake=False`` and waited for. Returns (result, whether it went express)."""
    from horovod.common.dtypes import code_of
    from horovod.core.express import NOT_EXPRESS
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import Request

    got = eng.express(op, name, x, out, reduce_op, root, lambda: SITE)
    if got is not NOT_EXPRESS:
        return got, True
    h = Handle(1)
    req = Request(0, name, op, code_of(x.dtype, "op"), x.shape, reduce_op, root)
    if out is None and op != ALLGATHER:
        out = np.empty_like(x)
    eng.submit([Entry(req, x, out, h)], wake=False)
    return h.wait()[0], False


def _express_taken(eng, name: str, x: np.ndarray):
    """``eng.express`` of an allreduce (Sum) of ``x``, tried until it qualifies: a peer's
    messages or the engine thread can make it decline for a moment, and declining posts
    nothing, so trying again is safe. Fails the test if it never does."""
    from horovod.core.express import NOT_EXPRESS
    from horovod.core.messages import SUM

    for _ in range(2000):
        got = eng.express(ALLREDUCE, name, x, None, SUM, -1, lambda: SITE)
        if got is not NOT_EXPRESS:
            return got
        time.sleep(0.002)
    raise AssertionError("the call never went the express way")


@pytest.mark.parametrize("n", [2, 3])
def test_express_calls_give_exact_results_without_entering_the_table(n):
    """Synchronous calls of small cached ops (in-place and new-array allreduces with Sum,
    Max and Average, broadcasts in place and into a new array, allgathers of different
    lengths per rank) take the express way once cached: no entry is ever made (the table
    stays empty), and every result is exact."""
    from horovod.core.messages import AVERAGE, MAX, SUM

    engines = _shm_engines(n)
    try:

        def rank(r, eng):
            for step in range(30):
                x = np.full(3, r + step, np.int64)
                out, _ = _sync(eng, ALLREDUCE, "s", x, x, SUM)
                assert out is x and (x == n * step + n * (n - 1) // 2).all(), (r, step, x)
                assert not eng.table and eng.express_key is None
                m, _ = _sync(eng, ALLREDUCE, "m", np.array([r * step], np.int32), None, MAX)
                assert m[0] == (n - 1) * step, (r, step, m)
                a, _ = _sync(eng, ALLREDUCE, "a", np.full(2, float(r + step)), None, AVERAGE)
                assert (a == step + (n - 1) / 2).all(), (r, step, a)
                b = np.full(5, r + 10 * step, np.int32)
                got, _ = _sync(eng, BROADCAST, "b", b, b, SUM, 1)
                assert got is b and (b == 1 + 10 * step).all(), (r, step, b)
                c, _ = _sync(eng, BROADCAST, "c", np.full(2, r + step, np.float32), None, SUM, 0)
                assert (c == step).all(), (r, step, c)
                g, _ = _sync(eng, ALLGATHER, "g", np.full((r + 1, 2), r * step, np.float32))
                want = np.concatenate([np.full((q + 1, 2), q * step) for q in range(n)])
                assert g.shape == want.shape and (g == want).all(), (r, step, g)
                assert not eng.table and eng.express_key is None

        _race(rank, engines, 60)
        for e in engines:
            # The first call of each of the six ops negotiates at rank 0; most others go
            # express (a rank that finds its engine thread busy for a moment does not).
            assert e.stats["express"] >= 60, e.stats
            assert e.stats["quick_rounds"] >= e.stats["express"], e.stats
    finally:
        _stop_all(engines)


@pytest.mark.parametrize("n", [2, 3])
def test_express_allreduces_too_large_for_a_data_round_run_on_the_data_plane(n):
    """Synchronous allreduces above the data rounds' budget (16 KiB in these engines: 20 KB goes
    by direct exchange, 400 KB by the ring) take the express way too once cached: the calling
    thread posts a plane round and runs the op on the data plane itself, with no entry (the
    table stays empty). In place and into a new array, with Sum, Average and Max; results are
    exact and every rank gets the same bits."""
    from horovod.core.messages import AVERAGE, MAX, SUM

    engines = _shm_engines(n)
    for e in engines:
        e.spin_s = 0.05  # a caller waits for its peers' posts however slow their threads are
    got: dict = {}
    try:

        def rank(r, eng):
            base = np.arange(5000, dtype=np.float32)
            for step in range(20):
                x = base * (r + 1) + step
                out, _ = _sync(eng, ALLREDUCE, "p", x, x, SUM)
                assert out is x and (x == base * (n * (n + 1) // 2) + n * step).all(), (r, step)
                assert not eng.table and eng.express_key is None
                big = np.linspace(0.0, 1.0, 50_000) * (r + 1) + step  # float64, 400 KB
                a, _ = _sync(eng, ALLREDUCE, "a", big, None, AVERAGE)
                want = np.linspace(0.0, 1.0, 50_000) * ((n + 1) / 2) + step
                assert a is not big and np.allclose(a, want, rtol=1e-12, atol=0), (r, step)
                got[(r, step)] = a
                m, _ = _sync(eng, ALLREDUCE, "m", np.arange(40_000) * (r - 1), None, MAX)
                assert (m == np.arange(40_000) * (n - 2)).all(), (r, step)
                assert not eng.table and eng.express_key is None

        _race(rank, engines, 60)
        for step in range(20):  # the same bits on every rank
            assert all(got[(r, step)].tobytes() == got[(0, step)].tobytes() for r in range(n))
        for e in engines:
            # The first call of each op negotiates at rank 0; nearly all others go express (a
            # rank that finds its engine thread busy for a moment does not).
            assert e.stats["express_plane"] >= 40, e.stats
            assert e.stats["express"] >= e.stats["express_plane"], e.stats
    finally:
        _stop_all(engines)


@pytest.mark.parametrize("n", [2, 3])
def test_express_broadcasts_too_large_for_a_data_round_run_on_the_data_plane(n):
    """Synchronous broadcasts above the board's data room take the express way once cached,
    as large allreduces do: a plane round, then the broadcast on the data plane from the
    calling thread, with no entry. In place and into a new array, from every root."""
    from horovod.core.messages import BROADCAST

    engines = _shm_engines(n)
    for e in engines:
        e.spin_s = 0.05
    try:

        def rank(r, eng):
            for step in range(12):
                root = step % n
                x = np.full(600_000, 10 * r + step, np.int32)  # 2.4 MB: past the board
                out, _ = _sync(eng, BROADCAST, f"b{root}", x, x, root=root)
                assert out is x and (x == 10 * root + step).all(), (r, step)
                y = np.full(600_000, 10 * r + step, np.int32)
                got, _ = _sync(eng, BROADCAST, f"c{root}", y, None, root=root)
                assert got is not y and (got == 10 * root + step).all(), (r, step)
                assert (y == 10 * r + step).all()  # the input of a new-array broadcast
                assert not eng.table and eng.express_key is None

        _race(rank, engines, 60)
        for e in engines:
            # The first call of each name negotiates at rank 0; most others go express.
            assert e.stats["express_plane"] >= 8, e.stats
    finally:
        _stop_all(engines)


def test_an_express_plane_round_meets_a_peer_that_submitted_the_op():
    """Rank 0 reduces a large cached op the express way while rank 1 submits it (the
    general path posts the same plane round): both run it on the data plane while rank 1
    comes within rank 0's spin, and when rank 1 comes far past the spin rank 0's call
    finishes the general way. The ranks meet at a barrier before every step and rank 1
    then waits, so who comes first does not depend on the machine's load."""
    from horovod.core.messages import SUM

    engines = _shm_engines(2)
    meet = threading.Barrier(2)
    steps = 8
    try:

        def rank(r, eng):
            for step in range(2 * steps):
                late = step >= steps
                if r == 0:
                    # On time: rank 1 comes ~10 ms after rank 0, well within a 2 s spin.
                    # Late: it comes 60 ms after, far past a 2 ms one.
                    eng.spin_s = 0.002 if late else 2.0
                x = np.full(20_000, r + step, np.int64)
                meet.wait(30)
                if r == 0:
                    time.sleep(0.002)  # let this rank's engine thread settle
                    out, _ = _sync(eng, ALLREDUCE, "big", x, x, SUM)
                else:
                    time.sleep(0.06 if late else 0.01)
                    out = _submit_op(eng, ALLREDUCE, "big", x).wait()[0]
                assert (out == 2 * step + 1).all(), (r, step, out[:3])

        _race(rank, engines, 60)
        st = engines[0].stats
        # The first call negotiates at rank 0; a call that finds its engine thread busy
        # for a moment goes the general way: most of the on-time calls run express.
        assert st["express_plane"] >= steps // 2, st
        # Every late call began express and finished the general way.
        assert st["express"] - st["express_plane"] >= steps // 2, st
        assert engines[1].stats["express"] == 0, engines[1].stats
        for e in engines:
            assert e.stats["rounds_run"] >= 2 * steps - 1, e.stats
            assert not e.table
    finally:
        _stop_all(engines)


def test_a_failure_inside_an_express_plane_round_fails_the_call_and_the_job(monkeypatch):
    """An error while an express call runs its plane round on the data plane fails the call
    with the error and the caller's file and line, aborts the job on every rank and leaves
    the engine free."""
    from horovod.common.exceptions import HorovodInternalError, TransportError
    from horovod.core.express import NOT_EXPRESS
    from horovod.core.messages import SUM

    engines = _shm_engines(2)
    try:
        for step in range(3):  # cache "big"
            outs = [_submit_op(e, ALLREDUCE, "big", np.full(20_000, step)) for e in engines]
            assert all((h.wait()[0] == 2 * step).all() for h in outs)
        caller = threading.current_thread()
        real = engines[0]._express_plane

        def broken(*a, **k):
            if threading.current_thread() is not caller:
                return real(*a, **k)
            raise TransportError("the data plane broke")

        monkeypatch.setattr(engines[0], "_express_plane", broken)
        engines[0].spin_s = 5.0  # waits for rank 1's post however slow its thread is
        peer = _submit_op(engines[1], ALLREDUCE, "big", np.full(20_000, 1))
        with pytest.raises(HorovodInternalError, match="the data plane broke") as info:
            for _ in range(2000):
                got = engines[0].express(
                    ALLREDUCE, "big", np.full(20_000, 4), None, SUM, -1, lambda: SITE
                )
                if got is not NOT_EXPRESS:
                    break
                time.sleep(0.002)
        assert SITE in str(info.value)
        monkeypatch.undo()
        assert engines[0].express_key is None
        assert engines[0].drive.acquire(timeout=5)
        engines[0].drive.release()
        with pytest.raises(HorovodInternalError):
            peer.wait()
        deadline = time.monotonic() + 10
        while engines[1].closed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engines[1].closed is not None
    finally:
        _stop_all(engines)


def test_express_refuses_what_it_cannot_run_and_leaves_no_trace():
    """An uncached name, a request that differs from the cached one (dtype, shape, reduce
    op, root), the express way switched off, or another op in flight on the rank: the call
    returns ``NOT_EXPRESS`` with nothing posted, no entry made, the engine free. A check that
    raises fails the call and leaves the engine free too."""
    from horovod.core.express import NOT_EXPRESS
    from horovod.core.messages import MAX, SUM

    engines = _shm_engines(2)
    try:
        for step in range(3):  # cache "w" (int64, 2 elements) and broadcast "p" from rank 0
            outs = [_submit_op(e, ALLREDUCE, "w", np.full(2, step, np.int64)) for e in engines]
            assert all((h.wait()[0] == 2 * step).all() for h in outs)
            outs = [_submit_op(e, BROADCAST, "p", np.full(2, 3, np.int64), 0) for e in engines]
            assert all((h.wait()[0] == 3).all() for h in outs)
        eng = engines[1]
        before = dict(eng.stats)

        def refused(op, name, x, reduce_op=SUM, root=-1):
            got = eng.express(op, name, x, None, reduce_op, root, lambda: SITE)
            assert got is NOT_EXPRESS, (name, x.dtype, x.shape, reduce_op, root)
            assert eng.express_key is None
            assert eng.drive.acquire(timeout=5)  # (the engine thread may hold it a moment)
            eng.drive.release()

        ok = np.full(2, 1, np.int64)
        refused(ALLREDUCE, "never", ok)
        refused(ALLREDUCE, "w", ok.astype(np.int32))
        refused(ALLREDUCE, "w", np.full(3, 1, np.int64))
        refused(ALLREDUCE, "w", ok, MAX)
        refused(BROADCAST, "p", ok, SUM, 1)
        refused(ALLGATHER, "w", ok)
        eng.express_on = False
        refused(ALLREDUCE, "w", ok)
        eng.express_on = True
        pending = _submit_op(eng, BROADCAST, "q", np.full(2, 1, np.int64), 0)  # new: in flight
        refused(ALLREDUCE, "w", ok)
        assert eng.stats == before | {k: eng.stats[k] for k in ("cycles", "requests_sent")}
        assert eng.board.n == engines[0].board.n  # nothing posted
        root = _submit_op(engines[0], BROADCAST, "q", np.full(2, 7, np.int64), 0)
        assert (root.wait()[0] == 7).all() and (pending.wait()[0] == 7).all()

        def broken():
            raise RuntimeError("ctrl_idle broke")

        eng.transport.ctrl_idle = broken  # a check that raises: the call fails, engine free
        with pytest.raises(RuntimeError, match="ctrl_idle broke"):
            eng.express(ALLREDUCE, "w", ok, None, SUM, -1, lambda: SITE)
        del eng.transport.ctrl_idle
        assert eng.express_key is None
        assert eng.drive.acquire(timeout=5)
        eng.drive.release()
        outs = [_submit_op(e, ALLREDUCE, "w", np.full(2, 1, np.int64)) for e in engines]
        assert all((h.wait()[0] == 2).all() for h in outs)  # and "w" still works
    finally:
        _stop_all(engines)


@pytest.mark.parametrize("n", [2, 3])
def test_express_lanes_follow_the_cache_when_a_names_request_changes(n, monkeypatch):
    """The express way keeps what it learned about a name (its lane) and, on later calls, only
    compares: when the same name is called with another shape, dtype or reduction, the cache
    entry is replaced through rank 0 and the next calls must use the new one, never the lane
    of the old request (nor a lane whose request came back under a new cache id). Every
    result is exact; the lanes are bounded (here: at most 2, so three names drop and remake
    them) and calls still go express."""
    import horovod.core.express as express
    from horovod.core.express import NOT_EXPRESS
    from horovod.core.messages import MAX, MIN, SUM

    monkeypatch.setattr(express, "MAX_LANES", 2)
    engines = _shm_engines(n)
    requests = [  # (shape, dtype, reduction, calls)
        ((3,), np.int64, SUM, 8),
        ((4,), np.int64, SUM, 8),
        ((2, 2), np.int64, SUM, 8),
        ((4,), np.int32, SUM, 8),
        ((4,), np.int32, MAX, 8),
        ((4,), np.float64, MIN, 8),
        ((3,), np.int64, SUM, 8),
        ((5,), np.int64, SUM, 1),  # negotiated only: the lane of (3,) stays, but stale
        ((3,), np.int64, SUM, 8),
    ]
    try:

        def rank(r, eng):
            for others in ((), ("u", "v")):  # (other names: their lanes push "w"'s out)
                for shape, dtype, op, calls in requests:
                    for step in range(calls):
                        x = np.full(shape, r + step, dtype)
                        got, went = _sync(eng, ALLREDUCE, "w", x, None, op)
                        want = {SUM: n * step + n * (n - 1) // 2, MAX: step + n - 1, MIN: step}
                        assert got.shape == shape and got.dtype == dtype, (r, shape, got)
                        assert (got == want[op]).all(), (r, shape, dtype, op, step, got)
                        lane = eng._lanes.get("w")
                        if went:  # its lane is the cache's entry for this request
                            assert lane.cid == eng.sets[0].cache.by_name["w"], (r, lane.cid)
                            assert (lane.shape, lane.dtype, lane.reduce_op) == (shape, dtype, op)
                        for name in others:
                            y = np.full(2, r * step, np.int64)
                            u, _ = _sync(eng, ALLREDUCE, name, y, None, SUM)
                            assert (u == step * n * (n - 1) // 2).all(), (r, name, step, u)
                        assert len(eng._lanes) <= 2, eng._lanes
            got, _ = _sync(eng, ALLREDUCE, "w", np.full(3, r, np.int64), None, SUM)
            assert (got == n * (n - 1) // 2).all(), (r, got)

        _race(rank, engines, 60)
        for e in engines:
            assert e.stats["express"] >= len(requests) * 4, e.stats
        # A lane never stands for a request it was not made for: a call that differs from
        # the cached one is refused, with nothing posted.
        eng = engines[1]
        lane = eng._lanes.get("w")
        assert lane is not None and lane.shape == (3,) and lane.dtype == np.int64
        posted = eng.board.n
        for x, op in (
            (np.ones(3, np.int32), SUM),
            (np.ones(4, np.int64), SUM),
            (np.ones(3, np.int64), MAX),
        ):
            got = eng.express(ALLREDUCE, "w", x, None, op, -1, lambda: SITE)
            assert got is NOT_EXPRESS, (x.dtype, x.shape, op)
            assert eng.express_key is None
        assert eng.board.n == posted
    finally:
        _stop_all(engines)


def test_a_submission_under_the_name_of_an_express_call_in_progress_is_refused():
    """While an express call waits for its peers (it has no entry in the table), another
    thread of the rank submitting an op under the same name is told the name is in flight,
    exactly as if the first had been submitted; the express call then completes."""
    engines = _shm_engines(2)
    try:
        _cache_w(engines)
        engines[0].spin_s = 5.0  # rank 0 spins for its peer's post as long as the test needs
        got: list = []
        t = threading.Thread(
            target=lambda: got.append(_express_taken(engines[0], "w", np.full(2, 4, np.int64)))
        )
        t.start()
        deadline = time.monotonic() + 10
        while engines[0].express_key is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engines[0].express_key == (0, "w")
        with pytest.raises(ValueError, match="already in flight on this rank under the name 'w'"):
            _submit_op(engines[0], ALLREDUCE, "w", np.full(2, 1, np.int64))
        out, _ = _sync(engines[1], ALLREDUCE, "w", np.full(2, 5, np.int64))
        t.join(10)
        assert (out == 9).all() and got and (got[0] == 9).all()
        assert not engines[0].table and engines[0].express_key is None
    finally:
        _stop_all(engines)


@pytest.mark.parametrize("where", ["board_post", "_express_result"])
def test_a_failure_inside_an_express_call_fails_the_call_with_its_site_and_the_job(
    monkeypatch, where
):
    """An error while posting the round or computing the result from the peer's post fails
    the call with the error and the caller's file and line (as a submitted op would), aborts
    the job (the peer's pending op fails too instead of hanging) and leaves the engine free;
    an interrupt (Ctrl-C) there aborts as well and is raised on."""
    from horovod.common.exceptions import HorovodInternalError, TransportError

    for kind in (TransportError, KeyboardInterrupt):
        engines = _shm_engines(2)
        try:
            _cache_w(engines)

            target = engines[0].transport if where == "board_post" else engines[0]
            real = getattr(target, where)
            caller = threading.current_thread()

            def broken(*a, kind=kind, real=real, caller=caller, **k):
                if threading.current_thread() is not caller:  # the engine thread: as usual
                    return real(*a, **k)
                raise kind("the board broke")

            monkeypatch.setattr(target, where, broken)
            engines[0].spin_s = 5.0  # waits for rank 1's post however slow its thread is
            peer = _submit_op(engines[1], ALLREDUCE, "w", np.full(2, 1, np.int64))

            if kind is TransportError:
                with pytest.raises(HorovodInternalError, match="the board broke") as info:
                    _express_taken(engines[0], "w", np.full(2, 4, np.int64))
                assert SITE in str(info.value)
            else:
                with pytest.raises(KeyboardInterrupt):
                    _express_taken(engines[0], "w", np.full(2, 4, np.int64))
                assert "was interrupted (KeyboardInterrupt)" in engines[0].closed
            monkeypatch.undo()
            assert engines[0].express_key is None
            assert engines[0].drive.acquire(timeout=5)
            engines[0].drive.release()
            if where == "board_post":  # rank 0 never posted: rank 1's op fails
                with pytest.raises(HorovodInternalError):
                    peer.wait()
            # (Otherwise rank 1 may have finished its op from the posts before the abort.)
            deadline = time.monotonic() + 10
            while engines[1].closed is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engines[1].closed is not None  # the job is aborted on every rank
        finally:
            _stop_all(engines)


def test_peer_rounds_mix_with_data_plane_ops_submitted_around_them():
    """Each rank posts a lone small cached allreduce to a peer round and at once submits ops
    that go through rank 0 and the data plane (a large allreduce, an allgather, a broadcast):
    the round completes on its own, whatever the lists do meanwhile. Every result is checked."""
    engines = _shm_engines(2)
    try:

        def rank(r, eng):
            for step in range(60):
                hs = _submit_op(eng, ALLREDUCE, "s", np.full(4, r + step, np.float64))
                time.sleep(0.002)  # posted by now, most of the time
                hg = _submit_op(eng, ALLGATHER, "g", np.full((2, 3), r + step, np.int32))
                hz = _submit_op(eng, ALLREDUCE, "z", np.full(50_000, r + step, np.float32))
                hb = _submit_op(eng, BROADCAST, "b", np.full(4, r * 10 + step, np.int64), 1)
                assert (hs.wait()[0] == 2 * step + 1).all()
                g = hg.wait()[0]
                assert g.shape == (4, 3) and (g[:2] == step).all() and (g[2:] == step + 1).all()
                assert (hz.wait()[0] == 2 * step + 1).all()
                assert (hb.wait()[0] == 10 + step).all()
                b = _submit_op(eng, BROADCAST, "lone", np.full(8, r + step, np.int64), 0)
                assert (b.wait()[0] == step).all()

        _race(rank, engines, 60)
        _exercised(engines, "rounds_run")
    finally:
        _stop_all(engines)


def test_an_idle_rank_answers_a_peer_round_with_its_own_post_or_after_the_answer_wait():
    """A rank with nothing in flight does not answer a peer's round at once: it is most likely
    about to submit the same op (ranks reach their gradients at different times), and when it
    does within the answer wait the round runs. If it submits nothing, it answers after the
    wait and the posted op goes to rank 0, whose stall checks then see it."""
    engines = _shm_engines(2, stall_check_seconds=2.0)  # answer wait: 0.2 s
    try:
        assert engines[1].answer_wait_s == pytest.approx(0.2)
        x = [np.full(50_000, r + 1.0, np.float32) for r in range(2)]  # a plane round
        for _step in range(2):  # the first negotiates at rank 0, the second hits the cache
            hs = [_submit_op(e, ALLREDUCE, "late", x[r]) for r, e in enumerate(engines)]
            assert all((h.wait()[0] == 3.0).all() for h in hs)
        run0 = [e.stats["rounds_run"] for e in engines]
        h0 = _submit_op(engines[0], ALLREDUCE, "late", x[0])
        time.sleep(0.08)  # rank 1 "computes": its engine sees the post and waits
        assert not h0.done()
        h1 = _submit_op(engines[1], ALLREDUCE, "late", x[1])
        assert (h0.wait()[0] == 3.0).all() and (h1.wait()[0] == 3.0).all()
        assert [e.stats["rounds_run"] for e in engines] == [k + 1 for k in run0]
        # Nothing comes from rank 1: after the wait rank 1 answers, and rank 0's op waits at
        # the coordinator (in its table of pending requests) instead of in the round.
        posted = engines[0].stats["rounds_posted"]
        h0 = _submit_op(engines[0], ALLREDUCE, "late", x[0])
        deadline = time.monotonic() + 5
        coord = engines[0].coordinator
        while "late" not in coord.tables.get(0, {}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "late" in coord.tables.get(0, {}), coord.tables
        assert engines[0].stats["rounds_posted"] == posted + 1
        assert not h0.done()
        h1 = _submit_op(engines[1], ALLREDUCE, "late", x[1])
        assert (h0.wait()[0] == 3.0).all() and (h1.wait()[0] == 3.0).all()
    finally:
        _stop_all(engines)


def test_plane_rounds_interleave_with_lists_of_a_process_set_without_the_poster():
    """3 ranks: ranks 1 and 2 run ops of their own process set (through rank 0's lists) around
    data-plane rounds of the global set, so a poster holds back lists that its peers are
    executing. Nobody may wait on a rank that holds, and every result is exact."""
    engines = _shm_engines(3, process_sets=[[1, 2]])
    try:

        def rank(r, eng):
            for step in range(40):
                g = _submit_op(eng, ALLREDUCE, "g", np.full(30_000, r + step, np.float64))
                if r:
                    p = _submit_op(eng, ALLREDUCE, f"p{step % 3}", np.full(9, r, np.int64), ps_id=1)
                    assert (p.wait()[0] == 3).all()
                assert (g.wait()[0] == 3 + 3 * step).all(), (r, step)
                b = _submit_op(eng, BROADCAST, "b", np.full(300_000, r + step, np.int32), 2)
                if r == 0:
                    time.sleep(0.001)
                assert (b.wait()[0] == 2 + step).all(), (r, step)
                if r:
                    q = _submit_op(eng, ALLGATHER, "q", np.full((r, 2), step, np.int32), ps_id=1)
                    assert q.wait()[0].shape == (3, 2)

        _race(rank, engines, 90)
        _exercised(engines, "rounds_run")
    finally:
        _stop_all(engines)


def test_ops_submitted_after_a_plane_post_run_after_the_round_on_every_rank():
    """Ranks 1 and 2 post a data-plane round of the global set and at once submit an op of
    their own process set, which goes to rank 0 (the board is taken); rank 0 posts the round
    at a random moment, so the set's list reaches ranks 1 and 2 before or after the round is
    complete. Both must run the round before that list (a poster holds lists back), or they
    would read each other's bytes for the wrong op."""
    engines = _shm_engines(3, process_sets=[[1, 2]])
    try:

        def rank(r, eng):
            rng = np.random.default_rng(r)
            for step in range(80):
                if r == 0:
                    time.sleep(rng.random() * 0.003)
                g = _submit_op(eng, ALLREDUCE, "g", np.full(40_000, r + step, np.float32))
                if r:
                    y = np.full(60_000, 100 * r, np.float32)
                    y = _submit_op(eng, ALLREDUCE, "y", y, ps_id=1)
                    assert (y.wait()[0] == 300).all(), (r, step, "y")
                assert (g.wait()[0] == 3 + 3 * step).all(), (r, step, "g")

        _race(rank, engines, 60)
        # Rank 0 runs the set's lists while ranks 1 and 2 hold them: their posts name
        # different list counts, and such rounds fall back (the results above are exact).
        _exercised(engines, "rounds_posted")
    finally:
        _stop_all(engines)


def test_a_plane_round_posted_after_a_list_the_peer_has_not_run_falls_back():
    """Rank 0 roots a broadcast (a new name: negotiated) that rank 1 submits only after posting
    a data-plane round:
    rank 0 finishes the broadcast (its bytes wait in the channel) and posts the same round,
    while rank 1 holds the broadcast's list back. The posts name the same op but different
    list counts, so the round must fall back; running it would make rank 1 read the
    broadcast's bytes as the round's."""
    engines = _shm_engines(2)
    try:

        def rank(r, eng):
            for step in range(30):
                g_in = np.full(40_000, r + step, np.float32)
                b_in = np.full(3000, step if r == 0 else -1, np.int64)
                if r == 0:
                    b = _submit_op(eng, BROADCAST, f"b{step}", b_in, 0)
                    assert (b.wait()[0] == step).all(), (r, step, "b")
                    g = _submit_op(eng, ALLREDUCE, "g", g_in)
                else:
                    g = _submit_op(eng, ALLREDUCE, "g", g_in)
                    time.sleep(0.002)  # posted by now
                    b = _submit_op(eng, BROADCAST, f"b{step}", b_in, 0)
                    assert (b.wait()[0] == step).all(), (r, step, "b")
                assert (g.wait()[0] == 1 + 2 * step).all(), (r, step, "g")

        _race(rank, engines, 60)
        posted = [e.stats["rounds_posted"] for e in engines]
        assert posted[0] >= 20 and posted[1] >= 20, [e.stats for e in engines]
    finally:
        _stop_all(engines)


def test_round_decisions_need_the_same_ops_kind_bytes_and_list_count():
    from horovod.core.messages import Response
    from horovod.core.peer_rounds import decide

    ag = Response(ALLGATHER, 0, ["allgather.x"], dtype=7, shapes=[(2, 5)], dim0s=[[2, 3]])
    bc = Response(BROADCAST, 0, ["broadcast.b"], dtype=7, shapes=[(4,)], root=1)
    items = [(None, ag), (None, bc)]
    mem = memoryview(bytes(100))
    # Data rounds: rank 1 posts its 3 rows of 5 float32s and, as root, the 4 broadcast ones.
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [4, 5], mem[:76], -1)]) == "data"
    assert decide(items, [4, 5], 6 << 1, [(1, 2 << 1, [4, 5], mem[:76], -1)]) == "data"
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [4, 5], mem[:60], -1)]) == "fallback"
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [5, 4], mem[:76], -1)]) == "fallback"
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [], mem[:0], -1)]) == "fallback"
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1 | 1, [4, 5], mem[:0], -1)]) == "fallback"
    # With the bytes per rank the poster already knows (rank 0: 2 rows, no broadcast part).
    assert decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [4, 5], mem[:76], -1)], [40, 76]) == "data"
    assert (
        decide(items, [4, 5], 6 << 1, [(1, 6 << 1, [4, 5], mem[:40], -1)], [40, 76]) == "fallback"
    )
    # Plane rounds: same ids after the same number of response lists.
    tag = 6 << 1 | 1
    assert decide(items, [4, 5], tag, [(1, tag, [4, 5], mem[:0], -1)]) == "plane"
    assert decide(items, [4, 5], tag, [(1, 7 << 1 | 1, [4, 5], mem[:0], -1)]) == "fallback"
    assert decide(items, [4, 5], tag, [(1, 6 << 1, [4, 5], mem[:76], -1)]) == "fallback"
    assert decide(items, [4, 5], tag, [(1, tag, [4], mem[:0], -1)]) == "fallback"


def test_the_allreduce_budget_of_a_data_round_shrinks_with_the_ranks():
    """Every rank reads every other's post of an allreduce's data round: one post's room on
    the board over the other ranks, over more than 2 no more than the data plane reduces in
    rank order (same bits as the plane: its direct exchange, then its ordered reduction), the
    eager budget as a floor (the board's room as a ceiling), and none at all when it is 0."""
    from horovod.collectives import algorithms as alg
    from horovod.core.engine_state import round_allreduce_budget

    shm, tcp, ordered = 1 << 20, 256 << 10, alg.ORDERED_BYTES
    assert round_allreduce_budget(16384, 2, shm) == shm
    assert round_allreduce_budget(16384, 2, tcp) == tcp
    assert round_allreduce_budget(16384, 3, shm) == min(shm // 2, ordered)
    assert round_allreduce_budget(16384, 4, shm) == shm // 3
    assert round_allreduce_budget(16384, 3, tcp) == tcp // 2
    assert round_allreduce_budget(16384, 8, tcp) == tcp // 7
    assert round_allreduce_budget(16384, 64, tcp) == 16384  # the eager budget is the floor
    assert round_allreduce_budget(4 << 20, 3, shm) == shm  # ... and the board the ceiling
    assert round_allreduce_budget(0, 2, shm) == 0  # HOROVOD_EAGER_ALLREDUCE_BYTES=0: off
    assert round_allreduce_budget(16384, 2, 0) == 0  # no board
    # ranks on several hosts (posts cross the link once per pair of ranks): the eager budget
    assert round_allreduce_budget(16384, 4, tcp, large=False) == 16384
