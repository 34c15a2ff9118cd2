"""Shared memory and the engine run by waiting threads, under the real horovodrun (processes)."""

from __future__ import annotations

import os
import re
import time

import pytest
from conftest import run_script

from horovod.common.shm_names import PREFIX, shm_dir

pytestmark = pytest.mark.e2e


def _ours() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}


def test_ranks_on_one_host_use_shared_memory_and_tcp_when_disabled():
    script = """
        import horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        print("transport", type(current().engine.transport).__name__, flush=True)
    """
    out = run_script(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("transport ShmTransport") == 2
    out = run_script(script, env={"HOROVOD_SHARED_MEMORY": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("transport PolledTcpTransport") == 2  # (TCP, control polled)
    out = run_script(script, env={"HOROVOD_SHARED_MEMORY": "0", "HOROVOD_TCP_POLLED_CONTROL": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("transport TcpTransport") == 2


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
        assert sorted(re.findall(r"done \d \[0, 1, 2, 3\] MixedBoard True", out.stdout)) == [
            "done 0 [0, 1, 2, 3] MixedBoard True".replace("0 [", f"{r} [") for r in range(4)
        ], out.stdout


def test_crowded_counts_ranks_by_machine_not_host_name(monkeypatch):
    from horovod.common import net

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert net.crowded(["m", "m", "m", "n"], 0) and not net.crowded(["m", "m", "m", "n"], 3)
    assert not net.crowded(["m", "m"], 1)
    assert net.machine_id() == net.machine_id() != ""


def _can_read_a_child_process() -> bool:
    """Would single-copy reads work between processes here (the same check the ranks make)?"""
    import ctypes

    from horovod.transport import cma

    if not cma.available():
        return False
    buf = ctypes.create_string_buffer(b"probe-bytes", 16)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    try:
        got = ctypes.create_string_buffer(16)
        cma.read(pid, ctypes.addressof(buf), ctypes.addressof(got), 16)
        return got.raw == buf.raw
    except OSError:
        return False
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_large_messages_move_by_single_copy_between_processes():
    """Allreduce, allgather and broadcast of messages above the single-copy threshold (2 MiB by
    default) between real processes: exact results, and the ranks agree whether it is on."""
    script = """
        import numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        t = current().engine.transport
        print("single_copy", t.single_copy, "split", t.split_copy, flush=True)
        n = 3 << 20  # float32: 12 MiB
        base = np.arange(n, dtype=np.float32) % 977
        s = hvd.allreduce(base + hvd.rank(), op=hvd.Sum)
        assert np.array_equal(s, base * 2 + 1), "allreduce"
        g = hvd.allgather(np.full((n // 2,), hvd.rank() + 1, np.float32))
        assert (g[: n // 2] == 1).all() and (g[n // 2 :] == 2).all(), "allgather"
        b = hvd.broadcast(base + 10 * hvd.rank(), root_rank=1)
        assert np.array_equal(b, base + 10), "broadcast"
        for k in range(3):  # split: the root writes half, the receiver reads half
            x = base[: n - 1001] + (5 * k if hvd.rank() == 0 else -1)
            hvd.broadcast_(x, 0, name="inplace")
            assert np.array_equal(x, base[: n - 1001] + 5 * k), "broadcast_"
        print("exact", flush=True)
    """
    out = run_script(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("exact") == 2
    values = set(re.findall(r"single_copy (\d+)", out.stdout))
    assert len(values) == 1, out.stdout
    if _can_read_a_child_process():
        assert values == {str(2 * 1024 * 1024)}
        assert out.stdout.count("split True") == 2, out.stdout
    out = run_script(script, env={"HOROVOD_SHM_SINGLE_COPY_BYTES": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("single_copy 0 split False") == 2 and out.stdout.count("exact") == 2


def test_mixed_sync_async_ops_from_several_threads_stay_exact():
    """Application threads take turns running the engine; async ops are left to the engine
    thread. Every result is checked."""
    script = """
        import threading, numpy as np, horovod.numpy as hvd
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        errors = []

        def worker(tid):
            try:
                for i in range(150):
                    k = (i * 7 + tid) % 5
                    x = np.full(10 ** k, r + i, np.float64)
                    if i % 3 == 0:
                        h = hvd.allreduce_async(x, name=f"t{tid}.a{i}", op=hvd.Sum)
                        y = hvd.broadcast(x, root_rank=i % n, name=f"t{tid}.b{i}")
                        assert (y == i % n + i).all()
                        out = hvd.synchronize(h)
                    else:
                        out = hvd.allreduce(x, name=f"t{tid}.s{i % 4}", op=hvd.Sum)
                    assert (out == sum(q + i for q in range(n))).all(), (tid, i)
                    g = hvd.allgather(np.full((r + 1, 2), r, np.int32), name=f"t{tid}.g")
                    assert g.shape == (n * (n + 1) // 2, 2)
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        print("errors", errors, flush=True)
        hvd.shutdown()
    """
    out = run_script(script, np_=3, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("errors []") == 3, out.stdout


def test_idle_job_uses_no_cpu():
    """Between steps nothing polls: the engine thread sleeps until there is work."""
    script = """
        import time, numpy as np, psutil, horovod.numpy as hvd
        hvd.init()
        for i in range(50):
            hvd.allreduce(np.ones(1000), name="warm")
        h = hvd.allreduce_async(np.ones(10), name="late")  # rank 1 submits it 2 s later
        if hvd.rank() == 1:
            time.sleep(2.0)
        p = psutil.Process()
        c0, t0 = sum(p.cpu_times()[:2]), time.monotonic()
        time.sleep(2.0)  # idle, and on rank 0 waiting for rank 1's tensor
        used = (sum(p.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
        hvd.synchronize(h)
        print(f"idle cpu {used:.4f}", flush=True)
    """
    out = run_script(script)
    assert out.returncode == 0, out.stderr
    used = [float(line.split()[-1]) for line in out.stdout.splitlines() if "idle cpu" in line]
    assert len(used) == 2 and max(used) < 0.02, used


def test_engine_thread_takes_over_when_the_waiting_thread_does_not_come_back():
    """After a synchronous op the waiting thread keeps the engine for a short lease (peers do
    not wake this rank's engine thread meanwhile). If it then leaves for long, the engine thread
    must take over when the lease ends: here rank 1 sleeps 0.3 s after a synchronous op while
    its asynchronous 'a' needs rank 1's engine for rank 0 to finish 'a'. (A long spin makes the
    waiting thread finish 'b' itself, so the lease is taken; the script checks it was.)"""
    script = """
        import time, numpy as np, horovod.numpy as hvd
        from horovod.core import context
        hvd.init()
        engine = context.current().engine
        for i in range(20):
            hvd.allreduce(np.ones(10), name="warm")
        worst, leases = 0.0, 0
        for i in range(6):
            if hvd.rank() == 1:
                h = hvd.allreduce_async(np.ones(10), name="a")
                hvd.allreduce(np.ones(10), name="b")
                leases += engine._lease_until > time.perf_counter()
                time.sleep(0.3)
                hvd.synchronize(h)
            else:
                hvd.allreduce(np.ones(10), name="b")
                time.sleep(0.005)
                t0 = time.perf_counter()
                hvd.allreduce(np.ones(10), name="a")
                worst = max(worst, time.perf_counter() - t0)
        print(f"rank {hvd.rank()} worst {worst:.4f} leases {leases}", flush=True)
    """
    env = {"HOROVOD_SPIN_MICROSECONDS": "2000", "HOROVOD_CYCLE_TIME": "0.01"}
    out = run_script(script, env=env)
    assert out.returncode == 0, out.stderr
    found = re.findall(r"rank (\d) worst ([\d.]+) leases (\d+)", out.stdout)
    worst = {int(r): float(w) for r, w, _ in found}
    leases = {int(r): int(n) for r, _, n in found}
    assert leases[1] >= 1, out.stdout  # the situation under test happened
    assert worst[0] < 0.15, out.stdout  # not the 0.3 s until rank 1 came back


def test_a_waiting_thread_keeps_the_engine_for_a_lease_only_when_it_comes_back_quickly():
    """A loop of synchronous calls keeps the engine between calls (a lease), once the thread
    has come back within one; a thread that comes back only after longer (a training step's
    compute) gets none, so its engine thread is not kicked awake after every call for nothing.
    (A long spin: no call gives up waiting, which would hand the engine over and kick too.)"""
    script = """
        import time, numpy as np, horovod.numpy as hvd
        from horovod.core import context
        hvd.init()
        engine = context.current().engine
        kicks = [0]
        kick = engine.transport.kick
        def counted():
            kicks[0] += 1
            kick()
        engine.transport.kick = counted
        x = np.ones(10)
        for name in ("loop", "spaced"):  # negotiated once: cached (one call, one wait) from now
            hvd.allreduce(x, name=name)
        back_to_back = 0
        for i in range(20):
            hvd.allreduce(x, name="loop")
            back_to_back += engine._lease_until > time.perf_counter()
        spaced, before = 0, kicks[0]
        for i in range(20):
            time.sleep(0.01)
            hvd.allreduce(x, name="spaced")
            spaced += engine._lease_until > time.perf_counter()
        print(f"rank {hvd.rank()} leases {back_to_back} {spaced} kicks {kicks[0] - before}")
    """
    out = run_script(script, env={"HOROVOD_SPIN_MICROSECONDS": "20000"})
    assert out.returncode == 0, out.stderr
    found = re.findall(r"rank \d leases (\d+) (\d+) kicks (\d+)", out.stdout)
    assert len(found) == 2, out.stdout
    for back_to_back, spaced, kicks in found:
        assert int(back_to_back) >= 15, out.stdout  # a lease after nearly every call
        assert int(spaced) == 0, out.stdout
        assert int(kicks) <= 3, out.stdout  # not one per call


def test_ranks_with_different_data_plane_settings_get_a_clear_error():
    script = """
        import os
        os.environ["HOROVOD_SHM_SLOTS"] = str(2 + int(os.environ["HOROVOD_RANK"]))
        import horovod.numpy as hvd
        hvd.init()
    """
    out = run_script(script)
    assert out.returncode != 0
    assert "HOROVOD_SHM_SLOTS=2 here but 3 on rank 1" in out.stderr + out.stdout


def test_killed_rank_leaves_no_shared_memory_and_the_others_stop():
    before = _ours()
    script = """
        import os, signal, numpy as np, horovod.numpy as hvd
        hvd.init()
        hvd.allreduce(np.ones(1 << 20), name="x")
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.ones(1 << 20), name="y")
    """
    out = run_script(script, timeout=60)
    assert out.returncode != 0
    assert "rank 1" in out.stderr
    assert _ours() - before == set()


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


def test_killed_during_setup_segments_are_removed_by_horovodrun():
    """A rank that dies between creating its segment and unlinking it leaves the file; the
    launcher removes the job's segments when the job ends."""
    before = _ours()
    script = """
        import os, signal
        import horovod.transport.shm as shm
        if os.environ["HOROVOD_RANK"] == "1":
            def die(self, r, name):
                os.kill(os.getpid(), signal.SIGKILL)
            shm.ShmTransport._map_peer = die
        import horovod.numpy as hvd
        hvd.init()
    """
    out = run_script(script, timeout=60, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "5"})
    assert out.returncode != 0
    assert _ours() - before == set()


def test_interrupting_a_thread_that_runs_the_engine_fails_collectives_cleanly():
    """Ctrl-C (or any BaseException) in a thread that is running the engine may leave a
    collective half done: every rank's later collectives fail, none hangs."""
    script = """
        import signal, time, numpy as np, horovod.numpy as hvd
        hvd.init()
        hvd.allreduce(np.ones(4), name="warm")
        if hvd.rank() == 1:
            def boom(*_):
                raise KeyboardInterrupt
            signal.signal(signal.SIGALRM, boom)
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            try:
                hvd.allreduce(np.ones(4), name="x")  # rank 0 is 2 s late: we spin meanwhile
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        else:
            time.sleep(2)
        try:
            hvd.allreduce(np.ones(4), name="y")
            print("rank", hvd.rank(), "no error", flush=True)
        except hvd.HorovodInternalError as e:
            print("rank", hvd.rank(), "failed:", str(e).splitlines()[0], flush=True)
    """
    out = run_script(script, env={"HOROVOD_SPIN_MICROSECONDS": "5000000"}, timeout=60)
    text = out.stdout + out.stderr
    assert "interrupted" in out.stdout, text
    assert "no error" not in out.stdout, text
    assert out.stdout.count("failed:") == 2 and "was interrupted (KeyboardInterrupt)" in text, text


def test_response_list_larger_than_the_control_ring_reaches_every_rank():
    """4000 first-time requests with long names make a response list of more than the 256 KiB
    control ring; the fused allreduce that follows it must not wait on a rank that has not read
    the rest of the list (the coordinator keeps feeding the ring while it waits for data).
    Then the eager path: small cached allreduces come back reduced from the coordinator."""
    script = """
        import numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        for step in range(2):
            hs = [hvd.allreduce_async(np.full(4, hvd.rank() + i, np.float32),
                                      name="x" * 120 + str(i), op=hvd.Sum) for i in range(4000)]
            for i, h in enumerate(hs):
                assert (hvd.synchronize(h) == 2 * i + 1).all(), i
        for i in range(50):
            out = hvd.allreduce(np.full(3, hvd.rank() + i, np.float64), name="small", op=hvd.Sum)
            assert (out == 2 * i + 1).all(), i
        print("eager", current().engine.stats["eager_responses"] >= 45, flush=True)
        print("exact", flush=True)
    """
    out = run_script(script, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("exact") == 2 and out.stdout.count("eager True") == 2, out.stdout


# Calls that count how many went express: a rank whose peer comes later than the spin goes
# the general way, which is correct but makes the count depend on a loaded runner's timing.
_WIDE_SPIN = {"HOROVOD_SPIN_MICROSECONDS": "50000"}


def test_synchronous_numpy_calls_go_express_and_still_check_their_arguments():
    """Named synchronous allreduces, broadcasts and allgathers of a real two-process job take
    the engine's express way once cached, with exact results; arguments the express way does
    not take (a read-only or strided array, scale factors, unnamed calls) go the usual way and
    get its checks and results."""
    script = """
        import numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r = hvd.rank()
        stats = current().engine.stats
        x = np.zeros(4, np.float32)
        for step in range(30):
            x[:] = r + step
            assert hvd.allreduce_(x, op=hvd.Sum, name="s") is x
            assert (x == 2 * step + 1).all(), x
            assert (hvd.allreduce(np.full(2, float(r + step)), name="a") == step + 0.5).all()
            assert (hvd.broadcast(np.full(3, r + step), 1, name="b") == 1 + step).all()
            y = np.full(2, r + step, np.int8)
            assert hvd.broadcast_(y, 0, name="c") is y and (y == step).all()
            g = hvd.allgather(np.full(r + 1, r + step, np.int32), name="g")
            assert g.tolist() == [step, 1 + step, 1 + step], g
        print("express", r, stats["express"], flush=True)
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        for bad in (ro, np.zeros(8, np.float32)[::2]):
            try:
                hvd.allreduce_(bad, op=hvd.Sum, name="s")
            except ValueError as e:
                print("refused", r, e, flush=True)
        before = stats["express"]
        z = hvd.allreduce(np.full(4, float(r)), name="s", op=hvd.Sum, postscale_factor=2.0)
        u = hvd.allreduce(np.full(4, float(r)), op=hvd.Sum)
        assert (z == 2.0).all() and (u == 1.0).all(), (z, u)
        print("after", r, stats["express"] - before, flush=True)
    """
    out = run_script(script, np_=2, env=_WIDE_SPIN)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = [int(c) for c in re.findall(r"express \d (\d+)", out.stdout)]
    assert len(counts) == 2 and all(c >= 100 for c in counts), out.stdout  # of 5 x 29 cached
    refused = re.findall(r"refused \d (.*)", out.stdout)
    assert len(refused) == 4, out.stdout
    assert sum("read-only" in m for m in refused) == 2, refused
    assert sum("C-contiguous" in m for m in refused) == 2, refused
    assert re.findall(r"after \d (\d+)", out.stdout) == ["0", "0"], out.stdout


def test_synchronous_torch_calls_go_express_unless_autograd_needs_the_call():
    """horovod.torch's synchronous calls on plain CPU tensors (a metric's allreduce, in-place
    allreduce_ and broadcast_, broadcast, allgather; bfloat16 and bool too) take the express
    way once cached, with exact results; a tensor that requires grad still goes through the
    autograd function, and its gradient flows back."""
    pytest.importorskip("torch")
    script = """
        import torch, horovod.torch as hvd
        from horovod.core.context import current
        hvd.init()
        r = hvd.rank()
        stats = current().engine.stats
        for step in range(30):
            m = hvd.allreduce(torch.tensor([float(r + step)]), name="loss")
            assert m.item() == step + 0.5, m
            x = torch.full((3,), r + step, dtype=torch.bfloat16)
            assert hvd.allreduce_(x, op=hvd.Sum, name="s") is x and (x == 2 * step + 1).all()
            f = torch.tensor([r == 1, False])
            assert hvd.allreduce(f, op=hvd.Max, name="f").tolist() == [True, False]
            y = torch.full((2,), r + step, dtype=torch.int64)
            assert hvd.broadcast_(y, 1, name="y") is y and (y == 1 + step).all()
            assert (hvd.broadcast(torch.full((2,), float(r)), 0, name="z") == 0).all()
            g = hvd.allgather(torch.full((r + 1,), r + step), name="g")
            assert g.tolist() == [step, 1 + step, 1 + step], g
        print("express", r, stats["express"], flush=True)
        before = stats["express"]
        w = torch.full((2,), float(r + 1), requires_grad=True)
        out = hvd.allreduce(w, name="w", op=hvd.Sum)
        (out * out).sum().backward()
        assert out.grad_fn is not None and w.grad.tolist() == [12.0, 12.0], w.grad
        print("grad", r, stats["express"] - before, flush=True)
    """
    out = run_script(script, np_=2, env=_WIDE_SPIN)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = [int(c) for c in re.findall(r"express \d (\d+)", out.stdout)]
    assert len(counts) == 2 and all(c >= 120 for c in counts), out.stdout  # of 6 x 29 cached
    assert re.findall(r"grad \d (\d+)", out.stdout) == ["0", "0"], out.stdout


def test_the_optimizers_last_bucket_is_reduced_the_express_way_with_exact_averages():
    """DistributedOptimizer reduces the step's last bucket in synchronize(), synchronously:
    with nothing else in flight it takes the engine's express way (a plane round for these
    200 kB of gradients, no submission). The averages are exactly what every rank's own
    gradients give, also with a second bucket in flight (a smaller bucket size) and with
    gradients accumulated over two backward passes."""
    pytest.importorskip("torch")
    script = """
        import os, torch, horovod.torch as hvd
        from horovod.core.context import current
        torch.manual_seed(0)
        hvd.init()
        r = hvd.rank()
        stats = current().engine.stats
        passes = int(os.environ.get("PASSES", "1"))
        model = torch.nn.Sequential(torch.nn.Linear(100, 400), torch.nn.ReLU(),
                                    torch.nn.Linear(400, 20))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(1 + r)
        before = stats["express_plane"]
        for step in range(12):
            opt.zero_grad()
            xs = [torch.randn(8, 100, generator=g) for _ in range(passes)]
            for x in xs:
                model(x).pow(2).mean().backward()
            mine = [p.grad.clone() for p in model.parameters()]
            opt.synchronize()
            for i, (p, m) in enumerate(zip(model.parameters(), mine)):
                want = sum(hvd.allgather(m.unsqueeze(0), name=f"check.{i}")) / 2
                assert torch.allclose(p.grad, want, rtol=1e-6, atol=1e-7), (step, p.shape)
            with opt.skip_synchronize():
                opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        same = hvd.allgather(flat.unsqueeze(0), name="params")
        assert torch.equal(same[0], same[1])
        print("plane", r, stats["express_plane"] - before, flush=True)
    """
    for env, most in [
        ({}, True),
        ({"HOROVOD_GRADIENT_BUCKET_BYTES": "100000"}, False),  # the second bucket in flight
        ({"PASSES": "2"}, True),
    ]:
        out = run_script(script, np_=2, env={**_WIDE_SPIN, **env}, timeout=120)
        assert out.returncode == 0, (env, out.stdout + out.stderr)
        counts = [int(c) for c in re.findall(r"plane \d (\d+)", out.stdout)]
        assert len(counts) == 2, out.stdout
        if most:  # of 2 x 11 cached steps (a rank whose peer posts later than its spin ends
            assert sum(counts) >= 4, (env, counts)  # the general way)


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


# (not 4 ranks: the data plane's small allreduce is recursive doubling there, another order)
@pytest.mark.parametrize(("np_", "plane"), [c for c in PLANE_CASES if c[0] < 4])
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
        stats = current().engine.stats
        print("digest", hvd.rank(), digest.hexdigest(),
              "rounds", stats["rounds_run"], "express", stats["express"], flush=True)
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
        found = re.findall(r"digest (\d) (\w+) rounds (\d+) express (\d+)", out.stdout)
        assert len(found) == np_, out.stdout
        assert len({d for _, d, _, _ in found}) == 1, (mode, found)  # every rank alike
        digests[mode] = found[0][1]
        rounds = [int(n) for _, _, n, _ in found]
        express = [int(q) for _, _, _, q in found]
        if rounds_on:
            assert all(n >= 1 for n in rounds), (mode, found)
        else:
            assert rounds == [0] * np_ and express == [0] * np_, (mode, found)
        if mode == "rounds":  # the synchronous calls ran their rounds the express way
            assert all(q >= 1 for q in express), (mode, found)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize(("np_", "plane"), PLANE_CASES)
def test_peer_rounds_run_every_cached_op_like_rank_0_does(np_, plane):
    """With peer rounds every cached op of the global set skips rank 0: small allgathers and
    broadcasts carry their data in the round (each rank builds the result from the posts),
    larger ones and alltoall/reducescatter run on the data plane after the round, mixed with
    first calls that rank 0 negotiates. Every output must equal what rank 0's lists give."""
    script = """
        import hashlib, numpy as np, horovod.numpy as hvd
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
            # 3 cached steps of 9 + n ops, all of them in rounds (none went to rank 0).
            assert all(k >= 3 * (9 + np_) for k in rounds), found
        else:
            assert rounds == [0] * np_, found
    assert digests["rounds"] == digests["rank 0"]


@pytest.mark.parametrize("np_", [2, 3])
def test_allgather_results_in_output_slots_stay_exact_while_held_and_changed(np_):
    """A lone allgather of 128 KiB or more per rank builds its result in an output slot of
    the rank (shared memory) from which the peers read that rank's block, one copy less than
    through the round's post. Held results keep their slots (later calls fall back to the
    post, or take the other slot); a rank that changes its result at once does not change
    what the peers read (it returns only once they have read it, here delayed on purpose);
    ranks with the slots off (``HOROVOD_OUTPUT_POOL_BYTES=0``, or one rank alone) interoperate."""
    script = """
        import time, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        eng = current().engine
        t = eng.transport
        W = 40_000  # float32 columns: 160 kB per row, rank q gathers q + 1 rows
        def mine(v):
            return np.full((r + 1, W), v + r, np.float32)
        def expect(v):
            return np.concatenate([np.full((q + 1, W), v + q, np.float32) for q in range(n)])
        def slotted(a):
            return any(a.base is o for o in t.out_owners)
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
