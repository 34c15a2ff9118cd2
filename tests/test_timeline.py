"""Timeline: upstream's Chrome-trace format, valid JSON at every moment, the expected spans for
every collective (fused ones too), dynamic start/stop, wait attribution, and the summary tool."""

import json
import logging
import os
import re
import threading
import time

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.core.diagnose import WaitStats
from horovod.core.timeline import Timeline
from horovod.testing import run_ranks
from horovod.timeline.summary import main as summary_main
from horovod.timeline.summary import summarize


def read(path, attempts=50):
    """The file as JSON. It is valid after every batch the writer thread writes; a read that
    races with a write (the file grows between two read syscalls) is retried."""
    for _ in range(attempts - 1):
        try:
            with open(path) as f:
                return json.load(f)
        except json.JSONDecodeError:
            time.sleep(0.01)
    with open(path) as f:
        return json.load(f)  # fails the test if the file stays invalid


def rows(events):
    """tensor name -> its events (metadata excluded), in file order."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "process_name" and "name" in e["args"]
    }
    out = {}
    for e in events:
        if e.get("ph") != "M" and e.get("pid", 0) in names:
            out.setdefault(names[e["pid"]], []).append(e)
    return out


def spans(evs):
    """[(name, depth, args)] of the B/E pairs of one row, checking they nest properly."""
    stack, out = [], []
    for e in evs:
        if e["ph"] == "B":
            stack.append(e["name"])
        elif e["ph"] == "E":
            assert stack, f"E without B in {evs}"
            out.append((stack.pop(), len(stack), e.get("args")))
    assert not stack, f"unclosed spans {stack}"
    return out


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# ------------------------------------------------------------------------------ the format
def test_file_format_with_an_injected_clock(tmp_path):
    clock = FakeClock()
    path = str(tmp_path / "tl.json")
    tl = Timeline(path, mark_cycles=True, clock=clock, wall=lambda: 1700000000.5)
    tl.negotiate_start("allreduce.a", "allreduce")
    clock.t += 0.001
    tl.negotiate_rank_ready("allreduce.a", 0)
    clock.t += 0.002
    tl.negotiate_rank_ready("allreduce.a", 1)
    tl.negotiate_end("allreduce.a", last_rank=1, waited_ms=2.0)
    tl.cycle()
    tl.op_start("allreduce.a", "allreduce")
    clock.t += 0.0005
    tl.activity(["allreduce.a"], "TCP_ALLREDUCE")
    clock.t += 0.004
    tl.activity(["allreduce.a"], None)
    tl.op_end("allreduce.a", "float32", (3,))
    tl.close()
    ev = read(path)
    assert ev[0] == {
        "name": "process_name",
        "ph": "M",
        "pid": 0,
        "args": {"start_time_since_epoch_in_micros": 1700000000500000},
    }
    assert ev[1]["name"] == "process_sort_index" and ev[1]["args"] == {"sort_index": 0}
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.a"}} in ev
    body = [e for e in ev if e["ph"] != "M"]
    assert body == [
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 0, "pid": 1},
        {"ph": "X", "name": "0", "ts": 1000, "pid": 1, "dur": 0},
        {"ph": "X", "name": "1", "ts": 3000, "pid": 1, "dur": 0},
        {"ph": "E", "ts": 3000, "pid": 1, "args": {"last_rank": 1, "waited_ms": 2.0}},
        {"ph": "i", "name": "CYCLE_START", "ts": 3000, "pid": 0, "s": "g"},
        {"ph": "B", "name": "ALLREDUCE", "ts": 3000, "pid": 1},
        {"ph": "B", "name": "TCP_ALLREDUCE", "ts": 3500, "pid": 1},
        {"ph": "E", "ts": 7500, "pid": 1},
        {"ph": "E", "ts": 7500, "pid": 1, "args": {"dtype": "float32", "shape": "[3]"}},
    ]


def test_file_is_valid_json_after_every_batch(tmp_path):
    path = str(tmp_path / "tl.json")
    tl = Timeline(path)
    read(path)  # valid from the start
    seen = []
    for i in range(50):
        tl.negotiate_start(f"t{i}", "allgather")
        tl.negotiate_end(f"t{i}")
        tl.flush()
        seen.append(len(read(path)))  # the writer thread may be mid-way: still valid
    tl.close()
    assert len(read(path)) == 2 + 50 * 4  # 2 header + per tensor 2 metadata + B + E
    assert seen == sorted(seen)


def test_bad_path_fails_at_once(tmp_path):
    with pytest.raises(OSError):
        Timeline(str(tmp_path / "no" / "such" / "dir" / "tl.json"))


# ------------------------------------------------------------------------------ in a job
def test_spans_for_every_collective(tmp_path):
    path = str(tmp_path / "tl.json")

    def body(rank):
        hvd.allreduce(np.ones(3, np.float32), name="single")
        hs = [hvd.allreduce_async(np.ones(4, np.float64), name=f"fused{i}") for i in range(6)]
        [hvd.synchronize(h) for h in hs]
        hvd.allgather(np.ones((rank + 1, 2), np.int32), name="gather")
        hvd.broadcast(np.ones(5, np.float32), root_rank=1, name="bcast")
        hvd.reducescatter(np.ones((4, 2), np.float32), name="rs")
        hvd.alltoall(np.arange(4, dtype=np.float32), name="a2a")
        if rank == 0:
            read(path)  # valid JSON while the job is running

    run_ranks(body, 2, env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    ev = read(path)
    assert ev[0]["args"]["start_time_since_epoch_in_micros"] > 0
    r = rows(ev)
    single = spans(r["allreduce.single"])
    assert [s[0] for s in single] == ["NEGOTIATE_ALLREDUCE", "LOOPBACK_ALLREDUCE", "ALLREDUCE"]
    assert single[-1][2] == {"dtype": "float32", "shape": "[3]"}
    ticks = sorted(e["name"] for e in r["allreduce.single"] if e["ph"] == "X")
    assert ticks == ["0", "1"]  # one readiness tick per rank
    fused = [n for n in r if n.startswith("allreduce.fused")]
    assert len(fused) == 6
    fused_acts = {s[0] for n in fused for s in spans(r[n]) if s[1] == 1}
    assert {"MEMCPY_IN_FUSION_BUFFER", "LOOPBACK_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"} <= (
        fused_acts
    )
    gather = [s[0] for s in spans(r["allgather.gather"])]
    assert gather[0] == "NEGOTIATE_ALLGATHER" and gather[-1] == "ALLGATHER"
    assert "LOOPBACK_ALLGATHER" in gather
    assert [s[0] for s in spans(r["broadcast.bcast"])][-2:] == ["LOOPBACK_BCAST", "BROADCAST"]
    assert [s[0] for s in spans(r["reducescatter.rs"])][-1] == "REDUCESCATTER"
    assert [s[0] for s in spans(r["alltoall.a2a"])][-1] == "ALLTOALL"
    assert any(e.get("name") == "CYCLE_START" for e in ev)


def test_dynamic_start_stop_and_restart(tmp_path):
    first, second = str(tmp_path / "a.json"), str(tmp_path / "b.json")

    def body(rank):
        hvd.allreduce(np.ones(1), name="before")
        hvd.start_timeline(first)
        hvd.allreduce(np.ones(1), name="during_a")
        hvd.stop_timeline()
        hvd.allreduce(np.ones(1), name="between")
        hvd.start_timeline(second, mark_cycles=True)
        hvd.allreduce(np.ones(1), name="during_b")
        hvd.stop_timeline()
        hvd.stop_timeline()  # a second stop is a no-op

    run_ranks(body, 2, env={"HOROVOD_TIMELINE": "DYNAMIC"})
    a, b = rows(read(first)), rows(read(second))
    # Only rank 0 writes, and other ranks run ahead of its start/stop calls: the other ranks'
    # requests for "between" may reach file a before rank 0 stopped it. What rank 0 itself did
    # inside each window is complete, and nothing from before the first start is there.
    assert "allreduce.before" not in a and "allreduce.during_b" not in a
    assert [x[0] for x in spans(a["allreduce.during_a"])][-1] == "ALLREDUCE"
    assert "allreduce.during_a" not in b and "allreduce.between" not in b
    assert [x[0] for x in spans(b["allreduce.during_b"])][-1] == "ALLREDUCE"
    assert next(e["pid"] for e in read(second) if e.get("args", {}).get("name")) == 1


def test_start_timeline_argument_errors(tmp_path):
    def body(rank):
        with pytest.raises(ValueError, match="non-empty path"):
            hvd.start_timeline("")
        if rank == 0:  # only rank 0 opens the file
            with pytest.raises(ValueError, match="cannot write"):
                hvd.start_timeline(str(tmp_path / "missing-dir" / "t.json"))
        return "ok"

    assert run_ranks(body, 2) == ["ok", "ok"]


# ------------------------------------------------------------------------------ wait attribution
def test_wait_stats_arithmetic():
    w = WaitStats(3, start=0.0)
    assert w.record([(0, 1.0)]) is None  # a lone rank waits for nobody
    assert w.record([(0, 1.0), (1, 1.5), (2, 3.0)]) == (2, 2.0)
    assert w.record([(0, 5.0), (1, 4.0), (2, 4.5)]) == (0, 1.0)
    assert w.waited == pytest.approx([2.0, 2.5, 0.5])
    assert w.caused == pytest.approx([1.5, 0.0, 3.5])
    assert w.last == [1, 0, 1]
    text = w.summary(10.0)
    assert "over the last 10.0 s (2 collectives)" in text
    assert "rank 2 was the last to submit 1 of them (50%)" in text
    assert "kept the other ranks waiting 3.500 s" in text
    w.reset(10.0)
    assert w.summary(11.0) is None
    # waiting for two tensors at once is one wait, not two
    w.record([(0, 20.0), (1, 21.0)])
    w.record([(0, 20.0), (1, 21.0)])
    w.record([(0, 20.5), (1, 22.0)])
    assert w.waited == pytest.approx([2.0, 0.0, 0.0])
    assert w.caused == pytest.approx([0.0, 2.0, 0.0])


def test_coverage_counts_overlaps_once():
    from horovod.common.intervals import Coverage

    c = Coverage()
    assert c.add(0, 1) == 1
    assert c.add(2, 3) == 1
    assert c.add(0.5, 4) == pytest.approx(2.0)  # fills the gap and extends: [0, 4]
    assert c.add(5, 5) == 0
    assert c.total == pytest.approx(4.0) and c.spans == [[0, 4]]


def test_slow_rank_is_attributed_in_log_and_timeline(tmp_path, caplog):
    path = str(tmp_path / "tl.json")
    ev = threading.Event()

    def body(rank):
        for i in range(4):
            if rank == 1:
                ev.wait(0.05)  # rank 1 is slow to reach every collective
            hvd.allreduce(np.ones(2), name=f"step{i}")

    hlog = logging.getLogger("horovod")
    hlog.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="horovod"):
            run_ranks(
                body,
                2,
                env={"HOROVOD_TIMELINE": path, "HOROVOD_WAIT_SUMMARY_SECONDS": "0.01"},
            )
    finally:
        hlog.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "Wait attribution" in r.getMessage()]
    assert lines, "no wait attribution logged"
    assert all(re.search(r"rank 1 was the last to submit \d+ of them", m) for m in lines), lines
    events = read(path)
    ends = [e for e in events if e["ph"] == "E" and "last_rank" in e.get("args", {})]
    steps = [e for e in ends if e["args"]["waited_ms"] > 20]
    assert len(steps) >= 3 and all(e["args"]["last_rank"] == 1 for e in steps)
    assert any(e["ph"] == "C" and e["name"] == "WAITED_FOR_SLOWEST_RANK_S" for e in events)
    s = summarize(events)
    assert s.ranks[1].caused_s > s.ranks[0].caused_s
    assert s.ranks[1].last >= 3


# ------------------------------------------------------------------------------ summary tool
def test_summary_command_prints_totals_and_writes_a_plot(tmp_path, capsys):
    path = str(tmp_path / "tl.json")
    clock = FakeClock()
    tl = Timeline(path, clock=clock)
    for _ in range(3):
        for name, slow_rank in (("allreduce.w", 1), ("allreduce.b", 0)):
            tl.negotiate_start(name, "allreduce")
            tl.negotiate_rank_ready(name, 1 - slow_rank)
            clock.t += 0.010
            tl.negotiate_rank_ready(name, slow_rank)
            tl.negotiate_end(name)
            tl.op_start(name, "allreduce")
            tl.activity([name], "TCP_ALLREDUCE")
            clock.t += 0.002
            tl.op_end(name, "float32", (4,))
    tl.close()
    png = str(tmp_path / "plot.png")
    assert summary_main(["summary", path, "--plot", png]) == 0
    out = capsys.readouterr().out
    assert re.search(r"allreduce\.w\s+3\s+0\.0300\s+0\.0060\s+TCP_ALLREDUCE 0\.0060", out), out
    assert re.search(r"^\s+0\s+0\.0300\s+0\.0300\s+3 of 6$", out, re.M), out
    assert re.search(r"^\s+1\s+0\.0300\s+0\.0300\s+3 of 6$", out, re.M), out
    assert os.path.getsize(png) > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_summary_command_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert summary_main(["summary", str(bad)]) == 2
    assert "not a timeline (invalid JSON" in capsys.readouterr().err
    assert summary_main(["summary", str(tmp_path / "missing.json")]) == 2
    obj = tmp_path / "obj.json"
    obj.write_text("{}")
    assert summary_main(["summary", str(obj)]) == 2
    assert "expected a JSON array" in capsys.readouterr().err


@pytest.mark.e2e
def test_horovodrun_timeline_flags_and_summary_command(tmp_path):
    from conftest import run_module, run_script

    path = str(tmp_path / "run.json")
    out = run_script(
        """
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()
        for step in range(3):
            hs = [hvd.allreduce_async(np.ones(1000), name=f"layer{i}") for i in range(4)]
            [hvd.synchronize(h) for h in hs]
        hvd.allgather(np.ones((2, 2)), name="metrics")
        """,
        launcher_args=["--timeline-filename", path, "--timeline-mark-cycles"],
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = read(path)
    r = rows(events)
    assert {f"allreduce.layer{i}" for i in range(4)} <= set(r)
    names = {e.get("name") for e in events}
    # Two ranks on one host: the data moves through shared memory.
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "SHM_ALLREDUCE", "CYCLE_START"} <= names
    assert "SHM_ALLGATHER" in names
    for evs in r.values():
        spans(evs)  # every span closed, properly nested
    png = str(tmp_path / "run.png")
    res = run_module("horovod.timeline", "summary", path, "--plot", png)
    assert res.returncode == 0, res.stderr
    assert "allreduce.layer0" in res.stdout and "Per rank" in res.stdout
    assert os.path.getsize(png) > 10_000


def test_speedscope_export_names_every_end_and_filters(tmp_path):
    from horovod.timeline.summary import for_speedscope

    path = str(tmp_path / "tl.json")
    clock = FakeClock()
    tl = Timeline(path, clock=clock)
    for _ in range(3):
        for name in ("allreduce.a", "allreduce.b"):
            tl.negotiate_start(name, "allreduce")
            tl.negotiate_rank_ready(name, 0)
            tl.negotiate_end(name)
            tl.op_start(name, "allreduce")
            tl.activity([name], "TCP_ALLREDUCE")
            clock.t += 0.001
            tl.op_end(name, "float32", (2,))
    tl.close()
    out = for_speedscope(read(path), "allreduce.b", first=2, count=2)
    body = [e for e in out if e["ph"] != "M"]
    assert all(e["tid"] == 0 and e["name"] for e in body)
    assert [(e["ph"], e["name"]) for e in body] == [
        ("B", "NEGOTIATE_ALLREDUCE"),
        ("E", "NEGOTIATE_ALLREDUCE"),
        ("B", "ALLREDUCE"),
        ("B", "TCP_ALLREDUCE"),
        ("E", "TCP_ALLREDUCE"),
        ("E", "ALLREDUCE"),
    ]
    assert {e["pid"] for e in body} == {2}
    with pytest.raises(ValueError, match="no tensor named 'zzz'"):
        for_speedscope(read(path), "zzz")
    dst = str(tmp_path / "ss.json")
    assert summary_main(["speedscope", path, dst]) == 0
    assert len(read(dst)) > len(body)


@pytest.mark.e2e
def test_peer_round_allreduces_appear_in_the_timeline(tmp_path):
    """Small cached ops that peer rounds decide (ranks sharing a host) show as op spans with a
    PEER_ALLREDUCE / PEER_ALLGATHER / PEER_BROADCAST activity on rank 0's timeline."""
    from conftest import run_script

    path = str(tmp_path / "peer.json")
    out = run_script(
        """
        import numpy as np
        import horovod.numpy as hvd
        from horovod.core.context import current

        hvd.init()
        for step in range(20):
            hvd.allreduce(np.ones(3) * step, name="loss")
            hvd.allgather(np.ones(2) * step, name="ag")
            hvd.broadcast(np.ones(2) * step, 1, name="bc")
        print("rounds", current().engine.stats["rounds_run"], flush=True)
        """,
        env={"HOROVOD_TIMELINE": path},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = read(path)
    for row, activity in [
        ("allreduce.loss", "PEER_ALLREDUCE"),
        ("allgather.ag", "PEER_ALLGATHER"),
        ("broadcast.bc", "PEER_BROADCAST"),
    ]:
        peer = [e for e in rows(events)[row] if e.get("name") == activity]
        assert len(peer) >= 1, (row, {str(e.get("name")) for e in rows(events)[row]})
    counts = [int(n) for n in re.findall(r"rounds (\d+)", out.stdout)]
    assert len(counts) == 2 and min(counts) >= 3, out.stdout
    for evs in rows(events).values():
        spans(evs)
