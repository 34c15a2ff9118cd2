"""Only the job's own processes get in: rendezvous requests and transport connections must
prove the job secret; garbage and strangers are turned away without disturbing anything."""

import os
import socket
import threading
import time

import numpy as np
import pytest

from horovod.common.exceptions import RendezvousError, TransportError
from horovod.core.messages import decode, encode
from horovod.rendezvous.server import RendezvousServer
from horovod.rendezvous.store import HTTPStoreClient
from horovod.transport.tcp import TcpTransport

SECRET = os.urandom(32)


@pytest.fixture
def server():
    s = RendezvousServer(SECRET, host="127.0.0.1").start()
    yield s
    s.stop()


def test_store_roundtrip_and_wait(server):
    c = HTTPStoreClient("127.0.0.1", server.port, SECRET)
    assert c.get("s", "k") is None
    c.set("s", "k", b"\x00value")
    assert c.get("s", "k") == b"\x00value"
    threading.Timer(0.1, lambda: c.set("s", "late", b"x")).start()
    assert c.wait("s", ["k", "late"], timeout=5) == [b"\x00value", b"x"]
    with pytest.raises(RendezvousError, match="waiting for 1 of 2 rendezvous keys.*never"):
        c.wait("s", ["k", "never"], timeout=0.2)


def test_store_refuses_wrong_secret(server):
    good = HTTPStoreClient("127.0.0.1", server.port, SECRET)
    good.set("s", "k", b"v")
    bad = HTTPStoreClient("127.0.0.1", server.port, os.urandom(32))
    with pytest.raises(RendezvousError, match="HOROVOD_SECRET_KEY does not match"):
        bad.set("s", "k", b"evil")
    with pytest.raises(RendezvousError, match="does not match"):
        bad.get("s", "k")
    assert good.get("s", "k") == b"v"
    assert server.rejected == 2


@pytest.mark.parametrize(
    "junk",
    [
        b"\x00\xff" * 100,
        b"GET / HTTP/1.1\r\n\r\n",
        b"PUT /a/b HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n",
        b"PUT /a/b HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd",
        b"",
    ],
)
def test_store_survives_garbage(server, junk):
    good = HTTPStoreClient("127.0.0.1", server.port, SECRET)
    good.set("s", "k", b"v")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(junk)
        s.settimeout(2)
        try:
            s.recv(1000)
        except OSError:
            pass
    assert good.get("s", "k") == b"v"
    assert good.get("a", "b") is None


def _pair(server, secret_b=SECRET):
    """Two TcpTransports built concurrently; returns (t0, t1) or raises from rank 1."""
    store = HTTPStoreClient("127.0.0.1", server.port, SECRET)
    out, errs = {}, {}

    def make(rank, secret):
        try:
            out[rank] = TcpTransport(
                rank, 2, store=store, scope="t", secret=secret, advertise="127.0.0.1", timeout=3
            )
        except Exception as e:  # noqa: BLE001
            errs[rank] = e

    ts = [
        threading.Thread(target=make, args=(0, SECRET)),
        threading.Thread(target=make, args=(1, secret_b)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, errs


def test_tcp_exchange_zero_copy_both_directions(server):
    out, errs = _pair(server)
    assert not errs
    t0, t1 = out[0], out[1]
    try:
        big = np.arange(3_000_000, dtype=np.float64)  # larger than socket buffers
        r0, r1 = np.empty_like(big), np.empty_like(big)
        th = threading.Thread(
            target=t1.exchange,
            args=([(0, memoryview(big[::-1].copy()).cast("B"))], [(0, memoryview(r1).cast("B"))]),
        )
        th.start()
        t0.exchange([(1, memoryview(big).cast("B"))], [(1, memoryview(r0).cast("B"))])
        th.join()
        np.testing.assert_array_equal(r1, big)
        np.testing.assert_array_equal(r0, big[::-1])
        got = []
        t0.start_ctrl(lambda p, m: got.append((p, m)))
        t1.send_ctrl(0, encode(("hello", 1)))
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.01)
        assert got and got[0][0] == 1 and decode(got[0][1]) == ("hello", 1)
    finally:
        t0.close()
        t1.close()


def test_tcp_refuses_a_peer_without_the_secret(server):
    out, errs = _pair(server, secret_b=os.urandom(32))
    for t in out.values():
        t.close()
    assert 1 in errs and isinstance(errs[1], TransportError)
    assert "does not hold this job's secret" in str(errs[1]) or "did not connect" in str(errs[1])


def test_tcp_rejects_garbage_during_and_after_setup(server):
    """Strangers connect to rank 0's port before and after the mesh is built."""
    store = HTTPStoreClient("127.0.0.1", server.port, SECRET)
    holder = {}

    def make0():
        holder[0] = TcpTransport(
            0, 2, store=store, scope="g", secret=SECRET, advertise="127.0.0.1", timeout=5
        )

    th = threading.Thread(target=make0)
    th.start()
    while store.get("g", "tcp.0") is None:
        time.sleep(0.01)
    host, port = store.get("g", "tcp.0").decode().rsplit(":", 1)

    def attack(payload):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(payload)
            s.settimeout(6)
            try:
                return s.recv(100)
            except OSError:
                return b""

    assert attack(b"\x00" * 200) == b""
    # a well-formed hello followed by a forged proof: the server's challenge comes back, the
    # forged answer is refused, the connection closed, and no "OK" is ever sent
    reply = attack(
        b"PYHVD\x01\x00\x00"
        + b"D"
        + b"\x01\x00\x00\x00"
        + b"\x02\x00\x00\x00"
        + b"n" * 16
        + b"forged-proof-of-32-bytes-length!"
    )
    assert b"OK" not in reply[48:]
    t1 = TcpTransport(1, 2, store=store, scope="g", secret=SECRET, advertise="127.0.0.1", timeout=5)
    th.join()
    t0 = holder[0]
    try:
        assert attack(b"garbage after setup") == b""
        x = np.arange(10.0)
        y = np.empty(10)
        th = threading.Thread(target=t1.exchange, args=([(0, memoryview(x).cast("B"))], []))
        th.start()
        t0.exchange([], [(1, memoryview(y).cast("B"))])
        th.join()
        np.testing.assert_array_equal(x, y)
        assert t0.rejected >= 3
    finally:
        t0.close()
        t1.close()


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_control_decoder_rejects_arbitrary_bytes_cleanly(payload):
    """Whatever bytes arrive, decoding either yields a tagged tuple of plain data or raises an
    ordinary exception; it never executes code or loads classes."""
    try:
        msg = decode(payload)
    except Exception:
        return
    assert isinstance(msg, tuple) and isinstance(msg[0], str)


def test_control_decoder_refuses_code():
    import pickle

    evil = pickle.dumps(("Q", [os.system]))
    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        decode(evil)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=20),
    st.lists(
        st.tuples(st.integers(0, 100), st.lists(st.integers(0, 2**40), max_size=10)), max_size=8
    ),
)
def test_compact_control_messages_round_trip(hits, id_lists):
    """Cache hits and cache-id response lists (steady-state training) travel in a compact
    binary form; it decodes to exactly what was encoded."""
    q = ("Q", [("H", ps, cid) for ps, cid in hits])
    p = ("P", [("K", ps, cids) for ps, cids in id_lists], None, None)
    for msg in (q, p):
        wire = encode(msg)
        assert wire[0] in (1, 2)  # not pickle (0x80)
        assert decode(wire) == msg
    # Anything else in the same message keeps the general (pickled) form.
    mixed = ("P", [("K", 0, [1]), ("R", 1, 2)], None, None)
    assert encode(mixed)[0] == 0x80 and decode(encode(mixed)) == mixed
    shutdown = ("P", [("K", 0, [1])], "rank 1 called shutdown()", None)
    assert decode(encode(shutdown)) == shutdown


def _plain(msg: tuple) -> tuple:
    """``msg`` with memoryviews (the decoder's zero-copy data) as bytes, for comparison."""
    return tuple(
        [tuple(bytes(x) if isinstance(x, memoryview) else x for x in it) for it in part]
        if isinstance(part, list)
        else part
        for part in msg
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.none() | st.binary(max_size=40)),
        min_size=1,
        max_size=12,
    ),
    st.lists(
        st.tuples(
            st.integers(0, 100),
            st.lists(st.integers(0, 2**40), max_size=6),
            st.none() | st.binary(max_size=40),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_eager_control_messages_round_trip(hits, id_lists):
    """Cache hits with their data ("D") and reduced results ("V") of eager allreduces, mixed
    with plain hits and ids, keep a binary form that decodes to what was encoded."""
    q = ("Q", [("H", ps, c) if d is None else ("D", ps, c, d) for ps, c, d in hits])
    p = ("P", [("K", ps, c) if d is None else ("V", ps, c, d) for ps, c, d in id_lists], None, None)
    for msg in (q, p):
        wire = encode(msg)
        assert wire[0] != 0x80
        assert _plain(decode(wire)) == msg
    # With a full request or response in it, the message is pickled, data and all.
    mixed = ("Q", [("D", 0, 1, b"abcd"), ("R", ("wire",))])
    assert encode(mixed)[0] == 0x80 and decode(encode(mixed)) == mixed


@pytest.mark.parametrize(
    "payload",
    [
        bytes([3]) + b"\x00" * 20,  # cut inside a (set, id, length) record
        bytes([3]) + (0).to_bytes(8, "little") * 2 + (9).to_bytes(8, "little") + b"x",  # 9 promised
        bytes([3]) + (0).to_bytes(8, "little") * 2 + (-5).to_bytes(8, "little", signed=True),
        bytes([4]) + (0).to_bytes(8, "little") + (3).to_bytes(8, "little"),  # 3 ids promised
        bytes([4]) + (0).to_bytes(8, "little") * 2 + (4).to_bytes(8, "little") + b"ab",
    ],
)
def test_malformed_eager_messages_are_refused(payload):
    import pickle

    with pytest.raises(pickle.UnpicklingError):
        decode(payload)


@pytest.mark.parametrize(
    "payload",
    [
        bytes([1]) + b"\x00" * 7,  # not a whole number of integers
        bytes([1]) + b"\x00" * 8,  # an odd number of integers for (set, id) pairs
        bytes([2]) + (0).to_bytes(8, "little") + (5).to_bytes(8, "little"),  # 5 ids promised
        bytes([2]) + (0).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True),
    ],
)
def test_malformed_compact_messages_are_refused(payload):
    import pickle

    with pytest.raises(pickle.UnpicklingError):
        decode(payload)
