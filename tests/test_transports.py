"""The Transport contract, run against every data plane: loopback (threads), TCP and shared
memory (ShmTransport over TCP), each rank in its own thread of this process. Then the
shared-memory specifics: chunking and ring wrap-around, segment clean-up, two jobs side by side,
agreement on falling back to TCP, a dead peer, and abort."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from horovod.collectives import algorithms as alg
from horovod.common.exceptions import TransportError
from horovod.common.shm_names import PREFIX, job_id, shm_dir
from horovod.rendezvous.store import MemoryStore
from horovod.transport.base import Scratch, as_bytes, spin_seconds
from horovod.transport.loopback import LoopbackWorld
from horovod.transport.shm import ShmTransport
from horovod.transport.tcp import TcpTransport
from horovod.transport.tcp_polled import PolledTcpTransport

SECRET = b"k" * 32
KINDS = ["loopback", "tcp", "tcp-polled", "shm", "shm-direct", "mixed"]
CHUNK = 4096  # small slots: every larger message is cut into many chunks and wraps around


def _make(
    kind: str,
    n: int,
    *,
    store=None,
    secret=SECRET,
    chunk=CHUNK,
    slots=2,
    spin_us=20.0,
    probe_must_pass=True,
    hosts=None,
    oversubscribed=False,
):
    """n connected transports of ``kind`` (built concurrently, as ranks would). "shm-direct":
    shared memory with single-copy reads for every message of more than one chunk (checked to
    be on unless ``probe_must_pass`` is false). "mixed": a job on ``hosts`` (a host name per
    rank; by default the first half of the ranks on one, the rest on another): shared memory
    within each, polled TCP with board connections between them ("mixed-direct": with
    single-copy reads within each host, as "shm-direct"). ``oversubscribed``: as if more
    ranks shared the machine's cores than it has (waiting loops yield, and spin longer)."""
    if kind.startswith("mixed") and hosts is None:
        hosts = ["a" if r < (n + 1) // 2 else "b" for r in range(n)]
    store = store or MemoryStore()
    world = LoopbackWorld(n) if kind == "loopback" else None
    out: list = [None] * n
    errors: list = []

    def build(r: int) -> None:
        try:
            if world is not None:
                out[r] = world.transport(r, 0)
                return
            t = TcpTransport(
                r, n, store=store, scope="s", secret=secret, advertise="127.0.0.1", timeout=10
            )
            if kind in ("tcp-polled", "mixed", "mixed-direct"):
                one_host = len(set(hosts or ["h"])) == 1
                t = PolledTcpTransport(
                    t, spin_us, oversubscribed, board_timeout=10, one_host=one_host
                )
            shm = dict(
                store=store,
                scope="s",
                secret=secret,
                chunk=chunk,
                slots=slots,
                spin_us=spin_us,
                crowded=oversubscribed,
            )
            if kind.startswith("mixed"):
                direct = 1 if kind == "mixed-direct" else 0
                t = ShmTransport.create(t, hosts, timeout=10, single_copy=direct, **shm)
            if kind.startswith("shm"):
                direct = 1 if kind == "shm-direct" else 0
                t = ShmTransport(t, list(range(n)), timeout=10, single_copy=direct, **shm)
                if probe_must_pass:
                    assert t.single_copy == (chunk + 1 if kind == "shm-direct" else 0)
            out[r] = t
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    return out


def _run_collect(ts, fn, timeout=30):
    """fn(rank, transport) on every rank concurrently; returns (results by rank, errors by
    rank). Fails if a rank hangs."""
    res: list = [None] * len(ts)
    errs: dict = {}

    def go(r):
        try:
            res[r] = fn(r, ts[r])
        except BaseException as e:
            errs[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(ts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a rank hung"
    return res, errs


def _run(ts, fn, timeout=30):
    """fn(rank, transport) on every rank concurrently; returns the results by rank."""
    res, errs = _run_collect(ts, fn, timeout)
    assert not errs, errs
    return res


def _close(ts):
    for t in ts:
        t.close()


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.mark.parametrize("n", [2, 3])
def test_every_pair_exchanges_messages_of_every_length_in_order(kind, n):
    lengths = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 3]
    ts = _make(kind, n)
    try:

        def fn(r, t):
            peers = [p for p in range(n) if p != r]
            sends, recvs, got = [], [], {}
            for p in peers:
                for i, ln in enumerate(lengths):
                    data = np.full(ln, (r * 31 + p * 7 + i) % 251, np.uint8)
                    sends.append((p, memoryview(data)))
                    buf = np.empty(ln, np.uint8)
                    got[(p, i)] = buf
                    recvs.append((p, memoryview(buf)))
            t.exchange(sends, recvs)
            for (p, i), buf in got.items():
                assert (buf == (p * 31 + r * 7 + i) % 251).all(), (r, p, i)
            return True

        assert all(_run(ts, fn))
    finally:
        _close(ts)


@pytest.mark.parametrize("n", [2, 3])
def test_many_one_slot_messages_per_pair_keep_their_order(kind, n):
    """More single-slot messages to each peer than there are slots (the shared-memory small-
    message path): they queue, block and arrive in order."""
    ts = _make(kind, n)
    try:

        def fn(r, t):
            peers = [p for p in range(n) if p != r]
            sends, got = [], {}
            for p in peers:
                for i in range(9):
                    sends.append((p, memoryview(np.full(CHUNK - i, i * 16 + r, np.uint8))))
                    got[(p, i)] = np.empty(CHUNK - i, np.uint8)
            recvs = [(p, memoryview(got[(p, i)])) for p in peers for i in range(9)]
            t.exchange(sends, recvs)
            return all((b == i * 16 + p).all() for (p, i), b in got.items())

        assert all(_run(ts, fn))
    finally:
        _close(ts)


@pytest.mark.parametrize("kind", ["shm", "mixed"])
@pytest.mark.parametrize("n", [2, 3])
def test_messages_larger_than_a_slot_spread_over_every_slot_and_arrive(kind, n):
    """A message larger than one slot that fits them all moves in equal whole-page pieces,
    one per slot (``channels.piece``), so it passes through the same first part of each slot
    every time: back to back with messages of other sizes (other pieces) on the same channels,
    copied and reduced, every byte arrives, and the channel counts say how many pieces went."""
    chunk, slots = 64 * 1024, 4
    lengths = [chunk + 1, 2 * chunk + 3 * 4096 + 8, 5, 4 * chunk - 8, 3 * chunk, chunk]
    ts = _make(kind, n, chunk=chunk, slots=slots)
    try:

        def fn(r, t):
            peers = [p for p in range(n) if p != r]
            local = [p for p in peers if p in getattr(t, "_out", {})]
            before = {p: t._out[p].count for p in local}
            sends, recvs, got = [], [], {}
            for p in peers:
                for i, ln in enumerate(lengths):
                    data = (np.arange(ln, dtype=np.int64) * (r + 3) + p * 5 + i).astype(np.uint8)
                    sends.append((p, memoryview(data)))
                    buf = np.empty(ln, np.uint8)
                    got[(p, i)] = buf
                    recvs.append((p, memoryview(buf)))
            t.exchange(sends, recvs)
            for (p, i), buf in got.items():
                ln = lengths[i]
                expect = (np.arange(ln, dtype=np.int64) * (p + 3) + r * 5 + i).astype(np.uint8)
                assert np.array_equal(buf, expect), (r, p, i)
            # pieces (slots written) per message: every one larger than a slot in 4 (one per
            # slot: 20, 36, 64 and 48 KiB), the others in 1; in whole chunks it was
            # 2 + 3 + 1 + 4 + 3 + 1 = 14
            for p in local:
                assert t._out[p].count - before[p] == 4 + 4 + 1 + 4 + 4 + 1, (r, p)
            # a reduction of a spread message, into an array of float64
            vals = np.arange(3 * chunk // 8 + 5, dtype=np.float64) * (r + 1)
            dst = np.full_like(vals, 100.0)
            t.exchange_reduce(
                [(p, as_bytes(vals)) for p in peers], [], [(p, dst, np.add) for p in peers]
            )
            expect = 100.0 + sum(np.arange(vals.size, dtype=np.float64) * (p + 1) for p in peers)
            assert np.array_equal(dst, expect), r
            return True

        assert all(_run(ts, fn))
    finally:
        _close(ts)


def test_exchange_reduce_combines_on_arrival(kind):
    ts = _make(kind, 2)
    try:

        def fn(r, t):
            peer = 1 - r
            mine = np.arange(3 * CHUNK + 5, dtype=np.float64) * (r + 1)
            dst = np.arange(3 * CHUNK + 5, dtype=np.float64) * 10
            ints = np.full(CHUNK // 4 * 3, r + 2, np.int32)
            idst = np.ones_like(ints)
            t.exchange_reduce(
                [(peer, as_bytes(mine)), (peer, as_bytes(ints))],
                [],
                [(peer, dst, np.add), (peer, idst, np.multiply)],
            )
            expect = np.arange(3 * CHUNK + 5, dtype=np.float64) * (10 + peer + 1)
            return np.array_equal(dst, expect) and (idst == peer + 2).all()

        assert all(_run(ts, fn))
    finally:
        _close(ts)


@pytest.mark.parametrize("n", [2, 3])
def test_exchange_copy_does_the_local_copies_and_the_transfers(kind, n, monkeypatch):
    """Local copies next to a step's transfers (an allgather's own block): every copy lands
    and every message arrives, whether the transport copies first or (shared memory, single
    copy) in pieces between reads of the peers' messages (pieces made tiny here: many of them,
    and not a divisor of any length)."""
    from horovod.transport.shm import exchange

    monkeypatch.setattr(exchange, "COPY_PIECE", 1000)
    ts = _make(kind, n)
    try:

        def fn(r, t):
            rng = np.random.default_rng(r)
            src = rng.integers(0, 255, 3 * CHUNK + 7 + 100 * r, dtype=np.uint8)
            extra = rng.integers(0, 255, 2 * CHUNK + 1, dtype=np.uint8)
            dst, dst2, empty = np.zeros_like(src), np.zeros_like(extra), np.zeros(0, np.uint8)
            peers = [p for p in range(n) if p != r]
            got = {p: np.zeros(3 * CHUNK + 7 + 100 * p, np.uint8) for p in peers}
            t.exchange_copy(
                [(p, as_bytes(src)) for p in peers],
                [(p, as_bytes(got[p])) for p in peers],
                [
                    (as_bytes(dst), as_bytes(src)),
                    (as_bytes(empty), as_bytes(empty)),
                    (as_bytes(dst2), as_bytes(extra)),
                ],
            )
            want = {
                p: np.random.default_rng(p).integers(0, 255, got[p].size, dtype=np.uint8)
                for p in peers
            }
            return (
                np.array_equal(dst, src)
                and np.array_equal(dst2, extra)
                and all(np.array_equal(got[p], want[p]) for p in peers)
            )

        assert all(_run(ts, fn))
    finally:
        _close(ts)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("base", [3 * CHUNK, 150_000])
def test_allgatherv_from_a_separate_own_block(kind, n, base):
    """``allgatherv(..., src)``: the own block is sent from ``src`` and copied into the output
    during the exchange (2 ranks or small: direct; more and large: the ring's first step)."""
    ts = _make(kind, n)
    try:

        def fn(r, t):
            sizes = [base + 11 * k for k in range(n)]
            out = np.zeros(sum(sizes), np.uint8)
            src = np.full(sizes[r], r + 1, np.uint8)
            alg.allgatherv(t, out, sizes, src)
            return np.array_equal(out, np.repeat(np.arange(1, n + 1, dtype=np.uint8), sizes))

        assert all(_run(ts, fn, timeout=60))
    finally:
        _close(ts)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("elems", [1, 1000, 70_001])
def test_collective_algorithms_agree_with_numpy(kind, n, elems):
    """Direct exchange, recursive doubling (n=4), ring; tree and chain broadcast; allgatherv."""
    ts = _make(kind, n)
    try:

        def fn(r, t):
            scratch = Scratch()
            x = (np.arange(elems) % 13 + r).astype(np.float32)
            alg.allreduce(t, x, np.add, scratch)
            want = sum((np.arange(elems) % 13 + k).astype(np.float32) for k in range(n))
            assert np.array_equal(x, want)
            b = np.full(elems * 4 + 8 * (1 << 20) * (elems == 70_001), r, np.uint8)
            alg.broadcast(t, b, n - 1)
            assert (b == n - 1).all()
            sizes = [elems + k for k in range(n)]
            out = np.zeros(sum(sizes), np.uint8)
            off = sum(sizes[:r])
            out[off : off + sizes[r]] = r + 1
            alg.allgatherv(t, out, sizes)
            assert np.array_equal(out, np.repeat(np.arange(1, n + 1, dtype=np.uint8), sizes))
            return True

        assert all(_run(ts, fn, timeout=60))
    finally:
        _close(ts)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("elems", [7, 50_000])
def test_every_rank_gets_bitwise_identical_sums(kind, n, elems):
    """Floating-point sums are combined in one fixed order, so all ranks hold the same bits
    (direct exchange, recursive doubling and the ring alike)."""
    ts = _make(kind, n)
    try:
        rng = np.random.default_rng(0)
        data = [rng.standard_normal(elems).astype(np.float32) * 1e3 for _ in range(n)]

        def fn(r, t):
            x = data[r].copy()
            alg.allreduce(t, x, np.add, Scratch())
            return x.tobytes()

        out = _run(ts, fn)
        assert len(set(out)) == 1
    finally:
        _close(ts)


SCALED = [(np.float32, 0.5), (np.float64, 1 / 3), (np.float16, 0.25), (np.int32, 1 / 3)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("elems", [1000, 120_001])
def test_scaled_reductions_equal_scaling_afterwards(kind, n, elems):
    """allreduce and reduce_scatter with ``post`` (Average's division, postscale_factor): the
    ring scales each segment chunk by chunk as its owner reduces it, the small paths scale
    afterwards; both give exactly the bits of reducing first and scaling the whole result
    after (float16 via float32, integers truncated), the same on every rank."""
    ts = _make(kind, n)
    try:
        rng = np.random.default_rng(7)
        data = {
            dt: [(rng.standard_normal(elems) * 100).astype(dt) for _ in range(n)]
            for dt, _ in SCALED
        }
        counts = alg.split_even(elems, n)

        def fn(r, t):
            out = []
            for dt, post in SCALED:
                x = data[dt][r].copy()
                alg.allreduce(t, x, np.add, Scratch(), post)
                ref = data[dt][r].copy()
                alg.allreduce(t, ref, np.add, Scratch())
                alg.scale(ref, post)
                y = data[dt][r].copy()
                mine = alg.reduce_scatter(t, y, counts, np.add, Scratch(), post)
                z = data[dt][r].copy()
                want = alg.reduce_scatter(t, z, counts, np.add, Scratch())
                alg.scale(want, post)
                out.append((x.tobytes(), ref.tobytes(), mine.tobytes(), want.tobytes()))
            return out

        res = _run(ts, fn, timeout=60)
        for r in range(n):
            for i, (x, ref, mine, want) in enumerate(res[r]):
                assert x == ref, (r, SCALED[i])
                assert mine == want, (r, SCALED[i])
                assert x == res[0][i][0]
    finally:
        _close(ts)


def test_abort_wakes_a_blocked_exchange_promptly(kind):
    ts = _make(kind, 2)
    try:
        err: list = []
        t0 = time.monotonic()

        def wait():
            try:
                ts[0].exchange([], [(1, memoryview(bytearray(10)))])
            except TransportError as e:
                err.append((str(e), time.monotonic() - t0))

        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.3)
        ts[0].abort("stopping: test")
        th.join(5)
        assert not th.is_alive() and err and "stopping: test" in err[0][0]
        assert err[0][1] < 3
    finally:
        _close(ts)


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def _loss_is_reported(ts, call) -> None:
    """``call()`` on rank 0 waits for rank 1, which closes its transport: rank 0 must raise
    promptly, naming rank 1."""
    try:
        err: list = []

        def wait():
            try:
                call()
            except TransportError as e:
                err.append(str(e))

        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.3)
        ts[1].close()
        th.join(5)
        assert not th.is_alive(), "the waiting rank did not notice"
        assert err and "rank 1" in err[0]
    finally:
        ts[0].close()


def test_a_peer_that_goes_away_is_reported_by_rank(kind):
    ts = _make(kind, 2)
    _loss_is_reported(ts, lambda: ts[0].exchange([], [(1, memoryview(bytearray(10)))]))


# ------------------------------------------------------------------ shared memory specifics
def _segments(secret=SECRET) -> list[str]:
    return [n for n in os.listdir(shm_dir()) if n.startswith(f"{PREFIX}{job_id(secret)}-")]


def test_shm_segments_are_unlinked_once_mapped_and_nothing_is_left():
    ts = _make("shm", 3)
    try:
        assert _segments() == []  # already gone from /dev/shm while the job runs
        assert all(isinstance(t, ShmTransport) for t in ts)
    finally:
        _close(ts)
    assert _segments() == []


def test_two_jobs_on_one_host_do_not_collide():
    a = _make("shm", 2)
    b = _make("shm", 2)  # same secret, same scope names: only the random part differs
    try:

        def fn(tag):
            def f(r, t):
                x = np.full(3 * CHUNK, tag + r, np.float32)
                alg.allreduce(t, x, np.add, Scratch())
                return float(x[0])

            return f

        out: dict = {}
        ta = threading.Thread(target=lambda: out.__setitem__("a", _run(a, fn(10))))
        tb = threading.Thread(target=lambda: out.__setitem__("b", _run(b, fn(100))))
        ta.start()
        tb.start()
        ta.join(30)
        tb.join(30)
        assert out["a"] == [21.0, 21.0] and out["b"] == [201.0, 201.0]
    finally:
        _close(a)
        _close(b)


def test_very_large_message_through_default_slots():
    ts = _make("shm", 2, chunk=1 << 20, slots=4)
    try:
        n = 48 << 20  # 48 MiB: 48 chunks through 4 slots

        def fn(r, t):
            x = np.full(n // 4, r + 1, np.float32)
            alg.allreduce(t, x, np.add, Scratch())
            return bool((x == 3).all())

        assert all(_run(ts, fn, timeout=120))
    finally:
        _close(ts)


def test_very_large_messages_by_single_copy_with_default_settings():
    """Default slots and the default threshold: the reduce-scatter reads the peer's half in
    chunk-sized pieces and reduces them, the allgather reads it at once into place."""
    ts = _make("shm-direct", 2, chunk=1 << 20, slots=4)
    try:
        assert all(t.single_copy == (1 << 20) + 1 for t in ts)
        n = 40 << 20

        def fn(r, t):
            x = np.arange(n // 4, dtype=np.float32) % 1000 + r
            alg.allreduce(t, x, np.add, Scratch())
            return bool(np.array_equal(x, np.arange(n // 4, dtype=np.float32) % 1000 * 2 + 1))

        assert all(_run(ts, fn, timeout=120))
    finally:
        _close(ts)


def _failing(monkeypatch, name: str, err: OSError, first_only: bool = False) -> list:
    """Make ``cma.<name>`` raise ``err`` (only on its first call with ``first_only``; later
    calls go through); returns the byte counts of all calls."""
    from horovod.transport import cma

    real, calls, lock = getattr(cma, name), [], threading.Lock()

    def call(pid, a, b, nbytes):
        with lock:
            calls.append(nbytes)
            fail = not first_only or len(calls) == 1
        if fail:
            raise err
        real(pid, a, b, nbytes)

    monkeypatch.setattr(cma, name, call)
    return calls


def test_ranks_agree_on_two_copies_when_one_cannot_read_the_others(monkeypatch, caplog):
    """One rank's probe read fails (as under a seccomp filter or Yama mode 2): every rank
    keeps the two-copy path, says why, and large messages still arrive."""
    _failing(monkeypatch, "read", PermissionError(1, "Operation not permitted"), first_only=True)
    caplog.set_level("INFO", logger="horovod")
    out = _make("shm-direct", 3, probe_must_pass=False)
    try:
        assert [t.single_copy for t in out] == [0, 0, 0]
        assert "single-copy transfers off" in caplog.text
        assert "Operation not permitted" in caplog.text

        def fn(r, t):
            x = np.full(10 * CHUNK, r + 1, np.float32)
            alg.allreduce(t, x, np.add, Scratch())
            return bool((x == 6).all())

        assert all(_run(out, fn))
    finally:
        _close(out)


def test_single_copy_length_mismatch_is_reported_and_does_not_hang():
    ts = _make("shm-direct", 2)
    try:

        def fn(r, t):
            if r == 0:
                t.exchange([(1, memoryview(np.zeros(5 * CHUNK, np.uint8)))], [])
            else:
                try:
                    t.exchange([], [(0, memoryview(np.zeros(6 * CHUNK, np.uint8)))])
                except TransportError as e:
                    t.abort(f"rank 1 failed: {e}")
                    raise

        _, errs = _run_collect(ts, fn)
        assert set(errs) == {0, 1}
        assert "posted a 20480-byte message where rank 1 expected 24576 bytes" in str(errs[1])
        assert isinstance(errs[0], TransportError)
    finally:
        _close(ts)


def test_a_failed_single_copy_read_names_the_peer_and_the_way_out(monkeypatch):
    ts = _make("shm-direct", 2)
    try:
        _failing(monkeypatch, "read", OSError(14, "Bad address"))

        def fn(r, t):
            buf = np.zeros(3 * CHUNK, np.uint8)
            try:
                t.exchange([(1 - r, memoryview(buf))], [(1 - r, memoryview(buf.copy()))])
            except TransportError as e:
                t.abort(str(e))
                raise

        _, errs = _run_collect(ts, fn)
        text = " ".join(str(e) for e in errs.values())
        assert "could not read a message from rank" in text
        assert "HOROVOD_SHM_SINGLE_COPY_BYTES=0" in text
    finally:
        _close(ts)


def _recording(monkeypatch, name: str) -> list:
    """Wrap ``cma.<name>`` to record (thread id, nbytes) of every call."""
    from horovod.transport import cma

    real, calls, lock = getattr(cma, name), [], threading.Lock()

    def rec(pid, a, b, nbytes):
        with lock:
            calls.append((threading.get_ident(), nbytes))
        real(pid, a, b, nbytes)

    monkeypatch.setattr(cma, name, rec)
    return calls


@pytest.mark.parametrize("root", [0, 1])
def test_two_rank_large_broadcast_splits_between_root_writing_and_receiver_reading(
    monkeypatch, root
):
    """The root writes the first (page-aligned) half into the receiver, the receiver reads the
    rest from the root, at once; both return with the receiver holding exactly the root's
    bytes, and back-to-back broadcasts of changing data stay exact."""
    ts = _make("shm-direct", 2)
    try:
        assert all(t.split_copy for t in ts)
        writes, reads = _recording(monkeypatch, "write"), _recording(monkeypatch, "read")
        n = 7 * CHUNK + 123  # not a page multiple: the reader's part is the longer one

        def fn(r, t):
            ok = []
            for k in range(4):
                want = (np.arange(n) * (k + 3) % 251).astype(np.uint8)
                buf = want.copy() if r == root else np.zeros(n, np.uint8)
                alg.broadcast(t, buf, root)
                ok.append(bool(np.array_equal(buf, want)))
                if r == root:
                    buf[:] = 0  # the root may change its buffer at once
            return threading.get_ident(), all(ok)

        res = _run(ts, fn)
        assert [ok for _, ok in res] == [True, True]
        half = n // 2 // 4096 * 4096
        assert {(who, nb) for who, nb in writes} == {(res[root][0], half)}
        assert {(who, nb) for who, nb in reads} == {(res[1 - root][0], n - half)}
        assert len(writes) == len(reads) == 4
    finally:
        _close(ts)


def test_split_broadcast_within_a_process_set_of_two(monkeypatch):
    """Ranks 0 and 2 of three as a set of two (a process set): the split goes between the
    global ranks; rank 1 takes no part."""
    from horovod.transport.base import SubTransport

    ts = _make("shm-direct", 3)
    try:
        writes = _recording(monkeypatch, "write")

        def fn(r, t):
            if r == 1:
                return True
            buf = np.full(9 * CHUNK + 7, 40 + r, np.uint8)
            alg.broadcast(SubTransport(t, [0, 2]), buf, 1)  # set rank 1 = global rank 2
            return bool((buf == 42).all())

        assert _run(ts, fn) == [True, True, True]
        assert [nb for _, nb in writes] == [(9 * CHUNK + 7) // 2 // 4096 * 4096]
    finally:
        _close(ts)


def test_three_ranks_and_small_broadcasts_do_not_split(monkeypatch):
    """A large broadcast over three ranks is a pipelined chain (more than one message per
    step) and a broadcast under the single-copy threshold goes through the slots: no writes."""
    ts = _make("shm-direct", 3)
    try:
        writes = _recording(monkeypatch, "write")

        def fn(r, t):
            big = np.full(9 * CHUNK, r, np.uint8)
            small = np.full(CHUNK, r, np.uint8)
            alg.broadcast(t, big, 2)
            alg.broadcast(t, small, 1)
            return bool((big == 2).all() and (small == 1).all())

        assert _run(ts, fn) == [True, True, True]
        assert writes == []
    finally:
        _close(ts)


STAR = (1 << 20) + 3 * 4096 + 77  # over the chain's threshold (the 1 MiB pipeline block)


@pytest.mark.parametrize("n", [3, 4])
def test_a_large_broadcast_that_every_rank_reads_by_single_copy_is_a_star(monkeypatch, n):
    """Where every rank reads every other's memory, a broadcast over more than two ranks is a
    star: each receiver reads the whole buffer straight from the root (one copy per byte and
    receiver, all at once) instead of a chain through the slots (two per byte and link, one
    link after the other). Back-to-back broadcasts of changing data from different roots stay
    exact, and the root reads nothing."""
    ts = _make("shm-direct", n)
    try:
        assert all(t.direct_reads(STAR) and not t.direct_reads(CHUNK) for t in ts)
        reads = _recording(monkeypatch, "read")

        def fn(r, t):
            ok = []
            for k, root in enumerate([n - 1, 0, 1]):
                want = (np.arange(STAR) * (k + 3) % 251).astype(np.uint8)
                buf = want.copy() if r == root else np.zeros(STAR, np.uint8)
                sent = {p: c.count for p, c in t._out.items()}
                alg.broadcast(t, buf, root)
                ok.append(bool(np.array_equal(buf, want)))
                # the root posts one descriptor to each receiver; receivers send nothing
                moved = {p: c.count - sent[p] for p, c in t._out.items()}
                ok.append(
                    moved == ({p: 1 for p in moved} if r == root else dict.fromkeys(moved, 0))
                )
                if r == root:
                    buf[:] = 0  # the root may change its buffer at once
            return threading.get_ident(), all(ok)

        res = _run(ts, fn)
        assert [ok for _, ok in res] == [True] * n
        by_thread: dict = {}
        for who, nb in reads:
            by_thread[who] = by_thread.get(who, 0) + nb
        # every rank read each broadcast it received once, whole: three, less its root turn
        for r, (who, _) in enumerate(res):
            turns = sum(1 for root in [n - 1, 0, 1] if root != r)
            assert by_thread.get(who, 0) == turns * STAR, (r, by_thread)
    finally:
        _close(ts)


@pytest.mark.parametrize("kind", ["shm", "mixed-direct"])
def test_a_large_broadcast_without_single_copy_everywhere_stays_a_chain(kind):
    """Without single-copy reads (off, or ranks on another host over TCP) a star would have
    the root send the buffer once per receiver: the chain stays, and the bits arrive."""
    n = 4
    ts = _make(kind, n)
    try:
        assert not any(t.direct_reads(STAR) for t in ts)

        def fn(r, t):
            want = (np.arange(STAR) * 7 % 253).astype(np.uint8)
            buf = want.copy() if r == 2 else np.zeros(STAR, np.uint8)
            alg.broadcast(t, buf, 2)
            return bool(np.array_equal(buf, want))

        assert _run(ts, fn) == [True] * n
    finally:
        _close(ts)


def test_a_star_broadcast_among_one_hosts_ranks_of_a_job_on_two_hosts(monkeypatch):
    """In a job on two hosts the whole job's broadcast stays a chain (the test above), but a
    set of one host's ranks (as a hierarchical step's local view is) is read by single copy:
    a star there."""
    from horovod.transport.base import SubTransport

    n, big = 6, STAR
    ts = _make("mixed-direct", n, hosts=["a"] * 3 + ["b"] * 3)
    try:
        reads = _recording(monkeypatch, "read")
        alive = threading.Barrier(n)  # (every thread alive at once: their ids are distinct)

        def fn(r, t):
            alive.wait(10)
            mine = [0, 1, 2] if r < 3 else [3, 4, 5]
            sub = SubTransport(t, mine)
            verdicts = (t.direct_reads(big), sub.direct_reads(big), sub.direct_reads(CHUNK))
            buf = np.full(big, 10 + r, np.uint8)
            alg.broadcast(sub, buf, 1)  # from each host's second rank
            alive.wait(10)
            return threading.get_ident(), verdicts, bool((buf == 10 + mine[1]).all())

        res = _run(ts, fn)
        assert [(v, ok) for _, v, ok in res] == [((False, True, False), True)] * n
        # the star's receivers (each host's first and third rank) read it whole, once
        readers = {who: 0 for who, _, _ in res}
        for who, nb in reads:
            readers[who] += nb
        for r, (who, _, _) in enumerate(res):
            assert readers[who] == (0 if r in (1, 4) else big), (r, readers)
    finally:
        _close(ts)


def test_a_star_broadcast_within_a_process_set(monkeypatch):
    """Ranks 0, 2 and 3 of four as a process set: the star goes between the global ranks (the
    set's root, global rank 3, reads nothing) and rank 1 takes no part."""
    from horovod.transport.base import SubTransport

    ts = _make("shm-direct", 4)
    try:
        reads = _recording(monkeypatch, "read")

        def fn(r, t):
            if r == 1:
                return threading.get_ident(), True
            sub = SubTransport(t, [0, 2, 3])
            assert sub.direct_reads(STAR)
            buf = np.full(STAR, 40 + r, np.uint8)
            sent = sum(c.count for c in t._out.values())
            alg.broadcast(sub, buf, 2)  # set rank 2 = global rank 3
            forwarded = sum(c.count for c in t._out.values()) - sent  # (a chain's middle would)
            return threading.get_ident(), bool((buf == 43).all()) and forwarded == (r == 3) * 2

        res = _run(ts, fn)
        assert [ok for _, ok in res] == [True] * 4
        readers = {who for who, _ in reads}
        assert readers == {res[0][0], res[2][0]}
        assert sum(nb for _, nb in reads) == 2 * STAR
    finally:
        _close(ts)


def test_a_failed_read_in_a_star_broadcast_is_reported_and_does_not_hang(monkeypatch):
    """A receiver that cannot read the root's memory fails with the reason and the way out;
    the root and the other receiver end too (aborted, as the engine would), none hangs."""
    ts = _make("shm-direct", 3)
    try:
        from horovod.transport import cma

        real = cma.read
        failing = {}

        def read(pid, a, b, nbytes):
            if threading.get_ident() == failing.get("who"):
                raise OSError(14, "Bad address")
            real(pid, a, b, nbytes)

        monkeypatch.setattr(cma, "read", read)

        def fn(r, t):
            if r == 2:
                failing["who"] = threading.get_ident()
            buf = np.zeros(STAR, np.uint8)
            try:
                alg.broadcast(t, buf, 0)
            except TransportError as e:
                for u in ts:
                    u.abort(str(e))
                raise
            return True

        _, errs = _run_collect(ts, fn)
        assert 2 in errs, errs
        assert "could not read a message from rank 0" in str(errs[2])
        assert "HOROVOD_SHM_SINGLE_COPY_BYTES=0" in str(errs[2])
    finally:
        _close(ts)


def test_ranks_keep_reading_alone_when_one_cannot_write_the_others(monkeypatch, caplog):
    """Writing into a peer can be forbidden where reading is not: every rank then leaves the
    split off (the verdicts agree), says why, and keeps single-copy reads."""
    calls = _failing(
        monkeypatch, "write", PermissionError(1, "Operation not permitted"), first_only=True
    )
    caplog.set_level("INFO", logger="horovod")
    ts = _make("shm-direct", 2)
    try:
        assert [(t.single_copy > 0, t.split_copy) for t in ts] == [(True, False)] * 2
        assert "cannot write rank" in caplog.text and "Operation not permitted" in caplog.text
        count = len(calls)

        def fn(r, t):
            buf = np.full(9 * CHUNK + 1, r + 5, np.uint8)
            alg.broadcast(t, buf, 1)
            return bool((buf == 6).all())

        assert _run(ts, fn) == [True, True]
        assert len(calls) == count  # no write after the probes
    finally:
        _close(ts)


def test_a_failed_split_write_names_the_peer_and_the_way_out(monkeypatch):
    ts = _make("shm-direct", 2)
    try:
        _failing(monkeypatch, "write", OSError(14, "Bad address"))

        def fn(r, t):
            try:
                alg.broadcast(t, np.zeros(9 * CHUNK, np.uint8), 0)
            except TransportError as e:
                t.abort(str(e))
                raise

        _, errs = _run_collect(ts, fn)
        assert set(errs) == {0, 1}
        assert "rank 0 could not write into rank 1's memory (Bad address)" in str(errs[0])
        assert "HOROVOD_SHM_SINGLE_COPY_BYTES=0" in str(errs[0])
        # the receiver, whose own half arrived, is told rather than returning half a buffer
        assert "rank 0 failed its part of a broadcast with rank 1" in str(errs[1])
    finally:
        _close(ts)


def test_an_aborted_receiver_returns_only_once_the_root_is_done_with_its_buffer(monkeypatch):
    """The receiver posts its address, then its job aborts while the root has not come yet:
    the receiver must not hand its buffer back (to be freed or reused) while the root may
    still write into it; it waits until the root has done its part, then raises."""
    from horovod.transport import cma

    ts = _make("shm-direct", 2)
    try:
        events: list = []
        real = cma.write

        def slow_write(pid, src, remote, nbytes):
            time.sleep(0.2)
            real(pid, src, remote, nbytes)
            events.append("written")

        monkeypatch.setattr(cma, "write", slow_write)
        buf = np.zeros(9 * CHUNK, np.uint8)
        err: list = []

        def receive():
            try:
                ts[1].exchange_pair(0, memoryview(buf), False)
            except TransportError as e:
                events.append("receiver raised")
                err.append(str(e))

        th = threading.Thread(target=receive)
        th.start()
        time.sleep(0.2)  # the receiver has posted and waits for the root
        ts[1].abort("rank 2 failed")
        time.sleep(0.2)
        assert th.is_alive(), "the receiver returned while the root could still write"
        root_err: list = []

        def send():
            try:
                ts[0].exchange_pair(1, memoryview(np.full(9 * CHUNK, 3, np.uint8)), True)
            except TransportError as e:  # the receiver never marks the root's post: it left
                root_err.append(str(e))

        root = threading.Thread(target=send)
        root.start()
        th.join(10)
        root.join(10)
        assert not th.is_alive() and not root.is_alive()
        assert events == ["written", "receiver raised"]
        assert err == ["rank 2 failed"]
        assert root_err and "rank 1" in root_err[0]
        assert (buf[: 4 * CHUNK] == 3).all()  # the root's half landed before the receiver left
    finally:
        _close(ts)


def test_split_broadcast_length_mismatch_is_reported_and_does_not_hang():
    ts = _make("shm-direct", 2)
    try:

        def fn(r, t):
            try:
                alg.broadcast(t, np.zeros((8 + r) * CHUNK, np.uint8), 0)
            except TransportError as e:
                t.abort(str(e))
                raise

        _, errs = _run_collect(ts, fn)
        assert set(errs) == {0, 1}
        assert "rank 1 posted a 36864-byte buffer for a broadcast where rank 0 has 32768" in str(
            errs[0]
        ) or "rank 0 posted a 32768-byte buffer for a broadcast where rank 1 has 36864" in str(
            errs[1]
        )
    finally:
        _close(ts)


def test_split_broadcast_to_a_peer_that_goes_away_is_reported():
    ts = _make("shm-direct", 2)
    buf = memoryview(np.zeros(9 * CHUNK, np.uint8))
    _loss_is_reported(ts, lambda: ts[0].exchange_pair(1, buf, True))


def test_split_broadcast_waits_for_a_late_peer_without_spinning():
    """The root posts, the receiver arrives 0.3 s later: the root sleeps meanwhile (little CPU)
    and both end with the root's bytes."""
    ts = _make("shm-direct", 2)
    try:

        def fn(r, t):
            buf = np.full(9 * CHUNK, 7 if r == 0 else 0, np.uint8)
            if r == 1:
                time.sleep(0.3)
            c0 = time.thread_time()
            alg.broadcast(t, buf, 0)
            return bool((buf == 7).all()), time.thread_time() - c0

        res = _run(ts, fn)
        assert [ok for ok, _ in res] == [True, True]
        assert res[0][1] < 0.1, res
    finally:
        _close(ts)


def _create(hosts: list[str]) -> list:
    """Ranks on the given host names, built as hvd.init() does (``ShmTransport.create``)."""
    n = len(hosts)
    store = MemoryStore()
    out: list = [None] * n

    def build(r):
        t = TcpTransport(
            r, n, store=store, scope="s", secret=SECRET, advertise="127.0.0.1", timeout=10
        )
        out[r] = ShmTransport.create(
            t,
            hosts,
            store=store,
            scope="s",
            secret=SECRET,
            chunk=CHUNK,
            slots=2,
            spin_us=20,
            timeout=10,
        )

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    return out


@pytest.mark.parametrize("kind", ["tcp-polled", "shm", "mixed"])
def test_waiting_ranks_poll_ten_times_as_long_where_ranks_outnumber_the_cores(kind):
    """HOROVOD_SPIN_MICROSECONDS is how long a waiting rank polls before it sleeps; where
    ranks outnumber the cores its polls yield the CPU and it polls ten times as long (0 stays
    0). The engine and the TCP data plane under a polled transport wait as long."""
    assert spin_seconds(100, False) == pytest.approx(100e-6)
    assert spin_seconds(100, True) == pytest.approx(1000e-6)
    assert spin_seconds(0, True) == 0
    cores = os.cpu_count() or 1
    for crowded in (False, True):
        ts = _make(kind, 2, spin_us=30.0, oversubscribed=crowded)
        try:
            for t in ts:
                # (two ranks on one host outnumber a one-core machine's cores anyway)
                over = crowded or (kind == "shm" and 2 > cores)
                assert t.oversubscribed is over
                assert t.spin_s == pytest.approx(30e-6 * (10 if over else 1))
                polled = t if isinstance(t, PolledTcpTransport) else t._remote
                if polled is not None:  # (the TCP data plane under it waits as long)
                    assert polled.spin_s == pytest.approx(30e-6 * (10 if crowded else 1))
                    assert polled.inner.spin_s == polled.spin_s
        finally:
            _close(ts)


def test_ranks_agree_to_use_tcp_when_one_cannot_set_up_shared_memory(monkeypatch, caplog):
    original = ShmTransport._create_segment

    def flaky(self, name):
        if self.rank == 1:
            raise OSError("no space left (simulated)")
        return original(self, name)

    monkeypatch.setattr(ShmTransport, "_create_segment", flaky)
    out = _create(["h", "h"])
    try:
        assert all(isinstance(t, TcpTransport) for t in out)
        assert "simulated" in caplog.text and "use TCP" in caplog.text
        assert _segments() == []

        def fn(r, t):
            x = np.full(10, r + 1.0)
            alg.allreduce(t, x, np.add, Scratch())
            return float(x[0])

        assert _run(out, fn) == [3.0, 3.0]
    finally:
        _close(out)


def test_only_ranks_on_the_same_host_share_memory():
    out = _create(["a", "a", "b", "b"])
    try:
        assert [t.peers for t in out] == [[1], [0], [3], [2]]

        def fn(r, t):  # the ring mixes shared-memory and TCP links in one exchange
            x = (np.arange(20_000) + r).astype(np.float64)
            alg.allreduce(t, x, np.add, Scratch())
            return bool(np.array_equal(x, 4 * np.arange(20_000) + 6.0))

        assert all(_run(out, fn))
    finally:
        _close(out)


def test_control_messages_through_shared_memory_keep_order_and_survive_wraparound():
    ts = _make("shm", 2)
    try:
        msgs = [os.urandom(k) for k in (0, 1, 100, 70_000, 200_000, 300_000, 5)]
        for m in msgs:  # more than the ring holds: the rest waits in the sender's queue
            ts[0].send_fast(1, m)
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < len(msgs) and time.monotonic() < deadline:
            got += [p for _, p in ts[1].poll_fast()]
            ts[0].poll_fast()  # the sender flushes what did not fit
        assert got == msgs
        assert not ts[1].fast_pending()
    finally:
        _close(ts)


def test_a_peer_that_sent_everything_and_left_is_not_lost():
    """The last message of a peer that then exits (its job is done) is still delivered: the
    receiver was asleep, and wakes to both the data and the peer's closed connection."""
    for _ in range(5):
        ts = _make("shm", 2, spin_us=0.0)
        try:
            got = np.zeros(1000, np.uint8)

            def fn(r, t, got=got):
                if r == 0:
                    time.sleep(0.05)  # rank 1 is asleep in its receive by now
                    t.exchange([(1, as_bytes(np.full(1000, 7, np.uint8)))], [])
                    t.close()
                else:
                    t.exchange([], [(0, as_bytes(got))])
                return True

            assert all(_run(ts, fn))
            assert (got == 7).all()
        finally:
            ts[1].close()


def test_peer_round_board_posts_are_read_by_every_rank_once_all_posted():
    """The engine's peer rounds: a post is visible to every peer only once all ranks posted
    the round; each rank reads the others' ids and data (two slots by parity, so a rank one
    round ahead does not overwrite what a slower one has yet to read)."""
    ts = _make("shm", 3)
    try:
        b = [t.board for t in ts]
        assert all(x is not None for x in b)
        ts[0].board_post([7, 9], [memoryview(b"abc"), memoryview(b"de")])
        assert b[0].open and not b[0].due()  # ranks 1 and 2 have not posted
        assert b[1].due() and b[2].due()  # ... and see that rank 0 waits for them
        assert b[0].waiting() == [1, 2]
        ts[1].board_post([7, 9], [memoryview(b"xyz12")], tag=5)
        b[2].deferred = True  # a deferred answer hides the open round until rank 2 posts
        assert not b[2].due() and b[2].opened()
        ts[2].board_post([], [])  # nothing to run
        assert not b[2].deferred
        assert all(x.due() for x in b)
        got = [x.read() for x in b]
        assert got[0] == [(1, 5, [7, 9], memoryview(b"xyz12"), -1), (2, 0, [], memoryview(b""), -1)]
        assert got[1] == [(0, 0, [7, 9], memoryview(b"abcde"), -1), (2, 0, [], memoryview(b""), -1)]
        for x in b:
            x.open = False
        assert not any(x.due() for x in b)
        # Rank 1 runs ahead into round 2 (into the other slot: round 1's stays readable for a
        # slower rank); rank 2 reads everybody's round 2.
        ts[1].board_post([1], [memoryview(b"r2")])
        assert b[0].due() and b[2].due() and not b[1].due()
        ts[0].board_post([1], [memoryview(b"s2")])
        ts[2].board_post([1], [memoryview(b"t2")])
        assert [(r, bytes(d)) for r, _, _, d, _ in b[2].read()] == [(0, b"s2"), (1, b"r2")]
    finally:
        _close(ts)


def test_board_posts_move_along_their_slot_and_readers_find_them():
    """A post goes right after the last one of its parity (on a cache line), back to the
    start of the slot where it would not fit, and its header says where: readers get exactly
    the posted bytes at any position, parts of one post stay together, and the next post of
    the same parity never overwrites the last one's bytes."""
    from horovod.transport.shm.board import ALIGN
    from horovod.transport.shm.layout import BOARD_DATA

    ts = _make("shm", 2)
    try:
        b = [t.board for t in ts]
        b[0].move = True  # (as with a core per rank: off where ranks outnumber the cores)
        rng = np.random.default_rng(3)
        starts: list[int] = []
        sizes = [5, 1000, 300_000, 700_000, 1, 0, BOARD_DATA, 64, 900_000, 900_000, 900_000]
        for n, size in enumerate(sizes, 1):
            data = rng.integers(0, 256, size, dtype=np.uint8)
            cut = size // 3  # (two parts: they land one after the other)
            ts[0].board_post([n], [memoryview(data[:cut]), memoryview(data[cut:])], tag=n)
            ts[1].board_post([n], [])
            assert all(x.due() for x in b)
            (r, tag, ids, got, out) = b[1].read()[0]
            assert (r, tag, ids, out) == (0, n, [n], -1)
            assert bytes(got) == data.tobytes()
            b[0].read()
            head, _ = b[0]._mine[n % 2]
            starts.append(head[5])
            for x in b:
                x.open = False
        # Round by round, parities alternating (odd rounds in slot 1, even in slot 0): where
        # each post started in its slot. Slot 1: 5 B at 0, 300,000 B at 64, 1 B at 300,096
        # (the end aligned up), the whole room back at 0, then 900,000 B at 0 (no room left
        # after it) and at 900,032. Slot 0: 1000 B at 0, 700,000 at 1024, nothing at
        # 701,056, 64 B there too, 900,000 at 701,120.
        assert ALIGN == 64
        assert starts == [0, 0, 64, 1024, 300_096, 701_056, 0, 701_056, 0, 701_120, 900_032]
        b[0].move = False
        for n in (12, 13, 14):
            ts[0].board_post([n], [memoryview(b"x" * 100)])
            ts[1].board_post([n], [])
            assert [bytes(d) for _, _, _, d, _ in b[1].read()] == [b"x" * 100]
            b[0].read()
            assert b[0]._mine[n % 2][0][5] == 0
            for x in b:
                x.open = False
    finally:
        _close(ts)


def test_output_slots_are_free_while_no_result_views_them_and_read_once_acked():
    """Allgather results may live in a rank's output slots, where its peers read its block:
    a slot is handed out again only once no view of it is alive, a post names its slot, and
    the owner waits (asleep, woken by the ack) until every peer has read it."""
    from horovod.transport.shm.layout import OUT_BYTES, OUT_SLOTS, PAGE, out_place, out_where

    ts = _make("shm", 3, spin_us=0.0)
    try:
        t0 = ts[0]
        assert OUT_SLOTS == 2 and t0.outputs
        # (3 ranks on fewer cores keep every result at the start of its slot: below)
        oversubscribed, t0._yield = t0._yield, False
        assert t0.out_slot(OUT_BYTES + 1) == -1  # too large for a slot
        k = t0.out_slot(1000)
        assert out_where(k) == (0, 0)
        view = t0.out_owner(k)[:1000].view(np.float32).reshape(25, 10)
        assert out_where(t0.out_slot(1000)) == (1, 0)  # slot 0 is viewed by a result
        held = t0.out_owner(out_place(1, 0))[8:16]
        assert t0.out_slot(1000) == -1  # both are
        del view
        # Slot 0 again, after its last result (on the next page): the peers' caches no longer
        # hold what a block written there overwrites; back at 0 where a result would not fit.
        assert out_where(t0.out_slot(1000)) == (0, PAGE)
        assert out_where(t0.out_slot(OUT_BYTES - 2 * PAGE)) == (0, 2 * PAGE)
        assert out_where(t0.out_slot(PAGE + 1)) == (0, 0)
        view = t0.out_owner(out_place(0, PAGE))
        assert view.base is t0.out_owners[0] and view.nbytes == OUT_BYTES - PAGE
        assert t0.out_slot(1000) == -1  # (the view keeps slot 0, ``held`` slot 1)
        del view, held
        assert out_where(t0.out_slot(1000)) == (0, 2 * PAGE)
        t0._yield = True  # ranks outnumbering the cores: places stay put
        assert [out_where(t0.out_slot(1000)) for _ in range(2)] == [(0, 0)] * 2
        t0._yield = oversubscribed
        # Rank 0 posts with its block in slot 1 at its third page; the others read it there.
        place = out_place(1, 3 * PAGE)
        t0.out_owner(place)[:4] = np.frombuffer(b"blk0", np.uint8)
        t0.board_post([3], [], out=place)
        ts[1].board_post([3], [memoryview(b"r1")])
        ts[2].board_post([3], [], out=0)
        b = [t.board for t in ts]
        assert all(x.due() for x in b)
        got = [(r, bytes(d), o) for r, _, _, d, o in b[1].read()]
        assert got == [(0, b"", place), (2, b"", 0)]
        assert bytes(ts[1].peer_out(0, place)[:4]) == b"blk0"
        assert bytes(ts[1].peer_out(0, out_place(1, 0))[3 * PAGE : 3 * PAGE + 4]) == b"blk0"
        assert b[0].unacked() == [1, 2] and not b[0].all_acked()
        woke = threading.Event()

        def owner():
            t0.board_wait_acked()
            woke.set()

        th = threading.Thread(target=owner)
        th.start()
        time.sleep(0.1)  # asleep by now (no spin)
        ts[1].board_ack([0, 2])
        assert not woke.wait(0.2), "rank 2 has not read rank 0's block yet"
        assert b[0].unacked() == [2]
        ts[2].board_ack([0])
        assert woke.wait(2), "the last ack did not wake the owner"
        th.join(5)
        assert b[0].all_acked() and b[2].unacked() == [0]  # rank 0 has read nobody's slot
        # An abort ends a wait for acks that will not come.
        errs: list[BaseException] = []

        def waits():
            try:
                ts[2].board_wait_acked()
            except BaseException as e:
                errs.append(e)

        th = threading.Thread(target=waits)
        th.start()
        time.sleep(0.1)
        ts[2].abort("test abort")
        th.join(5)
        assert not th.is_alive() and len(errs) == 1 and isinstance(errs[0], TransportError)
    finally:
        _close(ts)


def test_a_peer_round_post_wakes_a_sleeping_engine():
    ts = _make("shm", 2)
    try:
        woke = threading.Event()

        def sleeper():
            ts[1].sleep(5.0, lambda: False)
            woke.set()

        th = threading.Thread(target=sleeper)
        th.start()
        time.sleep(0.1)  # asleep by now
        assert not woke.is_set()
        ts[0].board_post([1], [memoryview(b"x")])
        assert woke.wait(2), "the post did not wake the peer's engine"
        th.join(5)
        assert ts[1].fast_pending()  # the round waits for its answer
    finally:
        _close(ts)


def test_peer_rounds_need_every_rank_on_the_host():
    out = _create(["a", "a", "b", "b"])
    try:
        assert all(t.board is None for t in out)
    finally:
        _close(out)


def test_connections_within_one_machine_use_reno_and_others_keep_the_systems_choice():
    """A pacing congestion control (BBR, this VM's default) paced same-machine connections
    down to half after full-duplex traffic; both ends on one machine have nothing to control,
    so they use Reno. Connections to another address keep the system's choice."""
    import socket

    from horovod.transport import tcp

    ts = _make("tcp", 2)
    try:
        for t in ts:
            for sock in list(t._data.values()) + list(t._ctrl.values()):
                assert tcp.same_machine(sock)
                got = sock.getsockopt(socket.IPPROTO_TCP, tcp.TCP_CONGESTION, 16)
                assert got.rstrip(b"\0") == b"reno", got
    finally:
        _close(ts)

    class Fake:
        def __init__(self, mine, theirs):
            self.mine, self.theirs = mine, theirs

        def getsockname(self):
            return (self.mine, 1)

        def getpeername(self):
            if self.theirs is None:
                raise OSError("not connected")
            return (self.theirs, 2)

    assert tcp.same_machine(Fake("10.0.0.2", "10.0.0.2"))  # this machine's own address
    assert tcp.same_machine(Fake("127.0.0.1", "127.0.0.1"))
    assert tcp.same_machine(Fake("::1", "::1"))
    assert tcp.same_machine(Fake("10.0.0.2", "127.0.1.1"))
    assert tcp.same_machine(Fake("::ffff:10.0.0.2", "::ffff:127.0.0.1"))
    assert not tcp.same_machine(Fake("10.0.0.2", "not an address"))
    assert not tcp.same_machine(Fake("10.0.0.2", "10.0.0.3"))  # another host
    assert not tcp.same_machine(Fake("10.0.0.2", None))
