"""The data-plane interface (``horovod.transport.base``), as the engine uses it, checked against
every transport: loopback (ranks as threads), a job of one (``SoloTransport``), TCP, shared
memory, and both in a job on two host names ("mixed": shared memory with a ``MixedBoard``). A new data plane (MPI, NCCL) adds itself to ``KINDS`` and must pass all of this; the
byte-moving contract (``exchange`` and its forms) is checked for the same kinds in
``test_transports.py``.

What is checked: the declared capabilities (``PolledTransport``, ``PeerBoard``) match what the
transport does; control messages arrive in order on the handler (or through ``poll_fast`` for
``send_fast``); ``abort`` fails exchanges with its reason; ``sleep``/``nap``/``kick`` for polled
transports; the board's post/read cycle; and ``close`` leaves no thread, socket, descriptor or
mapping behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest
from test_transports import _make, _run

from horovod.common.alarm import make_alarm
from horovod.common.exceptions import TransportError
from horovod.transport.base import PeerBoard, PolledTransport, Transport
from horovod.transport.loopback import SoloTransport

KINDS = ["loopback", "solo", "tcp", "tcp-polled", "shm", "mixed"]
# What each kind must declare: polled (a waiting thread can run the engine), board (peer rounds)
DECLARES = {
    "loopback": (False, False),
    "solo": (True, False),
    "tcp": (False, False),
    "tcp-polled": (True, True),
    "shm": (True, True),
    # two host names: shared memory with a MixedBoard on one, polled TCP alone on the other
    "mixed": (True, True),
}


def _build(kind: str, n: int) -> list:
    if kind == "solo":
        assert n == 1
        return [SoloTransport(spin_s=20e-6)]
    return _make(kind, n)


# (kind, ranks): the sizes each kind is checked at
WORLDS = [(k, n) for k in KINDS for n in ([1] if k == "solo" else [3] if k == "mixed" else [2, 3])]


def _resources() -> tuple:
    proc = psutil.Process()
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/" in line)
    return (
        sorted(t.name for t in threading.enumerate()),
        proc.num_fds(),
        len(proc.net_connections(kind="all")),
        maps,
    )


def _settled(before: tuple, timeout: float = 5.0) -> tuple:
    """The process's resources once threads that were told to end have ended."""
    deadline = time.monotonic() + timeout
    now = _resources()
    while now != before and time.monotonic() < deadline:
        time.sleep(0.02)
        now = _resources()
    return now


def _ids(w: tuple[str, int]) -> str:
    return f"{w[0]}-{w[1]}"


def each(capability: int | None = None):
    """Parametrize a test by (kind, n) over the kinds that declare ``capability`` (index into
    ``DECLARES``; None: every kind)."""
    worlds = [w for w in WORLDS if capability is None or DECLARES[w[0]][capability]]
    return pytest.mark.parametrize("kind,n", worlds, ids=[_ids(w) for w in worlds])


@each()
def test_capabilities_are_declared_by_type(kind, n):
    polled, board = DECLARES[kind]
    ts = _build(kind, n)
    try:
        for r, t in enumerate(ts):
            assert isinstance(t, Transport)
            assert (t.rank, t.size) == (r, n)
            assert isinstance(t, PolledTransport) == polled
            if polled:
                assert t.spin_s >= 0 and isinstance(t.oversubscribed, bool)
                assert (t.board is not None) == board
                assert t.aborted is None
            if board:
                b = t.board
                assert isinstance(b, PeerBoard)
                assert b.data_bytes >= 1 << 18 and b.max_ids >= 64
                assert not b.open and not b.deferred and not b.due()
                if t.outputs:
                    assert t.out_min > 0 and len(t.out_owners) >= 1
    finally:
        for t in ts:
            t.close()


@each()
def test_control_messages_arrive_in_order_and_only_once(kind, n):
    """Rank 0 and every other rank exchange numbered control messages both ways
    (``send_ctrl`` to the handler, and on polled transports ``send_fast`` to ``poll_fast``
    where the peer is reached that way)."""
    if n == 1:
        return  # a job of one has nobody to send to
    ts = _build(kind, n)
    got: list[list[tuple[int, bytes]]] = [[] for _ in range(n)]
    lock = threading.Lock()

    def handler_of(r):
        def on(peer, payload):
            if payload is not None:
                with lock:
                    got[r].append((peer, payload))

        return on

    try:
        for r, t in enumerate(ts):
            t.start_ctrl(handler_of(r))
        for i in range(50):
            for r in range(1, n):
                ts[r].send_ctrl(0, b"up %d %d" % (r, i))
                ts[0].send_ctrl(r, b"down %d %d" % (r, i))
        want0 = {r: [b"up %d %d" % (r, i) for i in range(50)] for r in range(1, n)}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for r, t in enumerate(ts):  # where the polling thread reads the messages
                if isinstance(t, PolledTransport) and all(t.is_fast(p) for p in range(n)):
                    polled = t.poll_fast()
                    with lock:
                        got[r] += polled
            with lock:
                if sum(len(g) for g in got) == 2 * 50 * (n - 1):
                    break
            time.sleep(0.01)
        for r in range(1, n):
            assert [p for q, p in got[0] if q == r] == want0[r]
            assert got[r] == [(0, b"down %d %d" % (r, i)) for i in range(50)]
        if isinstance(ts[0], PolledTransport):
            fast = [(r, p) for r in range(1, n) for p in (b"a", b"b", b"c") if ts[r].is_fast(0)]
            for r, p in fast:
                ts[r].send_fast(0, p)
            seen: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + 5
            while len(seen) < len(fast) and time.monotonic() < deadline:
                seen += ts[0].poll_fast()
            assert sorted(seen) == sorted(fast)
            assert ts[0].poll_fast() == []  # each message once
    finally:
        for t in ts:
            t.close()


@each()
def test_abort_fails_every_exchange_with_its_reason(kind, n):
    ts = _build(kind, n)
    try:
        ts[0].abort("stopped by the conformance test")
        if isinstance(ts[0], PolledTransport):
            assert ts[0].aborted == "stopped by the conformance test"
        if n > 1:
            with pytest.raises(TransportError, match="stopped by the conformance test"):
                ts[0].exchange([(1, memoryview(b"x"))], [(1, memoryview(bytearray(1)))])
    finally:
        for t in ts:
            t.close()


@each(capability=0)
def test_a_kick_wakes_a_sleeping_or_napping_engine_and_a_busy_one_does_not_sleep(kind, n):
    ts = _build(kind, n)
    t = ts[0]
    try:
        t0 = time.monotonic()
        t.sleep(5.0, lambda: True)  # busy: returns at once
        assert time.monotonic() - t0 < 1.0
        for wait in (lambda: t.sleep(5.0, lambda: False), lambda: t.nap(5.0)):
            woke = threading.Event()

            def sleeper(wait=wait, woke=woke):
                wait()
                woke.set()

            th = threading.Thread(target=sleeper)
            th.start()
            time.sleep(0.1)
            assert not woke.is_set()
            t.kick()
            assert woke.wait(2), "kick did not wake the sleeping thread"
            th.join(5)
        t0 = time.monotonic()
        t.nap(0.05)  # no kick pending: sleeps its time
        assert time.monotonic() - t0 >= 0.04
    finally:
        for x in ts:
            x.close()


@each(capability=0)
def test_a_nap_on_an_alarm_ends_at_the_deadline_the_alarm_has_then(kind, n):
    """The engine thread naps through a lease on an alarm that the thread running the
    engine moves without waking it: the nap ends at the deadline the alarm has by then."""
    ts = _build(kind, n)
    t = ts[0]
    alarm = make_alarm()
    try:
        assert alarm is not None, "no timerfd on this Linux machine"
        if kind == "solo":  # (threads of one process: an event, no file descriptors)
            assert not t.naps_on_alarm
            return
        assert t.naps_on_alarm
        woke_at: list[float] = []
        alarm.set_at(time.monotonic() + 0.1)
        th = threading.Thread(target=lambda: (t.nap(5.0, alarm.fileno()), woke_at.append(0)))
        t0 = time.monotonic()
        th.start()
        time.sleep(0.05)
        alarm.set_at(t0 + 0.4)  # moved later while it naps
        th.join(5)
        took = time.monotonic() - t0
        assert woke_at and 0.35 <= took < 2.0, took
        alarm.clear()
        alarm.set_at(time.monotonic() - 1)  # a deadline already past: at once
        t0 = time.monotonic()
        t.nap(5.0, alarm.fileno())
        assert time.monotonic() - t0 < 1.0
    finally:
        if alarm is not None:
            alarm.close()
        for x in ts:
            x.close()


@each(capability=1)
def test_board_rounds_post_wait_for_everybody_and_read_the_same(kind, n):
    ts = _build(kind, n)
    try:

        def round_of(r, t):
            b = t.board
            data = np.full(5 + r, r, np.uint8)
            t.board_post([11, 12 + r], [memoryview(data)], tag=2 * r)
            deadline = time.monotonic() + 10
            while not b.due():
                assert time.monotonic() < deadline, f"rank {r}: round never complete"
            posts = b.read()
            b.open = False
            return [(q, tag, ids, bytes(d), o) for q, tag, ids, d, o in posts]

        got = _run(ts, round_of)
        for r in range(n):
            want = [(q, 2 * q, [11, 12 + q], bytes([q]) * (5 + q), -1) for q in range(n) if q != r]
            assert got[r] == want
    finally:
        for t in ts:
            t.close()


@each()
def test_close_leaves_no_thread_socket_descriptor_or_mapping_behind(kind, n):
    before = _resources()
    ts = _build(kind, n)
    if n > 1:
        for t in ts:
            t.start_ctrl(lambda peer, payload: None)

        def step(r, t):
            buf = np.full(100_000, r, np.float32)
            peer = (r + 1) % n
            got = np.empty_like(buf)
            t.exchange(
                [(peer, memoryview(buf).cast("B"))],
                [((r - 1) % n, memoryview(got).cast("B"))],
            )
            return float(got[0])

        assert _run(ts, step) == [float((r - 1) % n) for r in range(n)]
    for t in ts:
        t.close()
    del ts
    assert _settled(before) == before
