import pytest

from horovod.runner.hosts import assign_slots, is_local, parse_hostfile, parse_hosts


def test_parse_hosts():
    hs = parse_hosts("a:2, b:1,c")
    assert [(h.hostname, h.slots) for h in hs] == [("a", 2), ("b", 1), ("c", 1)]
    for bad in ("a:x", "a:0", "", "a b:1"):
        with pytest.raises(ValueError):
            parse_hosts(bad)


def test_assignment_matches_upstream_example():
    # upstream: worker-0:1,worker-1:2, np 3 -> (w0,r0,l0,c0,ls1,cs2), (w1,r1,l0,c1,ls2,cs2),
    # (w1,r2,l1,c0,ls2,cs1)
    s = assign_slots(parse_hosts("worker-0:1,worker-1:2"), 3)
    assert [
        (x.hostname, x.rank, x.local_rank, x.cross_rank, x.local_size, x.cross_size) for x in s
    ] == [("worker-0", 0, 0, 0, 1, 2), ("worker-1", 1, 0, 1, 2, 2), ("worker-1", 2, 1, 0, 2, 1)]
    assert all(x.size == 3 for x in s)
    assert s[2].env()["HOROVOD_CROSS_SIZE"] == "1"


def test_np_smaller_than_slots_fills_hosts_in_order():
    s = assign_slots(parse_hosts("a:2,b:2"), 3)
    assert [(x.hostname, x.local_rank, x.local_size) for x in s] == [
        ("a", 0, 2),
        ("a", 1, 2),
        ("b", 0, 1),
    ]
    with pytest.raises(ValueError, match=r"more processes \(5\) than there are available slots"):
        assign_slots(parse_hosts("a:2,b:2"), 5)


def test_hostfile(tmp_path):
    f = tmp_path / "h"
    f.write_text("a slots=2\n# comment\n\nb\n")
    assert [(h.hostname, h.slots) for h in parse_hostfile(str(f))] == [("a", 2), ("b", 1)]
    f.write_text("a slots=x\n")
    with pytest.raises(ValueError, match=":1: expected"):
        parse_hostfile(str(f))


def test_is_local():
    import socket

    assert is_local("localhost") and is_local("127.0.0.1") and is_local(socket.gethostname())
    assert not is_local("host.invalid")
