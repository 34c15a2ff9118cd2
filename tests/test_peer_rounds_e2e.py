"""Peer rounds end to end, under the real horovodrun (processes): on shared memory, over TCP
alone (board connections) and in jobs on two host names on this machine (shared memory within
each, TCP between them: ``MixedBoard``), with the same bits as rank 0's lists; and such jobs'
other behaviour (cores counted per machine, a killed rank named)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from conftest import WAYS, run_script
from test_shm_e2e import _can_read_a_child_process, _ours

pytestmark = pytest.mark.e2e


def test_host_names_sharing_one_machine_count_its_cores_together():
    # Two host names on one machine (test hosts, pods of one node): each "host" has 2 ranks,
    # but 4 share the cores; polling without yielding took 600-1200 us per small op here.
    script = """
        import os
        import horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        t = current().engine.transport
        remote = t._remote
        print("crowded", hvd.rank(), current().crowded, t.oversubscribed,
              remote is not None and remote.oversubscribed, os.cpu_count(), flush=True)
        hvd.shutdown()
    """
    out = run_script(script, 4, launcher_args=["-H", "localhost:2,127.0.0.1:2"])
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"crowded (\d) (\w+) (\w+) (\w+) (\d+)", out.stdout)
    assert len(rows) == 4, out.stdout
    for _, *flags, cores in rows:
        want = str(4 > int(cores))
        assert flags == [want, want, want], out.stdout


def test_a_job_on_two_host_names_runs_rounds_of_every_size_to_the_end():
    """Peer rounds across hosts (``MixedBoard``) under the multi-host benchmark's loop: ops
    of 4 B to 1 MiB with a barrier before each, then an object allgather and shutdown. It
    failed 1 run in 3 with a board connection taken for closed (read by a second thread)."""
    script = """
        import numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        for nbytes in (4, 64 << 10, 1 << 20):
            x = np.full(nbytes // 4, hvd.rank() + 1, np.float32)
            for _ in range(15):
                hvd.barrier()
                assert (hvd.allreduce(x, op=hvd.Sum, name=f"r{nbytes}") == 10).all()
                hvd.barrier()
                assert hvd.allgather(x, name=f"g{nbytes}").size == 4 * x.size
        got = hvd.allgather_object(hvd.rank())
        print("done", hvd.rank(), got, type(current().engine.board).__name__,
              current().engine.stats["rounds_run"] > 0, flush=True)
    """
    for _ in range(2):
        out = run_script(script, 4, launcher_args=["-H", "localhost:2,127.0.0.1:2"])
        assert out.returncode == 0, out.stdout + out.stderr
        done = re.findall(r"done (\d) \[0, 1, 2, 3\] MixedBoard True", out.stdout)
        assert sorted(done) == ["0", "1", "2", "3"], out.stdout


def test_crowded_counts_ranks_by_machine_not_host_name(monkeypatch):
    from horovod.common import net

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert net.crowded(["m", "m", "m", "n"], 0) and not net.crowded(["m", "m", "m", "n"], 3)
    assert not net.crowded(["m", "m"], 1)
    assert net.machine_id() == net.machine_id() != ""


@pytest.mark.parametrize("victim", [1, 2])
def test_a_rank_killed_in_a_job_on_two_host_names_stops_the_others_naming_it(victim):
    """Peer rounds across hosts (``MixedBoard``): a rank killed while the others wait for its
    post (1: on rank 0's host, in shared memory; 2: on the other host, over TCP) ends the
    job with a report that names it, without a hang."""
    script = f"""
        import os, signal, time, numpy as np, horovod.numpy as hvd
        hvd.init()
        for i in range(200):
            if i == 100 and hvd.rank() == {victim}:
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce(np.ones(4), name="small")
    """
    before = _ours()
    t0 = time.monotonic()
    out = run_script(script, 4, launcher_args=["-H", "localhost:2,127.0.0.1:2"], timeout=60)
    assert out.returncode != 0
    assert time.monotonic() - t0 < 30
    assert f"Root cause: rank {victim}" in out.stderr, out.stderr
    assert _ours() - before == set()


# Peer rounds on shared memory, over TCP alone (board connections: ``tcp_board``), and both
# in a job on two host names (``mixed_board``: 3 ranks, rank 0's host with 2 of them; 4, two
# hosts of 2).
PLANES = {"shm": {}, "tcp": {"HOROVOD_SHARED_MEMORY": "0"}, "mixed": {}}
PLANE_CASES = [(n, p) for p in ("shm", "tcp") for n in (2, 3)] + [(3, "mixed"), (4, "mixed")]


def _run_on(plane: str, np_: int, script: str, env: dict):
    """``script`` under horovodrun on ``plane`` (two host names for a mixed job)."""
    hosts = ["-H", f"localhost:2,127.0.0.1:{np_ - 2}"] if plane == "mixed" else []
    env = {**env, **PLANES[plane]}
    return run_script(script, np_=np_, env=env, timeout=120, launcher_args=hosts)


# (4 ranks: the data plane's small allreduce is recursive doubling there, which the folds of
# rank 0's eager path and of the data rounds follow, pair by pair)
@pytest.mark.parametrize(("np_", "plane"), PLANE_CASES)
def test_peer_rounds_give_the_same_bits_as_rank_0_and_the_data_plane(np_, plane):
    """Small cached allreduces (every dtype and reduce op, scale factors, Average, integer
    truncation, a grouped op) run as peer rounds by default (the synchronous ones without
    being submitted, the express way): every rank computes the result itself, and it must be bit
    for bit what the coordinator's eager path and the data plane's direct exchange give, on
    every rank."""
    script = """
        import hashlib, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        cases = [
            (np.float32, hvd.Average, 1.0, 1.0), (np.float32, hvd.Sum, 0.5, 3.0),
            (np.float64, hvd.Product, 1.0, 1.0), (np.float16, hvd.Sum, 1.0, 0.25),
            (np.int32, hvd.Average, 1.0, 1.0), (np.int64, hvd.Min, 1.0, 1.0),
            (np.uint8, hvd.Max, 1.0, 1.0), (np.bool_, hvd.Max, 1.0, 1.0),
        ]
        rng = np.random.default_rng(100 + hvd.rank())
        digest = hashlib.sha256()
        for step in range(4):  # steps 2 to 4 hit the response cache
            for i, (dtype, op, pre, post) in enumerate(cases):
                if dtype is np.bool_:
                    x = rng.random(7) > 0.5
                elif np.dtype(dtype).kind == "f":
                    x = (rng.standard_normal(7) * 10).astype(dtype)
                else:
                    x = rng.integers(0, 50, 7).astype(dtype)
                out = hvd.allreduce(x, name=f"c{i}", op=op, prescale_factor=pre,
                                    postscale_factor=post)
                digest.update(out.dtype.str.encode() + out.tobytes())
            outs = hvd.grouped_allreduce([rng.standard_normal(5), rng.standard_normal(3)],
                                         name="g", op=hvd.Sum)
            digest.update(b"".join(o.tobytes() for o in outs))
            # Larger ones still take a data round (256 KiB over the other ranks or more; over more
            # than 2, no more than the plane reduces in rank order: its direct exchange up to
            # 128 KiB, then segments folded by their owners, 240 KB here; over TCP's 256 KiB
            # board at 3 ranks, 128 KiB: the 240 KB ones are plane rounds there)
            bigs = [50_000] if hvd.size() == 2 else [30_000, 60_000]  # 200 / 120, 240 KB
            for i, op in enumerate((hvd.Sum, hvd.Average)):
                for big in bigs:
                    x = (rng.standard_normal(big) * 100).astype(np.float32)
                    digest.update(hvd.allreduce(x, name=f"big{i}.{big}", op=op).tobytes())
        eng = current().engine
        stats = eng.stats
        print("digest", hvd.rank(), digest.hexdigest(),
              "rounds", stats["rounds_run"], "express", stats["express"],
              "planes", stats["express_plane"], "budget", eng.round_budget, flush=True)
    """
    digests = {}
    for mode, env, rounds_on in [
        ("rounds", {}, True),
        ("coordinator", {"HOROVOD_PEER_ROUNDS": "0"}, False),
        # No eager budget: the cached ops run on the data plane, after a plane round ...
        ("data plane", {"HOROVOD_EAGER_ALLREDUCE_BYTES": "0"}, True),
        # ... or after rank 0's response list.
        (
            "data plane via rank 0",
            {"HOROVOD_EAGER_ALLREDUCE_BYTES": "0", "HOROVOD_PEER_ROUNDS": "0"},
            False,
        ),
    ]:
        out = _run_on(plane, np_, script, env)
        assert out.returncode == 0, out.stdout + out.stderr
        found = re.findall(
            r"digest (\d) (\w+) rounds (\d+) express (\d+) planes (\d+) budget (\d+)",
            out.stdout,
        )
        assert len(found) == np_, out.stdout
        assert len({d for _, d, *_ in found}) == 1, (mode, found)  # every rank alike
        digests[mode] = found[0][1]
        rounds = [int(n) for _, _, n, _, _, _ in found]
        express = [int(q) for _, _, _, q, _, _ in found]
        planes = [int(k) for _, _, _, _, k, _ in found]
        budgets = {int(b) for *_, b in found}
        if rounds_on:
            assert all(n >= 1 for n in rounds), (mode, found)
        else:
            assert rounds == [0] * np_ and express == [0] * np_, (mode, found)
        if mode == "rounds":  # the synchronous calls ran their rounds the express way
            assert all(q >= 1 for q in express), (mode, found)
            # the data rounds' allreduce budget: one post's room over the other ranks (shared
            # memory 2 MiB, TCP 256 KiB and 2 MiB in a job of two ranks; over more than 2 at
            # most what the data plane reduces in rank order, 512 KiB); ranks on several hosts
            # (mixed): the eager budget alone
            want = {("shm", 2): 2 << 20, ("shm", 3): 512 << 10, ("tcp", 2): 2 << 20}.get(
                (plane, np_), 128 << 10 if plane == "tcp" else 16 << 10
            )
            assert budgets == {want}, (mode, found)
            if plane == "shm" or np_ == 2:  # the large ones too, as data rounds
                assert planes == [0] * np_, (mode, found)
        if mode == "data plane":  # (how many went the express way depends on timing)
            assert sum(planes) >= 1, (mode, found)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize(("np_", "plane"), [(2, "shm"), (3, "tcp")])
def test_a_barrier_is_one_peer_round_and_still_waits_for_every_rank(np_, plane):
    """``hvd.barrier()`` hits the response cache from its second call on, and in a peer round
    every rank's post of it is its arrival: no round through rank 0, no data-plane barrier
    after it (38 against 119 us on shared memory, 57 against 238 us over TCP, 2 ranks). It
    must still hold every rank until the last one arrives."""
    script = """
        import time, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        stats = current().engine.stats
        hvd.barrier()  # the first one through rank 0; cached from here
        hvd.barrier()
        held = []
        before = stats["data_rounds"], stats["requests_sent"]
        for step in range(2 * n):
            late = step % n
            if r == late:  # (an idle rank answers a peer's round after 0.5 s at the latest)
                time.sleep(0.2)
            t0 = time.monotonic()
            hvd.barrier()
            if r != late:
                held.append(round(time.monotonic() - t0, 2))
        print("barrier", r, stats["data_rounds"] - before[0],
              stats["requests_sent"] - before[1], min(held), flush=True)
    """
    out = _run_on(plane, np_, script, {})
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"barrier (\d) (\d+) (\d+) ([\d.]+)", out.stdout)
    assert len(found) == np_, out.stdout
    for _, rounds, requests, held in found:
        assert (int(rounds), int(requests)) == (2 * np_, 0), out.stdout  # all peer rounds
        assert float(held) >= 0.15, out.stdout  # each waited for the late rank


@pytest.mark.parametrize(("np_", "plane"), PLANE_CASES)
def test_peer_rounds_run_every_cached_op_like_rank_0_does(np_, plane):
    """With peer rounds every cached op of the global set skips rank 0: small allgathers and
    broadcasts carry their data in the round (each rank builds the result from the posts),
    larger ones and alltoall/reducescatter run on the data plane after the round, mixed with
    first calls that rank 0 negotiates. Every output must equal what rank 0's lists give."""
    script = """
        import hashlib, ml_dtypes, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        digest = hashlib.sha256()
        def note(a):
            a = np.ascontiguousarray(a)
            digest.update(str(a.shape).encode() + a.dtype.str.encode() + a.tobytes())
        for step in range(4):  # steps 2 to 4 hit the response cache
            v = step * 10 + r
            note(hvd.allgather(np.full((r + 1, 3), v, np.int32), name="ag"))  # rows per rank
            note(hvd.allgather(np.full((r + 1, 100_000), v, np.float32), name="ag_big"))
            # dtypes without a buffer format, and a rank with no rows
            note(hvd.allgather(np.full((r + 1, 2), v, ml_dtypes.bfloat16), name="ag_bf"))
            note(hvd.broadcast(np.full(3, v, ml_dtypes.bfloat16), n - 1, name="bc_bf"))
            note(hvd.allgather(np.full((r % 2, 3), v, np.int32), name="ag_none"))
            for root in range(n):
                note(hvd.broadcast(np.full(5, v, np.float64), root, name=f"bc{root}"))
            note(hvd.broadcast(np.arange(400_000, dtype=np.float32) + v, n - 1, name="bc_big"))
            note(hvd.allreduce(np.full(300_000, v, np.float32), name="ar_big", op=hvd.Sum))
            note(hvd.allreduce(np.arange(7, dtype=np.float64) * v, name="ar", op=hvd.Average))
            out, got = hvd.alltoall(np.arange(2 * n, dtype=np.int64) + v, splits=[2] * n,
                                    name="a2a")
            note(out); note(got)
            note(hvd.reducescatter(np.full((2 * n, 3), v, np.float32), op=hvd.Sum, name="rs"))
            for a in hvd.grouped_allgather([np.full((2, 2), v, np.int16),
                                            np.full((r + 1,), v, np.int16)], name="gag"):
                note(a)
            x = np.full(6, v, np.uint8)
            hvd.broadcast_(x, 0, name="bc_inplace")
            note(x)
        print("digest", r, digest.hexdigest(), "rounds", current().engine.stats["rounds_run"],
              flush=True)
    """
    digests = {}
    for mode, env in [("rounds", {}), ("rank 0", {"HOROVOD_PEER_ROUNDS": "0"})]:
        out = _run_on(plane, np_, script, env)
        assert out.returncode == 0, out.stdout + out.stderr
        found = re.findall(r"digest (\d) (\w+) rounds (\d+)", out.stdout)
        assert len(found) == np_, out.stdout
        digests[mode] = sorted((int(rank), d) for rank, d, _ in found)
        rounds = [int(k) for _, _, k in found]
        if mode == "rounds":
            # 3 cached steps of 12 + n ops, all of them in rounds (none went to rank 0).
            assert all(k >= 3 * (12 + np_) for k in rounds), found
        else:
            assert rounds == [0] * np_, found
    assert digests["rounds"] == digests["rank 0"]


@pytest.mark.parametrize("np_", [2, 3])
def test_allgather_results_in_output_slots_stay_exact_while_held_and_changed(np_):
    """A lone allgather of 320 KiB or more per rank builds its result in an output slot of
    the rank (shared memory) from which the peers read that rank's block, one copy less than
    through the round's post; a smaller block goes through the post (faster there: no wait for
    the peers' acks). Held results keep their slots (later calls fall back to the post, or
    take the other slot); a rank that changes its result at once does not change what the
    peers read (it returns only once they have read it, here delayed on purpose); ranks with
    the slots off (``HOROVOD_OUTPUT_POOL_BYTES=0``, or one rank alone) interoperate."""
    script = """
        import time, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        eng = current().engine
        t = eng.transport
        W = 82_000  # float32 columns: 328 kB per row, rank q gathers q + 1 rows
        def mine(v, w=W):
            return np.full((r + 1, w), v + r, np.float32)
        def expect(v, w=W):
            return np.concatenate([np.full((q + 1, w), v + q, np.float32) for q in range(n)])
        def slotted(a):
            return any(a.base is o for o in t.out_owners)
        # Blocks under the slots' minimum (96-288 kB) go through the post.
        for step in range(3):
            out = hvd.allgather(mine(step, 24_000), name="small")
            assert np.array_equal(out, expect(step, 24_000)), ("small", step)
            assert not slotted(out), ("small", step)
        held = []
        for step in range(6):
            out = hvd.allgather(mine(10 * step), name="ag")
            assert np.array_equal(out, expect(10 * step)), step
            held.append((step, out, slotted(out)))
        for step, out, _ in held:  # no later call overwrote a held result
            assert np.array_equal(out, expect(10 * step)), ("held", step)
        in_slots = sum(s for _, _, s in held)
        held.clear()
        # Rank 0 overwrites its result at once; the peers read its block late on purpose.
        if r != 0:
            peer_out = t.peer_out
            def late(peer, k):
                time.sleep(0.05)
                return peer_out(peer, k)
            t.peer_out = late
        for step in range(3):
            out = hvd.allgather(mine(100 + step), name="ag")
            ok = np.array_equal(out, expect(100 + step))
            out[:] = -1
            assert ok, ("late readers", step)
            del out
        if r != 0:
            t.peer_out = peer_out
        # Rank 1 stops using its slots; the others go on using theirs.
        if r == 1:
            t.outputs = False
        for step in range(3):
            out = hvd.allgather(mine(200 + step), name="ag")
            assert np.array_equal(out, expect(200 + step)), ("mixed", step)
            assert r != 1 or not slotted(out)
            del out
        print("slots", r, in_slots, eng.stats["slot_outputs"], eng.stats["express"], flush=True)
        # A result outlives the job's shared memory: the mapping stays while it is viewed.
        kept = [hvd.allgather(mine(300 + i), name="ag") for i in range(3)]
        was = any(slotted(k) for k in kept)
        hvd.shutdown()
        for i, k in enumerate(kept):
            assert np.array_equal(k, expect(300 + i))
            k += 1
        print("kept", r, was, flush=True)
    """
    for env, on in [({}, True), ({"HOROVOD_OUTPUT_POOL_BYTES": "0"}, False)]:
        out = run_script(script, np_=np_, env=env, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        found = re.findall(r"slots (\d) (\d+) (\d+) (\d+)", out.stdout)
        assert len(found) == np_, out.stdout
        kept = re.findall(r"kept \d (True|False)", out.stdout)
        assert len(kept) == np_ and ("True" in kept) == on, out.stdout
        for _rank, held_in_slots, total, express in found:
            if on:
                # Steps 1-5 are rounds (most of them express calls): the first two held
                # results fill both slots.
                assert 1 <= int(held_in_slots) <= 2 and int(total) >= 4, found
                assert int(express) >= 1, found
            else:
                assert int(held_in_slots) == 0 and int(total) == 0, found


def test_an_uneven_allgather_in_a_plane_round_leaves_the_output_slots_alone():
    """An allgather whose largest block exceeds a data round's room runs on the data plane,
    which never reads output slots: an express call of it must not copy this rank's block into
    one first (it did, for blocks that fit a slot: a wasted copy of up to 2 MiB per call)."""
    script = """
        import numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        eng = current().engine
        t = eng.transport
        rows = [640 if q == 0 else 64 for q in range(n)]  # 2.5 MiB from rank 0, 256 KiB others
        def mine(v):
            return np.full((rows[r], 1024), v + r, np.float32)
        def expect(v):
            return np.concatenate([np.full((rows[q], 1024), v + q, np.float32) for q in range(n)])
        for o in t.out_owners:
            o[:] = 7
        planes = eng.stats["express_plane"]
        for step in range(4):
            x = mine(10 * step)
            hvd.barrier()  # (so that neither rank's wait for the other runs out: see below)
            out = hvd.allgather(x, name="uneven")
            assert np.array_equal(out, expect(10 * step)), step
        untouched = all(bool((o == 7).all()) for o in t.out_owners)
        print("uneven", r, eng.stats["express_plane"] - planes, untouched, flush=True)
        hvd.shutdown()
    """
    out = run_script(script, np_=2, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"uneven (\d) (\d+) (True|False)", out.stdout)
    assert len(found) == 2, out.stdout + out.stderr
    for _rank, planes, untouched in found:
        # (the first call negotiates; later ones are express, unless the peer's post comes
        # after the wait for it, which the barrier before each call keeps from happening)
        assert int(planes) >= 2, found
        assert untouched == "True", found


@pytest.mark.skipif(
    not _can_read_a_child_process(), reason="single-copy reads (process_vm_readv) refused here"
)
def test_two_rank_broadcasts_the_data_plane_splits_skip_the_data_round():
    """On shared memory with single copy, a two-rank broadcast from 2 MiB is split between
    the ranks (the root writes half into the receiver, which reads the other half): faster
    than a data round (0.83x, benchmarks.md), so only smaller ones take data rounds, while
    allgathers and allreduces fill the board's 2 MiB room."""
    script = (
        WAYS
        + """
        import json, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r = hvd.rank()
        eng = current().engine
        room = eng.board_data
        split = eng.transport.split_pair_bytes
        assert room == 2 << 20 and split == 2 << 20, (room, split)
        assert eng.round_broadcast == split - 1 and eng.round_budget == room
        big = np.full(512 << 10, r + 1.0, np.float32)  # 2 MiB
        small = np.full(384 << 10, r + 1.0, np.float32)  # 1.5 MiB
        got = [
            ways(lambda: hvd.broadcast_(big, 1, name="b2"))[:2],
            ways(lambda: hvd.broadcast_(small, 1, name="b15"))[:2],
            ways(lambda: hvd.allreduce_(big, op=hvd.Max, name="a2"))[:2],
            ways(lambda: hvd.allgather(big, name="g2"))[:2],
        ]
        print("ways", r, json.dumps(got), flush=True)
        assert (big == 2).all() and (small == 2).all()
        hvd.shutdown()
    """
    )
    out = run_script(script, np_=2, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"ways \d (.*)", out.stdout)
    assert len(found) == 2, out.stdout + out.stderr
    for line in found:
        b2, b15, a2, g2 = json.loads(line)
        assert b2 == [0, 4], line
        assert b15 == a2 == g2 == [4, 0], line  # (g2: 2 MiB blocks, 4 MiB in all)


@pytest.mark.parametrize("np_", [2, 3])
def test_tcp_data_rounds_carry_up_to_2_mib_in_jobs_of_two_ranks(np_):
    """Over TCP alone a post's room is 2 MiB in a job of two ranks on one machine (a data
    round moves there what the data plane would, less the plane round's trip; 512 KiB on two,
    test_multihost.py) and 256 KiB over more ranks: 1.5
    MiB allreduces, allgathers of 1.5 MiB blocks and broadcasts take data rounds at two ranks
    and plane rounds at three, a 3 MiB broadcast takes a plane round either way, and every
    result is right."""
    script = (
        WAYS
        + """
        import json, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        eng = current().engine
        mid = np.full(384 << 10, r + 1.0, np.float32)  # 1.5 MiB
        big = np.full(768 << 10, r + 1.0, np.float32)  # 3 MiB
        got = {
            "allreduce": ways(lambda: hvd.allreduce(mid, op=hvd.Sum, name="a")),
            "allgather": ways(lambda: hvd.allgather(mid, name="g")),
            "broadcast": ways(lambda: hvd.broadcast(mid, n - 1, name="b")),
            "broadcast_big": ways(lambda: hvd.broadcast(big, n - 1, name="bb")),
        }
        want = {
            "allreduce": np.full(mid.size, n * (n + 1) / 2, np.float32),
            "allgather": np.repeat(np.arange(1.0, n + 1, dtype=np.float32), mid.size),
            "broadcast": np.full(mid.size, float(n), np.float32),
            "broadcast_big": np.full(big.size, float(n), np.float32),
        }
        for k, (_, _, out) in got.items():
            assert np.array_equal(out, want[k]), k
        print("ways", r, eng.board_data, json.dumps({k: v[:2] for k, v in got.items()}),
              flush=True)
        hvd.shutdown()
    """
    )
    out = _run_on("tcp", np_, script, {})
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"ways \d (\d+) (.*)", out.stdout)
    assert len(found) == np_, out.stdout + out.stderr
    data = [4, 0] if np_ == 2 else [0, 4]
    for room, line in found:
        assert int(room) == (2 << 20 if np_ == 2 else 256 << 10), line
        ways = json.loads(line)
        assert ways["allreduce"] == ways["broadcast"] == data, line
        assert ways["allgather"] == data, line  # (1.5 MiB blocks)
        assert ways["broadcast_big"] == [0, 4], line
