"""Every error path: mismatches across ranks reach every rank naming tensor, ranks and values;
bad arguments fail at the call; nothing hangs."""

import threading

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.common.exceptions import HorovodInternalError
from horovod.testing import RankFailed, run_ranks

AT = r" \(test_errors\.py:\d+ in \S+\)"  # the call site each rank's request carries


def has(pattern, messages):
    import re

    return all(re.search(pattern, m) for m in messages)


def errors_on_every_rank(body, size=3):
    """Run ``body``; return the HorovodInternalError text each rank got."""

    def wrapped(rank):
        with pytest.raises(HorovodInternalError) as info:
            body(rank)
        hvd.barrier()  # the job is still usable after a mismatch
        return str(info.value)

    return run_ranks(wrapped, size)


def test_shape_mismatch_names_tensor_ranks_values():
    msgs = errors_on_every_rank(
        lambda r: hvd.allreduce(np.zeros((4, 2 if r != 2 else 3)), name="fc1.weight")
    )
    for m in msgs:
        assert "allreduce 'fc1.weight'" in m
        assert has(rf"shape \(4, 2\) on rank 0{AT} but \(4, 3\) on rank 2{AT}", [m])
        assert "every rank must submit the same shape" in m
        assert "test_errors.py" in m  # where this rank submitted it


def test_dtype_mismatch():
    msgs = errors_on_every_rank(
        lambda r: hvd.allreduce(np.zeros(3, np.float32 if r else np.int32), name="t")
    )
    assert has(f"dtype int32 on rank 0{AT} but float32 on rank 1{AT}", msgs)


def test_op_mismatch():
    msgs = errors_on_every_rank(
        lambda r: hvd.allreduce(np.zeros(3), name="t", op=hvd.Sum if r != 1 else hvd.Max)
    )
    assert has(f"reduce op Sum on rank 0{AT} but Max on rank 1{AT}", msgs)


def test_collective_type_mismatch():
    """The same core name submitted as allreduce on one rank and allgather on another."""
    from horovod.core.context import current
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import ALLGATHER, ALLREDUCE, Request

    def body(rank):
        op = ALLGATHER if rank == 1 else ALLREDUCE
        h = Handle(1)
        x = np.zeros(3)
        current().engine.submit([Entry(Request(0, "same.name", op, 8, (3,)), x, x.copy(), h)])
        with pytest.raises(HorovodInternalError) as info:
            h.wait()
        return str(info.value)

    for m in run_ranks(body, 2):
        assert "rank 0 called allreduce but rank 1 called allgather" in m


def test_scale_factor_mismatch():
    msgs = errors_on_every_rank(
        lambda r: hvd.allreduce(np.zeros(3), name="t", prescale_factor=2.0 if r == 2 else 1.0)
    )
    assert has(
        rf"\(prescale_factor, postscale_factor\) \(1.0, 1.0\) on rank 0{AT} but \(2.0, 1.0\) "
        rf"on rank 2{AT}",
        msgs,
    )


def test_broadcast_root_mismatch():
    msgs = errors_on_every_rank(
        lambda r: hvd.broadcast(np.zeros(3), root_rank=0 if r else 1, name="b")
    )
    assert has(f"root_rank 1 on rank 0{AT} but 0 on rank 1{AT}", msgs)


def test_allgather_trailing_dim_mismatch():
    msgs = errors_on_every_rank(lambda r: hvd.allgather(np.zeros((2, 3 + (r == 1))), name="g"))
    assert all("only the first dimension may differ" in m for m in msgs)
    msgs = errors_on_every_rank(
        lambda r: hvd.allgather(np.zeros((2, 3) if r else (2, 3, 1)), name="g")
    )
    assert has(f"number of dimensions 3 on rank 0{AT} but 2 on rank 1{AT}", msgs)


def test_reducescatter_and_alltoall_shape_mismatch():
    msgs = errors_on_every_rank(lambda r: hvd.reducescatter(np.zeros((6, 1 + r)), name="rs"))
    assert all("reducescatter 'rs'" in m and "shape" in m for m in msgs)
    msgs = errors_on_every_rank(lambda r: hvd.alltoall(np.zeros((3, 1 + r)), name="a2a"))
    assert all("alltoall 'a2a'" in m for m in msgs)


def test_duplicate_name_in_flight_is_value_error_at_call():
    checked = threading.Event()

    def body(rank):
        if rank == 1:
            checked.wait(10)  # rank 0's "dup" cannot complete before it has been checked
        h = hvd.allreduce_async(np.zeros(3), name="dup")
        if rank == 0:
            with pytest.raises(ValueError, match="already in flight.*'allreduce.dup'"):
                hvd.allreduce_async(np.zeros(3), name="dup")
            checked.set()
        hvd.synchronize(h)
        hvd.synchronize(hvd.allreduce_async(np.zeros(3), name="dup"))  # free again

    run_ranks(body, 2)


def test_duplicate_name_within_one_submission():
    from horovod.core.context import current
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import ALLREDUCE, Request

    def body(rank):
        h = Handle(2)
        x = np.zeros(1)
        e = [Entry(Request(0, "twice", ALLREDUCE, 8, (1,)), x, x, h, i) for i in range(2)]
        with pytest.raises(ValueError, match="already in flight"):
            current().engine.submit(e)
        assert not current().engine.table  # nothing half-registered

    run_ranks(body, 1)


@pytest.mark.parametrize(
    "bad, exc, pattern",
    [
        (np.zeros(3, np.complex64), ValueError, "dtype complex64 is not supported"),
        (np.array(["a"]), ValueError, "is not supported"),
        (np.zeros((4, 4))[:, ::2], ValueError, "not C-contiguous"),
        ({"a": 1}, TypeError, "expected a NumPy array"),
    ],
)
def test_bad_arrays_fail_at_call(bad, exc, pattern):
    def body(rank):
        for fn in (
            hvd.allreduce,
            hvd.allgather,
            lambda x: hvd.broadcast(x, 0),
            hvd.alltoall,
            hvd.reducescatter,
        ):
            with pytest.raises(exc, match=pattern):
                fn(bad)

    run_ranks(body, 1)


def test_bad_arguments_fail_at_call():
    def body(rank):
        x = np.zeros(4)
        with pytest.raises(ValueError, match="root_rank=7 is not a rank"):
            hvd.broadcast(x, root_rank=7)
        with pytest.raises(ValueError, match="multiple of the number of ranks"):
            hvd.alltoall(np.zeros(3))
        with pytest.raises(ValueError, match="splits has 3 entries"):
            hvd.alltoall(x, splits=[1, 1, 2])
        with pytest.raises(ValueError, match="sum to 5, more than"):
            hvd.alltoall(x, splits=[2, 3])
        with pytest.raises(ValueError, match=">= 0"):
            hvd.alltoall(x, splits=[-1, 2])
        with pytest.raises(ValueError, match="must be 1-D"):
            hvd.alltoall(x, splits=[[1, 1]])
        with pytest.raises(ValueError, match="integers"):
            hvd.alltoall(x, splits=[1.0, 1.0])
        with pytest.raises(ValueError, match="at least one dimension"):
            hvd.allgather(np.float64(3.0))
        with pytest.raises(ValueError, match="at least one dimension"):
            hvd.reducescatter(np.zeros(()))
        with pytest.raises(ValueError, match="only op=hvd.Average and hvd.Sum"):
            hvd.reducescatter(x, op=hvd.Max)
        with pytest.raises(ValueError, match="Average is not defined for bool"):
            hvd.allreduce(np.zeros(2, bool))
        with pytest.raises(TypeError, match="op=Adasum needs floating-point tensors"):
            hvd.allreduce(np.arange(3), op=hvd.Adasum)
        with pytest.raises(ValueError, match="unknown op"):
            hvd.allreduce(x, op=42)
        with pytest.raises(ValueError, match="supersedes average"):
            hvd.allreduce(x, op=hvd.Sum, average=True)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(2)
            ro.flags.writeable = False
            hvd.allreduce_(ro)
        with pytest.raises(ValueError, match="must be finite"):
            hvd.allreduce(x, prescale_factor=float("nan"))
        with pytest.raises(ValueError, match="Handle 12345 was not created"):
            hvd.poll(12345)
        with pytest.raises(ValueError, match="Handle 12345 was not created"):
            hvd.synchronize(12345)
        hvd.barrier()

    run_ranks(body, 2)


def test_average_parameter_is_deprecated():
    def body(rank):
        with pytest.warns(DeprecationWarning, match="replaced with `op`"):
            out = hvd.allreduce(np.ones(2), average=False)
        np.testing.assert_array_equal(out, np.ones(2))

    run_ranks(body, 1)


def test_not_initialized_errors():
    for fn in (
        hvd.size,
        hvd.rank,
        hvd.local_rank,
        hvd.local_size,
        hvd.cross_rank,
        hvd.cross_size,
        hvd.is_homogeneous,
        lambda: hvd.allreduce(np.zeros(1)),
        lambda: hvd.start_timeline("x"),
    ):
        with pytest.raises(ValueError, match="has not been initialized"):
            fn()
    assert not hvd.is_initialized()
    hvd.shutdown()  # safe when not initialized


def test_failing_rank_does_not_hang_the_others():
    """Rank 1 raises before its allreduce: the harness shuts it down and rank 0's pending op
    fails with the shutdown message instead of waiting forever."""

    def body(rank):
        if rank == 1:
            raise RuntimeError("boom on rank 1")
        hvd.allreduce(np.zeros(3), name="never-matched")

    with pytest.raises(RankFailed) as info:
        run_ranks(body, 2, timeout=20)
    assert "boom on rank 1" in str(info.value.failures[1])
    assert "rank 1 called shutdown()" in str(info.value.failures[0])


def test_collectives_after_shutdown_of_another_rank_fail():
    ev = threading.Event()

    def body(rank):
        if rank == 0:
            hvd.shutdown()
            ev.set()
            return None
        ev.wait(10)
        with pytest.raises(HorovodInternalError, match=r"shut down \(rank 0 called shutdown"):
            hvd.allreduce(np.zeros(1))
        return "ok"

    assert run_ranks(body, 2)[1] == "ok"


def test_crashed_rank_is_named_on_every_other_rank():
    """A rank that vanishes without shutdown (in-process stand-in for a crash)."""
    from horovod.core.context import current

    ev = threading.Event()

    def body(rank):
        if rank == 2:
            current().engine.transport.close()  # connection lost, no shutdown message
            ev.set()
            return None
        ev.wait(10)
        with pytest.raises(HorovodInternalError, match="rank 2 exited or lost its connection"):
            hvd.allreduce(np.zeros(1), name="after")
        with pytest.raises(HorovodInternalError, match="rank 2 exited"):
            hvd.allreduce(np.zeros(1), name="later")
        return "ok"

    assert run_ranks(body, 3, timeout=30)[:2] == ["ok", "ok"]


def test_device_mismatch():
    from horovod.core.context import current
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import ALLREDUCE, Request

    def body(rank):
        h = Handle(1)
        x = np.zeros(3)
        req = Request(0, "dev", ALLREDUCE, 8, (3,), device=-1 if rank == 0 else 0)
        current().engine.submit([Entry(req, x, x.copy(), h)])
        with pytest.raises(HorovodInternalError) as info:
            h.wait()
        return str(info.value)

    for m in run_ranks(body, 2):
        assert "device CPU on rank 0 but GPU on rank 1" in m


def test_stall_is_reported_and_aborts_past_the_shutdown_limit(caplog):
    """Rank 1 never submits; the coordinator warns, then aborts naming rank 1 and the tensor."""
    import logging

    def body(rank):
        with pytest.raises(HorovodInternalError) as info:
            if rank == 1:
                hvd.barrier()  # waits for rank 0, which never gets there: stuck on 'lonely'
            else:
                hvd.allreduce(np.zeros(1), name="lonely")
        return str(info.value)

    env = {
        "HOROVOD_STALL_CHECK_DISABLE": "0",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.2",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0.6",
    }
    hlog = logging.getLogger("horovod")
    hlog.addHandler(caplog.handler)  # hvd.init() in-process makes it non-propagating
    try:
        with caplog.at_level(logging.WARNING, logger="horovod"):
            messages = run_ranks(body, 2, env=env, timeout=30)
    finally:
        hlog.removeHandler(caplog.handler)
    import re

    msg = messages[1]  # every rank gets the whole report
    assert re.search(
        r"allreduce 'lonely': submitted by rank 0 at test_errors.py:\d+ in body, "
        r"waiting [\d.]+ s for rank 1\.",
        msg,
    )
    assert re.search(
        r"barrier: submitted by rank 1 at test_errors.py:\d+ in body, "
        r"waiting [\d.]+ s for rank 0\.",
        msg,
    )
    assert re.search(
        r"rank 1 has not submitted it: it is waiting in barrier at test_errors.py:\d+ in body",
        msg,
    )
    assert "Deadlock: " in msg and "neither can ever complete" in msg
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=0.6 was exceeded" in msg
    warned = [r.getMessage() for r in caplog.records if "Stall:" in r.getMessage()]
    assert warned and "inside `if hvd.rank() == 0:`" in warned[0]


def test_internal_error_mid_collective_fails_every_rank(monkeypatch):
    """A bug while executing a response (here: an injected exception on rank 0) must fail
    the handles already taken off the table on every rank, not leave them hanging."""
    from horovod.core import ops

    orig = ops.execute

    def broken(resp, entries, t, buffers, *rest):
        if t.rank == 0:
            raise TypeError("injected bug")
        return orig(resp, entries, t, buffers, *rest)

    monkeypatch.setattr(ops, "execute", broken)

    def body(rank):
        with pytest.raises(HorovodInternalError, match="internal error on rank 0: TypeError"):
            hvd.allreduce(np.ones(4, np.float32), name="x")
        return "ok"

    assert run_ranks(body, 2, timeout=20) == ["ok", "ok"]


def test_one_name_for_different_collectives_on_different_ranks_is_refused():
    """Rank 1 calls allgather 'm' where ranks 0 and 2 call allreduce 'm': their core names
    differ, so they would wait for each other for ever. Once they have waited the grace (a
    tenth of the stall check, at least 0.5 s), every rank gets an error naming both calls, and
    the job goes on."""
    import time

    def body(rank):
        t0 = time.monotonic()
        with pytest.raises(HorovodInternalError) as e:
            (hvd.allgather if rank == 1 else hvd.allreduce)(np.ones(4), name="m")
        took = time.monotonic() - t0
        hvd.barrier()
        return str(e.value), took

    env = {"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}
    for message, took in run_ranks(body, 3, env=env):
        assert has(
            r"tensor 'm': ranks \[0, 2\] called allreduce at test_errors.py:\d+ in body; "
            r"rank 1 called allgather at test_errors.py:\d+ in body\. Every rank must call "
            "the same collective for the same name",
            [message],
        ), message
        assert 0.4 < took < 5, took


def test_one_name_for_two_collectives_in_different_orders_still_runs():
    """The legitimate case the grace leaves alone: every rank submits an allreduce and an
    allgather under one name, in opposite orders on different ranks, a moment apart."""
    import time

    def body(rank):
        if rank == 0:
            a = hvd.allreduce_async(np.ones(4), name="both")
            time.sleep(0.2)
            b = hvd.allgather_async(np.ones((1, 2)), name="both")
        else:
            b = hvd.allgather_async(np.ones((1, 2)), name="both")
            time.sleep(0.2)
            a = hvd.allreduce_async(np.ones(4), name="both")
        return hvd.synchronize(a).tolist(), hvd.synchronize(b).shape

    for reduced, shape in run_ranks(body, 3, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}):
        assert reduced == [1.0] * 4 and shape == (3, 2)
