"""Jobs that tests/test_mpi.py runs under a real ``mpirun``: ``python tests/mpi_worker.py
SCENARIO``. Each checks its results against formulas and prints ``OK <rank>`` at the end."""

from __future__ import annotations

import os
import sys
import threading
import time

import ml_dtypes
import numpy as np


def world_rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def _mpi_calls() -> list[str]:
    """The names of the MPI calls the plane makes from now on, in order (a list it fills)."""
    from horovod.transport import mpi as plane

    calls: list[str] = []
    real = plane.MpiPlane.call

    def counted(self, what, fn, *args, **kwargs):  # noqa: ANN001
        calls.append(what)
        real(self, what, fn, *args, **kwargs)

    plane.MpiPlane.call = counted  # type: ignore[method-assign]
    return calls


def collectives() -> None:
    """Every collective on the MPI plane, against formulas (HOROVOD_CPU_OPERATIONS=mpi)."""
    import horovod.numpy as hvd
    from horovod.core.context import current
    from horovod.transport.mpi import MpiCollectives

    hvd.init(process_sets=[hvd.ProcessSet([0, 2]), hvd.ProcessSet([1])])
    r, n = hvd.rank(), hvd.size()
    assert n == 3, n
    assert isinstance(current().engine.transport.native, MpiCollectives)
    assert hvd.mpi_enabled() and not hvd.gloo_enabled() and hvd.mpi_threads_supported()
    # allreduces above the eager budget go to MPI, not to data rounds on the board
    assert current().engine.round_budget <= 16384, current().engine.round_budget
    tri = n * (n + 1) // 2
    # every dtype and reduction (bool and bfloat16 have no MPI reduction: the project's
    # algorithms over MPI's point-to-point)
    for dt in (np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8):
        x = np.full(17, r + 1, dt)
        assert (hvd.allreduce(x, op=hvd.Sum, name=f"s.{dt.__name__}") == tri).all()
        assert (hvd.allreduce(x, op=hvd.Min, name=f"mi.{dt.__name__}") == 1).all()
        assert (hvd.allreduce(x, op=hvd.Max, name=f"ma.{dt.__name__}") == n).all()
        assert (hvd.allreduce(x, op=hvd.Product, name=f"p.{dt.__name__}") == 6).all()
    flags = hvd.allreduce(np.array([r == 0, r == 1, False]), op=hvd.Sum, name="bool")
    assert flags.tolist() == [True, True, False], flags
    bf = hvd.allreduce(np.full(5, r + 1, ml_dtypes.bfloat16), op=hvd.Sum, name="bf16")
    assert (bf.astype(np.float32) == tri).all(), bf
    # Average: a correctly rounded division by 3, as the frameworks divide
    v = np.array([0.1, 1.0, 2.5e-3], np.float32) * (r + 1)
    avg = hvd.allreduce(v, name="avg")
    total = sum(np.array([0.1, 1.0, 2.5e-3], np.float32) * (k + 1) for k in range(n))
    assert avg.tobytes() == np.divide(total, np.float32(n)).astype(np.float32).tobytes()
    # large (several MiB) and scaled
    big = np.arange(3 << 20, dtype=np.float32) % 1000 * (r + 1)
    out = hvd.allreduce(big, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name="big")
    assert np.array_equal(out, np.arange(3 << 20, dtype=np.float32) % 1000 * tri * 2)
    # fused: many small tensors in one response, and a grouped allreduce
    handles = [
        hvd.allreduce_async(np.full(3 + i, i + r, np.float64), op=hvd.Sum, name=f"f.{i}")
        for i in range(20)
    ]
    for i, h in enumerate(handles):
        assert (hvd.synchronize(h) == n * i + n * (n - 1) // 2).all()
    grouped = hvd.grouped_allreduce([np.ones(4) * r, np.ones((2, 2)) * 2 * r], op=hvd.Sum)
    assert (grouped[0] == 3).all() and (grouped[1] == 6).all()
    # allgather with uneven first dimensions, broadcast from the last rank
    g = hvd.allgather(np.full((r + 1, 2), r, np.int64), name="ag")
    assert g.tolist() == [[k, k] for k in range(n) for _ in range(k + 1)]
    big_g = hvd.allgather(np.full(1 << 20, r, np.float32), name="agbig")
    assert all((big_g[k << 20 : (k + 1) << 20] == k).all() for k in range(n))
    b = hvd.broadcast(np.full(7, r, np.float32), root_rank=n - 1, name="bc")
    assert (b == n - 1).all()
    # large broadcasts (MPI_Bcast): typed where MPI has the type, as bytes where it has not
    for dt in (np.float16, np.float64, np.int8, np.bool_, ml_dtypes.bfloat16):
        src = (np.arange(3 << 20) % 7 + r).astype(dt)  # (beyond the board: MPI_Bcast)
        got = hvd.broadcast_(src.copy(), root_rank=n - 1, name=f"bcbig.{np.dtype(dt).name}")
        expect = (np.arange(3 << 20) % 7 + n - 1).astype(dt)
        assert got.dtype == expect.dtype and got.tobytes() == expect.tobytes(), dt
    # alltoall with uneven splits: rank r sends k+1 rows to rank k
    splits = [k + 1 for k in range(n)]
    rows = np.concatenate([np.full((k + 1, 2), 10 * r + k) for k in range(n)]).astype(np.int32)
    got, received = hvd.alltoall(rows, splits=splits, name="a2a")
    assert received.tolist() == [r + 1] * n
    assert got[:, 0].tolist() == [10 * k + r for k in range(n) for _ in range(r + 1)]
    # reducescatter of 7 rows over 3 ranks (3, 2, 2)
    rs = hvd.reducescatter(np.arange(14, dtype=np.float32).reshape(7, 2) * (r + 1), op=hvd.Sum)
    start = [0, 3, 5][r]
    expect = np.arange(14, dtype=np.float32).reshape(7, 2)[start : start + rs.shape[0]] * tri
    assert rs.shape[0] == [3, 2, 2][r] and np.array_equal(rs, expect)
    hvd.barrier()
    # process sets run on sub-communicators
    even, odd = hvd.ProcessSet([0, 2]), None
    for ps in current().public_sets.values():
        if ps.ranks == [0, 2]:
            even = ps
        if ps.ranks == [1]:
            odd = ps
    if r in (0, 2):
        s = hvd.allreduce(np.full(4, r, np.float32), op=hvd.Sum, process_set=even, name="ps")
        assert (s == 2).all()
        gs = hvd.allgather(np.full(1, r, np.int32), process_set=even, name="psg")
        assert gs.tolist() == [0, 2]
        bs = hvd.broadcast(np.full(2, r, np.int32), root_rank=2, process_set=even, name="psb")
        assert bs.tolist() == [2, 2]
    else:
        assert (hvd.allreduce(np.ones(2), process_set=odd, name="solo") == 1).all()
    # objects go through the same plane
    assert hvd.allgather_object({"rank": r}) == [{"rank": k} for k in range(n)]
    assert hvd.broadcast_object(f"from {r}", root_rank=1) == "from 1"
    # a mismatch is refused by negotiation on every rank, and the job goes on
    try:
        hvd.allreduce(np.ones(2 + (r == 1)), name="mismatch")
    except Exception as e:
        assert "shape" in str(e) and "mismatch" in str(e), e
    else:
        raise AssertionError("a shape mismatch was not refused")
    assert (hvd.allreduce(np.ones(2), op=hvd.Sum, name="after") == n).all()
    # Adasum (MPI has none: the project's tree over MPI's point-to-point), the tree's bits
    from horovod.collectives.adasum import reference

    def grad(k: int) -> np.ndarray:
        return np.random.default_rng(k).standard_normal(40_000)

    got = hvd.allreduce(grad(r), op=hvd.Adasum, name="adasum")
    assert got.tobytes() == reference([grad(k) for k in range(n)]).tobytes()
    hvd.shutdown()
    print(f"OK {r}", flush=True)


def pair() -> None:
    """Two ranks on the MPI plane: allreduces up to the board's room (2 MiB) take the
    engine's data rounds (1.0-1.04x mpi4py at 512 KiB-1 MiB on the same buffers, where the
    round before MPI's call cost 0.69x), with the bits MPI's own allreduce gives; larger ones
    go to MPI (up to the size that shared memory moves faster: ``one_host``). Broadcasts take
    data rounds up to the room too (MPI splits none)."""
    from mpi4py import MPI

    import horovod.numpy as hvd
    from horovod.core.context import current
    from horovod.transport import mpi as plane

    calls = _mpi_calls()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert n == 2, n
    engine = current().engine
    assert isinstance(engine.transport.native, plane.MpiCollectives)
    assert engine.round_budget == engine.round_broadcast == 2 << 20, engine.round_budget
    world = MPI.COMM_WORLD
    rng = np.random.default_rng(5 + r)
    cases = [
        (np.float32, hvd.Sum),
        (np.float64, hvd.Sum),
        (np.float16, hvd.Sum),
        (np.float32, hvd.Min),
        (np.int32, hvd.Max),
        (np.float64, hvd.Product),
    ]
    ops = {hvd.Sum: MPI.SUM, hvd.Min: MPI.MIN, hvd.Max: MPI.MAX, hvd.Product: MPI.PROD}
    for step in range(3):  # the second and third calls hit the response cache
        for i, (dt, op) in enumerate(cases):
            x = (rng.standard_normal(100_000) * 50).astype(dt)  # 200-800 KB
            before = len(calls), engine.stats["data_rounds"]
            got = hvd.allreduce(x, op=op, name=f"pair{i}")
            want = np.empty_like(x)
            world.Allreduce(x, want, op=ops[op])
            assert got.tobytes() == want.tobytes(), (dt, op)
            if step:  # cached: a data round, no MPI call
                assert (len(calls), engine.stats["data_rounds"]) == (before[0], before[1] + 1)
    before = len(calls)
    big = hvd.allreduce(np.full(3 << 18, r + 1, np.float32), op=hvd.Sum, name="big")
    big = hvd.allreduce(np.full(3 << 18, r + 1, np.float32), op=hvd.Sum, name="big")
    assert (big == 3).all() and calls[before:].count("MPI_ALLREDUCE") == 2, calls[before:]
    hvd.shutdown()
    print(f"OK {r}", flush=True)


def one_host() -> None:
    """On one host, the operations that shared memory moves faster than MPI (large
    allreduces and reduce-scatters, two-rank broadcasts) run there, first call
    and cached alike, with the right results (for two ranks, MPI's bits); the others, and
    with HOROVOD_SHARED_MEMORY=0 every one, on MPI."""
    from mpi4py import MPI

    import horovod.numpy as hvd
    from horovod.core.context import current
    from horovod.transport import mpi as plane

    calls = _mpi_calls()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shm = os.environ.get("HOROVOD_SHARED_MEMORY") != "0"
    native = current().engine.transport.native
    assert isinstance(native, plane.MpiCollectives) and native._plane.one_host is shm
    if not shm:  # posts over TCP, beside MPI: data rounds only for small ops, even at 2 ranks
        from horovod.transport import tcp_board

        assert type(current().engine.transport).__name__ == "MpiPolledTransport"
        assert current().engine.board_data == tcp_board.DATA_BYTES
    world = MPI.COMM_WORLD
    rng = np.random.default_rng(11 + r)
    mib = 1 << 20

    def floats(nbytes: int) -> np.ndarray:
        return rng.standard_normal(nbytes // 4).astype(np.float32)

    def allreduce(nbytes: int) -> tuple:
        x = floats(nbytes)
        want = np.empty_like(x)
        world.Allreduce(x, want, op=MPI.SUM)
        return hvd.allreduce(x, op=hvd.Sum, name=f"ar{nbytes}"), want

    def allgather(nbytes: int) -> tuple:
        x = np.full(nbytes // n // 4, r, np.float32)
        want = np.repeat(np.arange(n, dtype=np.float32), x.size)
        return hvd.allgather(x, name=f"ag{nbytes}"), want

    def broadcast(nbytes: int) -> tuple:
        want = np.arange(nbytes // 4, dtype=np.float32) + n - 1
        x = want - (n - 1) + r
        return hvd.broadcast_(x, n - 1, name=f"bc{nbytes}"), want

    def reducescatter(nbytes: int) -> tuple:
        cols = nbytes // 4 // (n * 4)
        x = np.arange(n * 4 * cols, dtype=np.float32).reshape(n * 4, cols) % 1000 * (r + 1)
        want = np.array_split(x / (r + 1) * (n * (n + 1) // 2), n)[r]
        return hvd.reducescatter(x, op=hvd.Sum, name=f"rs{nbytes}"), want

    def alltoall(nbytes: int) -> tuple:
        x = np.full(nbytes // 4, r, np.float32)
        want = np.repeat(np.arange(n, dtype=np.float32), x.size // n)
        return hvd.alltoall(x, name=f"a2a{nbytes}"), want

    # (op, bytes, its MPI call, runs on shared memory when there is one)
    cases = [
        (allreduce, 12 * mib, "MPI_ALLREDUCE", True),
        (allreduce, 3 * mib, "MPI_ALLREDUCE", False),  # (beyond the board's room)
        (allgather, 12 * mib, "MPI_ALLGATHERV", False),
        (broadcast, 6 * mib, "MPI_BCAST", n == 2),
        (broadcast, 3 * mib, "MPI_BCAST", False),
        (reducescatter, 4 * mib, "MPI_REDUCE_SCATTER", True),
        (reducescatter, mib // 2, "MPI_REDUCE_SCATTER", False),
        (alltoall, 12 * mib, "MPI_ALLTOALLV", False),
    ]
    for fn, nbytes, mpi_call, own in cases:
        for _ in range(2):  # negotiated by rank 0, then a cached op's peer round
            before = len(calls)
            got, want = fn(nbytes)
            if n == 2 or fn is not allreduce:  # (two ranks' sum: the same bits in any order)
                assert got.tobytes() == want.astype(got.dtype).tobytes(), (fn.__name__, nbytes)
            else:
                assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (fn.__name__, nbytes)
            made = calls[before:]  # (an alltoall's first call sends the counts)
            expect = set() if own and shm else {mpi_call}
            assert set(made) == expect and len(made) <= 2, (fn.__name__, nbytes, made)
    hvd.shutdown()
    print(f"OK {r}", flush=True)


def plain() -> None:
    """Upstream's way: plain mpirun, no variables. Start-up over MPI, built-in planes."""
    import horovod.numpy as hvd
    from horovod.core.context import current

    hvd.init()
    assert hvd.mpi_enabled() and not hvd.gloo_enabled()
    transport = current().engine.transport
    assert type(transport).__name__ == "ShmTransport" and transport.native is None
    s = hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum)
    assert (s == hvd.size() * (hvd.size() + 1) / 2).all()
    from mpi4py import MPI  # imported after hvd.init: the same MPI, usable beside Horovod

    assert MPI.COMM_WORLD.allreduce(1) == hvd.size() and hvd.mpi_threads_supported()
    assert (hvd.allreduce(np.ones(2), op=hvd.Sum, name="after") == hvd.size()).all()
    hvd.shutdown()
    print(f"OK {hvd.rank() if hvd.is_initialized() else world_rank()}", flush=True)


def communicators() -> None:
    """hvd.init(comm=...) with the user's communicators, the user's own MPI traffic beside
    Horovod's, and process sets from communicators (4 ranks)."""
    from mpi4py import MPI

    import horovod.numpy as hvd

    world = MPI.COMM_WORLD
    w = world.Get_rank()
    assert world.Get_size() == 4
    half = world.Split(color=w % 2, key=w)
    hvd.init(comm=half)
    assert hvd.size() == 2 and hvd.rank() == w // 2 and hvd.mpi_enabled()
    errors: list[BaseException] = []

    def user_traffic() -> None:  # the user's own mpi4py calls on another thread meanwhile
        # (buffer-mode calls: mpi4py's object-mode ones keep the GIL while inside MPI,
        # docs/mpi.md)
        buf = np.empty(1, np.int64)
        try:
            for k in range(100):  # the same count on every rank: these are collectives
                buf[0] = k
                half.Allreduce(MPI.IN_PLACE, buf)
                assert buf[0] == 2 * k, buf
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=user_traffic)
    t.start()
    for i in range(30):
        s = hvd.allreduce(np.full(8, w, np.float64), op=hvd.Sum, name=f"h{i}")
        assert (s == (0 + 2 if w % 2 == 0 else 1 + 3)).all(), s
    t.join()
    assert not errors, errors
    assert world.allreduce(w) == 6  # the world communicator is untouched
    hvd.shutdown()
    # a list of ranks of MPI_COMM_WORLD; the rank left out is told so
    if w == 3:
        try:
            hvd.init(comm=[0, 1, 2])
        except ValueError as e:
            assert "not among them" in str(e), e
        else:
            raise AssertionError("rank 3 was let into comm=[0, 1, 2]")
    else:
        hvd.init(comm=[0, 1, 2])
        assert hvd.size() == 3 and hvd.rank() == w
        assert (hvd.allreduce(np.ones(3), op=hvd.Sum, name="three") == 3).all()
        hvd.shutdown()
    world.Barrier()
    # process sets from communicators: clones and the whole job are left out (upstream's test)
    sub = world.Split(color=w % 2, key=w)
    clone, sub_clone = world.Dup(), sub.Dup()
    sets = [
        hvd.ProcessSet(sub),
        hvd.ProcessSet(range(0, 4, 2)),
        hvd.ProcessSet(clone),
        hvd.ProcessSet(sub_clone),
        hvd.ProcessSet([0]),
    ]
    hvd.init(comm=world, process_sets=sets)
    ids = hvd.get_process_set_ids_and_ranks()
    assert ids == {0: [0, 1, 2, 3], 1: [0, 2], 2: [1, 3], 3: [0]}, ids
    assert hvd.comm_process_set_id(world) == 0
    assert hvd.comm_process_set_id(sub) == hvd.comm_process_set_id(sub_clone) == 1 + w % 2
    mine = sets[0]
    assert mine.process_set_id == 1 + w % 2 and mine.size() == 2 and mine.rank() == w // 2
    s = hvd.allreduce(np.full(2, w, np.int64), op=hvd.Sum, process_set=mine, name="psc")
    assert (s == (2 if w % 2 == 0 else 4)).all()
    hvd.barrier()  # shutdown on one rank ends the job's pending collectives on all
    hvd.shutdown()
    # a dynamic process set from a communicator (rank 3, outside it, passes the same ranks)
    first3 = world.Split(color=0 if w < 3 else 1, key=w)
    hvd.init(comm=world, process_sets="dynamic")
    ps = hvd.add_process_set(hvd.ProcessSet(first3) if w < 3 else hvd.ProcessSet([0, 1, 2]))
    assert ps.ranks == [0, 1, 2] and hvd.comm_process_set_id(world) == 0
    if w < 3:
        s = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=ps, name="dyn")
        assert (s == 3).all() and hvd.comm_process_set_id(first3) == ps.process_set_id
    hvd.barrier()
    hvd.shutdown()
    for c in (sub, clone, sub_clone, half, first3):
        c.Free()
    print(f"OK {w}", flush=True)


def hierarchical() -> None:
    """Hierarchical allreduce/allgather over MPI: four ranks on two (named) hosts."""
    layout = sys.argv[2] if len(sys.argv) > 2 else "blocks"
    w = world_rank()
    os.environ["HOROVOD_HOSTNAME"] = f"host{w // 2 if layout == 'blocks' else w % 2}"
    import horovod.numpy as hvd
    from horovod.core.context import current

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert hvd.local_size() == 2 and hvd.cross_size() == 2
    # several hosts: every byte through MPI, control through TCP read by the polling thread,
    # and cached ops decided by peer rounds over TCP (not through rank 0)
    engine = current().engine
    assert type(engine.transport).__name__ == "MpiPolledTransport"
    assert engine.board is not None
    before = engine.stats["rounds_run"]
    for _ in range(5):
        assert (hvd.allreduce(np.ones(3), op=hvd.Sum, name="cached") == n).all()
    assert engine.stats["rounds_run"] - before >= 3, engine.stats
    for count in (5, 1 << 18):
        x = np.arange(count, dtype=np.float64) * (r + 1)
        s = hvd.allreduce(x, op=hvd.Sum, name=f"h{count}")
        assert np.array_equal(s, np.arange(count, dtype=np.float64) * 10)
        g = hvd.allgather(np.full((r + 1, 3), r, np.int32), name=f"g{count}")
        assert g[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]
    levels = current().engine.transport.native._levels  # (host, leaders) communicators
    assert levels is not None and (levels[1] is not None) == (hvd.local_rank() == 0)
    hvd.shutdown()
    print(f"OK {r}", flush=True)


def conformance() -> None:
    """The Transport contract on MPI, as tests/test_transport_conformance.py checks the
    other planes: the exchange forms, message order, zero-length messages, abort, close."""
    from mpi4py import MPI

    from horovod.common.exceptions import TransportError
    from horovod.transport.base import Transport, as_bytes
    from horovod.transport.mpi import MpiTransport

    class NoControl(Transport):
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

        def exchange(self, sends, recvs):  # noqa: ANN001
            raise AssertionError("data goes through MPI")

        def send_ctrl(self, peer, payload):  # noqa: ANN001
            pass

        def start_ctrl(self, handler):  # noqa: ANN001
            pass

        def abort(self, reason):  # noqa: ANN001
            pass

        def close(self):
            pass

    world = MPI.COMM_WORLD
    me, n = world.Get_rank(), world.Get_size()
    threads = threading.active_count()
    t = MpiTransport(world.Dup(), NoControl(me, n))
    peers = [p for p in range(n) if p != me]
    # several messages to one peer arrive in posting order; zero-length ones are skipped
    sends = [(p, as_bytes(np.full(k + 1, 100 * me + k, np.int32))) for p in peers for k in range(3)]
    sends += [(p, memoryview(b"")) for p in peers]
    got = {p: [np.empty(k + 1, np.int32) for k in range(3)] for p in peers}
    recvs = [(p, as_bytes(got[p][k])) for p in peers for k in range(3)]
    recvs += [(p, memoryview(bytearray())) for p in peers]
    t.exchange(sends, recvs)
    for p in peers:
        assert [a.tolist() for a in got[p]] == [[100 * p + k] * (k + 1) for k in range(3)]
    # exchange_reduce folds arrivals into arrays
    acc = np.full(4, float(me))
    t.exchange_reduce(
        [(p, as_bytes(np.full(4, float(me)))) for p in peers], [], [(p, acc, np.add) for p in peers]
    )
    assert (acc == sum(range(n))).all(), acc
    # exchange_copy: local copies beside the transfers
    dst, src = np.zeros(3), np.arange(3.0)
    t.exchange_copy([], [], [(as_bytes(dst), as_bytes(src))])
    assert (dst == src).all()
    # exchange_pair / exchange_oneway between ranks 0 and 1
    if me < 2:
        buf = np.full(5, 7.0) if me == 0 else np.zeros(5)
        t.exchange_pair(1 - me, as_bytes(buf), send=me == 0)
        assert (buf == 7.0).all()
    # native collectives on a subset view
    from horovod.transport.base import SubTransport

    if me in (0, n - 1):
        view = SubTransport(t, [0, n - 1])
        x = np.full(3, me + 1.0)
        assert view.native.allreduce(x, np.add, False, None) and (x == n + 1).all()
    # abort ends a wait that would never finish, promptly, with its reason
    world.Barrier()
    if me == 0:
        lonely = np.empty(1, np.int8)
        threading.Timer(0.3, t.abort, args=("rank 1 was lost",)).start()
        t0 = time.monotonic()
        try:
            t.exchange([], [(1, as_bytes(lonely))])
        except TransportError as e:
            assert "rank 1 was lost" in str(e) and time.monotonic() - t0 < 5
        else:
            raise AssertionError("abort did not end the exchange")
    world.Barrier()
    if me == 1:  # complete rank 0's abandoned receive, so MPI ends cleanly
        t.comm.Send(np.zeros(1, np.int8), dest=0, tag=0)
    world.Barrier()
    t.close()
    time.sleep(0.1)
    assert threading.active_count() == threads, threading.enumerate()
    print(f"OK {me}", flush=True)


def watchdog() -> None:
    """A blocking MPI call that a rank never joins: the plane's watchdog warns at the stall
    check time and ends the MPI job at the stall shutdown time."""
    import logging

    from mpi4py import MPI

    from horovod.transport.mpi import MpiPlane

    logging.basicConfig(level=logging.WARNING)
    world = MPI.COMM_WORLD
    plane = MpiPlane(world.Dup(), lambda: None, warn_s=1.0, shutdown_s=2.5)
    if world.Get_rank() == 0:
        plane.call("MPI_BARRIER (test)", plane.comm.Barrier)
    else:
        time.sleep(60)  # never joins in time
    print("the watchdog did not end the job", flush=True)


def lost() -> None:
    """Rank 1 dies during training; the job must end (never hang)."""
    import horovod.numpy as hvd

    hvd.init()
    for step in range(1000):
        if hvd.rank() == 1 and step == 3:
            os._exit(3)
        hvd.allreduce(np.ones(1 << 16, np.float32), name="grad")
    print("survived", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
