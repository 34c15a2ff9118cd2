"""End to end: the real horovodrun on small scripts."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import REPO, horovodrun_example, run_module, run_script

pytestmark = pytest.mark.e2e


def test_success_env_contract_and_prefixes():
    r = run_script(
        """
        import os, sys, numpy as np, horovod.numpy as hvd
        hvd.init()
        keys = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "PYTHONUNBUFFERED"]
        print({k: os.environ[k] for k in keys})
        assert os.environ["HOROVOD_SECRET_KEY"] not in open("/proc/self/cmdline").read()
        s = hvd.allreduce(np.array([hvd.rank()]), op=hvd.Sum)
        print("sum", int(s[0]), "rank", hvd.rank(), "local", hvd.local_rank())
        print("to stderr", file=sys.stderr)
    """,
        3,
    )
    assert r.returncode == 0, r.stderr
    for rank in range(3):
        assert f"[{rank}]<stdout>:sum 3 rank {rank} local {rank}" in r.stdout
        assert f"[{rank}]<stderr>:to stderr" in r.stderr
        assert (
            f"'HOROVOD_RANK': '{rank}', 'HOROVOD_SIZE': '3', 'HOROVOD_LOCAL_RANK': '{rank}', "
            "'HOROVOD_LOCAL_SIZE': '3', 'HOROVOD_CROSS_RANK': '0', 'HOROVOD_CROSS_SIZE': '1'"
            in r.stdout
        )
    assert "'HOROVOD_CONTROLLER': 'gloo'" in r.stdout and "'PYTHONUNBUFFERED': '1'" in r.stdout


def test_failure_of_one_rank_stops_all_and_reports_root_cause_last():
    r = run_script(
        """
        import sys, time, numpy as np, horovod.numpy as hvd
        hvd.init()
        hvd.allreduce(np.ones(3))
        if hvd.rank() == 1:
            print("about to fail", flush=True)
            raise KeyError("bad batch 42")
        while True:
            hvd.allreduce(np.ones(3))
            time.sleep(0.01)
    """,
        3,
    )
    assert r.returncode == 1
    tail = r.stderr.strip().splitlines()
    root = next(i for i, line in enumerate(tail) if line.startswith("Root cause:"))
    assert "rank 1 on host" in tail[root] and "failed with KeyError: 'bad batch 42'" in tail[root]
    assert "KeyError: 'bad batch 42'" in "\n".join(tail[root:])  # its traceback comes last
    assert any("rank 0 (" in line and "rank 1 failed" in line for line in tail[:root])
    assert any("rank 2 (" in line and "rank 1 failed" in line for line in tail[:root])
    # the other ranks were told what happened on rank 1, not just "shut down"
    assert "rank 1 exited after an uncaught KeyError: 'bad batch 42'" in r.stderr + r.stdout


@pytest.mark.parametrize("victim", [2, 0], ids=["worker", "coordinator"])
def test_killed_rank_is_named_by_every_other_rank(victim):
    r = run_script(
        f"""
        import os, signal, time, numpy as np, horovod.numpy as hvd
        from horovod.common.exceptions import HorovodInternalError
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # survive horovodrun's stop to report
        hvd.init()
        try:
            for i in range(10000):
                if hvd.rank() == {victim} and i == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                hvd.allreduce(np.ones(3), name=f"t{{i % 2}}")
        except HorovodInternalError as e:
            print("ERROR", e, flush=True)
            raise SystemExit(1)
    """,
        3,
        timeout=60,
    )
    assert r.returncode == 137
    assert f"Root cause: rank {victim} on host" in r.stderr
    assert "killed by signal SIGKILL" in r.stderr
    who = "rank 2 exited" if victim == 2 else "rank 0 (the coordinator) exited"
    for rank in {0, 1, 2} - {victim}:
        assert f"[{rank}]<stdout>:ERROR {who} or lost its connection" in r.stdout


def test_exit_code_and_nonzero_exit_without_exception():
    r = run_script(
        "import sys, horovod.numpy as hvd\nhvd.init()\nsys.exit(7 if hvd.rank() == 0 else 0)\n", 2
    )
    assert r.returncode == 7
    assert "Root cause: rank 0" in r.stderr and "exited with code 7" in r.stderr
    assert "Rank 0 printed nothing." in r.stderr


def test_np_smaller_than_slots_runs_exactly_np():
    r = run_script(
        "import horovod.numpy as hvd\nhvd.init()\nprint('size', hvd.size())\n",
        2,
        launcher_args=["-H", "localhost:4"],
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("size 2") == 2 and "[2]" not in r.stdout


def test_progress_bars_with_carriage_returns_are_forwarded():
    r = run_script(
        """
        import sys
        for i in range(3):
            sys.stdout.write(f"progress {i}\\r"); sys.stdout.flush()
        sys.stdout.write("done\\n"); sys.stdout.write("no newline at end")
    """,
        1,
        raw=True,
    )
    assert r.returncode == 0
    assert r.stdout == (
        b"[0]<stdout>:progress 0\r[0]<stdout>:progress 1\r[0]<stdout>:progress 2\r"
        b"[0]<stdout>:done\n[0]<stdout>:no newline at end\n"
    )


def test_flags_become_worker_environment(tmp_path):
    r = run_script(
        """
        import os
        print(os.environ.get("HOROVOD_FUSION_THRESHOLD"), os.environ.get("HOROVOD_CYCLE_TIME"),
              os.environ.get("HOROVOD_CACHE_CAPACITY"), os.environ.get("HOROVOD_LOG_LEVEL"),
              os.environ.get("HOROVOD_START_TIMEOUT"))
    """,
        1,
        launcher_args=[
            "--fusion-threshold-mb",
            "2",
            "--cycle-time-ms",
            "3",
            "--cache-capacity",
            "0",
            "--log-level",
            "debug",
            "--start-timeout",
            "12",
            "--output-filename",
            str(tmp_path),
            "--prefix-output-with-timestamp",
        ],
    )
    assert r.returncode == 0, r.stderr
    assert "<stdout>:2097152 3.0 0 DEBUG 12.0" in r.stdout
    assert (tmp_path / "rank.0" / "stdout").read_text() == "2097152 3.0 0 DEBUG 12.0\n"
    assert r.stdout.split("[0]")[0].strip()  # a timestamp precedes the prefix


def _launcher(*args):
    return run_module("horovod.runner.launch", *args, timeout=60)


@pytest.mark.parametrize(
    "args, message",
    [
        (["python", "x.py"], "-np/--num-proc is required"),
        (["-np", "2"], "no training command"),
        (["-np", "0", "python"], "-np must be at least 1"),
        (
            ["-np", "3", "-H", "localhost:2", "python"],
            "Requested more processes (3) than there are",
        ),
        (["-np", "1", "-H", "local host:1", "python"], "Invalid host input"),
        (["-np", "1", "-H", "localhost:1,localhost:2", "python"], "listed more than once"),
        (
            ["-np", "1", "-H", "far-away-host.invalid:1", "python"],
            "cannot start workers over ssh on far-away-host.invalid",
        ),
        (["-np", "1", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
        (["-np", "1", "--mpi", "--min-np", "1", "python"], "elastic jobs run on horovodrun"),
        (["-np", "1", "--fusion-threshold-mb", "-1", "python"], "must be >= 0"),
    ],
)
def test_bad_invocations_are_explained(args, message):
    r = _launcher(*args)
    assert r.returncode == 2
    assert message in r.stderr


def test_check_build_and_version():
    r = _launcher("--check-build")
    assert r.returncode == 0 and "Available Frameworks:" in r.stdout and "[X] Gloo" in r.stdout
    assert _launcher("--version").stdout.startswith("pyhorovod ")


def test_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nlocalhost slots=2\n")
    r = run_script(
        "import horovod.numpy as hvd\nhvd.init()\nprint(hvd.size())\n",
        2,
        launcher_args=["-hostfile", str(hf)],
    )
    assert r.returncode == 0 and r.stdout.count("2\n") == 2


def _children_of(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_stops_every_worker(sig, code, tmp_path):
    script = textwrap.dedent("""
        import os, time, numpy as np, horovod.numpy as hvd
        hvd.init()
        print("ready", os.getpid(), flush=True)
        while True:
            hvd.allreduce(np.ones(2))
            time.sleep(0.01)
    """)
    path = os.path.join(tmp_path, "loop.py")
    with open(path, "w") as f:
        f.write(script)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-m", "horovod.runner.launch", "-np", "2", sys.executable, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    pids = []
    while len(pids) < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        if "ready" in line:
            pids.append(int(line.split()[-1]))
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == code
    assert f"received {signal.Signals(sig).name}; stopped all 2 workers" in err
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_strangers_on_the_ports_do_not_disturb_a_running_job(tmp_path):
    """Rank 0 publishes the rendezvous and transport ports; the test attacks both while the
    job runs collectives; results stay exact."""
    flag = tmp_path / "attacked"
    info = tmp_path / "ports.json"
    script = f"""
        import json, os, time, numpy as np, horovod.numpy as hvd
        from horovod.core.context import current
        hvd.init()
        t = getattr(current().engine.transport, "inner", current().engine.transport)
        if hvd.rank() == 0:
            json.dump({{"rdv": int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
                       "tcp": t._listener.getsockname()[1]}}, open({str(info)!r} + ".tmp", "w"))
            os.rename({str(info)!r} + ".tmp", {str(info)!r})
        total = 0.0
        for i in range(400):
            total += float(hvd.allreduce(np.full(1000, hvd.rank() + i, np.float64),
                                         op=hvd.Sum, name=f"t{{i % 5}}")[0])
            if os.path.exists({str(flag)!r}) and i > 50:
                break
            time.sleep(0.005)
        want = sum(sum(r + k for r in range(hvd.size())) for k in range(i + 1))
        print("exact", total == want, "rejected", getattr(t, "rejected", None), flush=True)
    """
    env = dict(os.environ, PYTHONPATH=str(REPO))
    path = os.path.join(tmp_path, "job.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(script))
    p = subprocess.Popen(
        [sys.executable, "-m", "horovod.runner.launch", "-np", "2", sys.executable, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    import http.client
    import socket

    deadline = time.time() + 30
    while not info.exists():
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.02)
    ports = json.loads(info.read_text())
    for payload in (b"\x00" * 64, b"PYHVD\x01\x00\x00garbage", b"GET /x HTTP/1.1\r\n\r\n"):
        for port in (ports["rdv"], ports["tcp"]):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(payload)
    c = http.client.HTTPConnection("127.0.0.1", ports["rdv"], timeout=5)
    c.request("PUT", "/init0/tcp.1", body=b"127.0.0.1:1")  # no proof of the secret
    assert c.getresponse().status == 403
    c.close()
    flag.write_text("done")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "[0]<stdout>:exact True rejected" in out and "[1]<stdout>:exact True" in out
    rejected = int(out.split("[0]<stdout>:exact True rejected ")[1].split()[0])
    assert rejected >= 3


def test_main_example_trains_to_high_accuracy():
    """The README's NumPy example (examples/numpy_digits.py under horovodrun -np 2)."""
    r = horovodrun_example(2, "numpy_digits.py", "--epochs", "8", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0]<stdout>:training on 2 rank(s)" in r.stdout
    assert "replicas identical: True" in r.stdout


def test_collectives_benchmark_runs():
    r = run_module(
        "horovod.benchmarks.collectives",
        *("--peers", "ours", "--max-bytes", "1K", "--budget", "0.05", "--repeats", "2"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "measuring ours (pass 1 of 2)" in r.stdout
    assert "measuring ours (pass 2 of 2)" in r.stdout
    assert "best of 2 interleaved pass(es)" in r.stdout
    for op in ("allreduce", "allgather", "broadcast"):
        assert f"\n{op} (2 ranks" in r.stdout
    assert "| 4 B |" in r.stdout and "| 1 KiB |" in r.stdout


def test_rounds_benchmark_times_both_ways_of_a_cached_op_as_asked():
    """``horovod.benchmarks.rounds`` switches every cached op between a data round and a
    plane round in one job; each row says how many calls went the way their block asked
    (counted from the engine's data rounds), so a switch that stopped working shows."""
    r = run_module(
        "horovod.benchmarks.rounds", *("--sizes", "64K,2M,4M", "--blocks", "2", "--calls", "5")
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 ranks, shm (board room 2 MiB" in r.stdout, r.stdout
    rows = [
        line.strip("|").split("|") for line in r.stdout.splitlines() if line.startswith("| all")
    ]
    rows += [line.strip("|").split("|") for line in r.stdout.splitlines() if "| broadcast" in line]
    got = {(c[0].strip(), c[1].strip()): c for c in rows}
    # 4 MiB: only the allgather's posts (2 MiB a rank) fit the board
    sizes = ("64 KiB", "2 MiB")
    assert set(got) == {
        (op, s) for op in ("allreduce", "allgather", "broadcast") for s in sizes
    } | {("allgather", "4 MiB")}, r.stdout
    assert "skipped (a post beyond the board's room): allreduce 4 MiB, broadcast 4 MiB" in r.stdout
    from test_shm_e2e import _can_read_a_child_process

    for key, cells in got.items():
        assert cells[2].strip().endswith(" us") and cells[3].strip().endswith(" us"), cells
        float(cells[4].split()[0])  # the paired ratio
        # what the engine takes: a data round, but a plane round for the two-rank broadcast
        # that shared memory splits by single copy (from 2 MiB, where it can)
        split = key == ("broadcast", "2 MiB") and _can_read_a_child_process()
        assert cells[5].strip() == ("plane" if split else "data"), cells
        assert int(cells[6].strip().rstrip("%")) >= 90, cells
    r = run_module("horovod.benchmarks.rounds", "--calls", "0")
    assert r.returncode == 2 and "--blocks and --calls must be at least 1" in r.stderr


def _baseline_with(tmp_path, old: str, new: str):
    """A copy of this checkout's horovod package (a baseline for ``--baseline``) whose
    collectives benchmark has ``old`` replaced by ``new`` once."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(
        REPO / "horovod", base / "horovod", ignore=shutil.ignore_patterns("__pycache__")
    )
    bench = base / "horovod" / "benchmarks" / "collectives.py"
    src = bench.read_text()
    changed = src.replace(old, new, 1)
    assert changed != src
    bench.write_text(changed)
    return base


def test_collectives_benchmark_measures_a_baseline_checkout_in_the_same_run(tmp_path):
    """``--baseline DIR`` runs DIR's horovod as the peer ``base``: here a copy whose benchmark
    worker reports every figure as one second, so its latency column and the ratio prove that
    the baseline's code ran and not this checkout's."""
    base = _baseline_with(tmp_path, "_measure(runs[op], nbytes, budget, hvd.barrier)", "1.0")
    r = run_module(
        "horovod.benchmarks.collectives",
        *("--peers", "ours", "--max-bytes", "4", "--budget", "0.02", "--repeats", "1"),
        *("--baseline", str(base)),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "measuring base (pass 1 of 1)" in r.stdout
    assert "| size | ours latency | base latency |" in r.stdout and "ours/base |" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 4 B |")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "1000.0 ms" and cells[1] != "1000.0 ms", row
        assert float(cells[-1].rstrip("x")) > 100, row  # one second against microseconds
    r = run_module("horovod.benchmarks.collectives", "--baseline", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "no horovod package there" in r.stdout + r.stderr


def test_collectives_benchmark_measures_cold_at_sizes_given(tmp_path):
    """``--cold`` evicts the caches before every timed call, in every peer's worker (each
    says so in its result, checked by the driver); ``--sizes`` picks the sizes. A baseline
    checkout whose worker does not measure cold (one from before ``--cold``) stops the run
    with what to do instead of measuring it warm beside cold figures."""
    r = run_module(
        "horovod.benchmarks.collectives",
        *("--peers", "ours", "--sizes", "3K,1.5K", "--cold", "--budget", "0.02"),
        *("--repeats", "1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cold: caches evicted before every timed call" in r.stdout
    for size in ("1.5 KiB", "3 KiB"):
        assert r.stdout.count(f"| {size} |") == 3, r.stdout
    base = _baseline_with(tmp_path, "data[COLD_KEY] = _cold()", "pass")
    r = run_module(
        "horovod.benchmarks.collectives",
        *("--peers", "ours", "--sizes", "4", "--cold", "--budget", "0.02", "--repeats", "1"),
        *("--baseline", str(base)),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "base's worker did not measure cold as asked" in r.stdout
    r = run_module("horovod.benchmarks.collectives", "--sizes", "4,lots")
    assert r.returncode == 2 and "--sizes takes sizes such as 4,64K,2.4M" in r.stderr


def test_collectives_benchmark_ratio_columns():
    from horovod.benchmarks.collectives import ratio_columns

    assert ratio_columns(["ours", "ours-tcp", "mpi"]) == [("ours", "ours-tcp"), ("ours", "mpi")]
    assert ratio_columns(["ours", "ours-tcp", "mpi", "base", "base-tcp"]) == [
        ("ours", "ours-tcp"),
        ("ours", "mpi"),
        ("base", "mpi"),
        ("ours", "base"),
        ("ours-tcp", "base-tcp"),
    ]
    assert ratio_columns(["gloo", "mpi"]) == []
    assert ratio_columns(["ours", "ours-mpi", "mpi"]) == [
        ("ours", "ours-mpi"),
        ("ours", "mpi"),
        ("ours-mpi", "mpi"),
    ]


def test_collectives_benchmark_keeps_each_figures_fastest_pass():
    from horovod.benchmarks.collectives import best_of

    passes = [
        {"allreduce:4": 3e-5, "allgather:4": 9e-5},
        {"allreduce:4": 5e-5, "allgather:4": 4e-5},
    ]
    assert best_of(passes) == {"allreduce:4": 3e-5, "allgather:4": 4e-5}
    r = run_module("horovod.benchmarks.collectives", "--peers", "ours", "--repeats", "0")
    assert r.returncode == 2 and "--repeats must be at least 1, got 0" in r.stderr


def test_verbose_describes_the_job():
    r = run_script("print('hi')\n", 2, launcher_args=["--verbose"])
    assert r.returncode == 0
    assert "horovodrun: 2 processes on localhost:2; rendezvous on 127.0.0.1:" in r.stderr


def test_stress_every_collective_over_tcp_with_four_processes():
    """Random sizes on both sides of the small/ring switch, every collective, checked against
    formulas on every rank."""
    r = run_script(
        """
        import sys, numpy as np, horovod.numpy as hvd
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        rng = np.random.default_rng(123)  # the same sizes on every rank
        bad = 0
        for it in range(40):
            k = int(rng.integers(0, 300_000))
            s = hvd.allreduce(np.full(k, r + 1, np.float32), op=hvd.Sum, name=f"s{it % 7}")
            bad += not np.all(s == n * (n + 1) / 2)
            g = hvd.allgather(np.full((r + (k % 3), 2), r, np.int64))
            want = np.concatenate([np.full((q + (k % 3), 2), q) for q in range(n)])
            bad += not np.array_equal(g, want)
            b = hvd.broadcast(np.full(k % 1000 + 1, r, np.int32), root_rank=it % n)
            bad += not np.all(b == it % n)
            rows = k % 50 + 1
            rs = hvd.reducescatter(np.ones((rows, 3)), op=hvd.Sum)
            mine = rows // n + (1 if r < rows % n else 0)
            bad += rs.shape != (mine, 3) or not np.all(rs == n)
            out, got = hvd.alltoall(np.full(n * 2, r), splits=[2] * n)
            bad += not np.array_equal(out, np.repeat(np.arange(n), 2))
        print("bad", bad)
        sys.exit(1 if bad else 0)
    """,
        4,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("bad 0") == 4
