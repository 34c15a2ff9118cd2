"""horovodrun across hosts, for real: test hosts are network namespaces joined by a bridge, each
running its own sshd (`horovod/testing/netns.py`); the launcher runs on hostA and starts hostB's
workers over ssh. Collectives and placement, hierarchical vs flat, a training example, a
worker killed on the remote host, a host dropping off the network, Ctrl-C, and an unreachable
host. Every test checks that nothing of the job is left running on any host.

Skips cleanly where namespaces or sshd are unavailable (not root, no iproute2/openssh-server).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from horovod.testing.netns import TestNetwork, processes_with, unavailable
from tests import mpi_impls
from tests.conftest import REPO, WAYS

_WHY_NOT = unavailable() if sys.platform == "linux" else "Linux only"
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host tests need network namespaces and sshd: {_WHY_NOT}"
)


@pytest.fixture(scope="module")
def net():
    n = TestNetwork(["hostA", "hostB", "hostC"], without_sshd=("hostC",))
    yield n
    n.close()


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


def _horovodrun(
    net, args, script, workdir, *, env=None, timeout=120, popen=False, python=sys.executable
):
    path = workdir / "script.py"
    path.write_text(textwrap.dedent(script))
    marker = f"HVD_MULTIHOST_TEST={uuid.uuid4().hex}"
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["HVD_MULTIHOST_TEST"] = marker.split("=", 1)[1]
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("HOROVOD_SSH_KEEPALIVE_SECONDS", "1")
    argv = net.command(
        "hostA",
        [
            sys.executable,
            "-m",
            "horovod.runner.launch",
            *net.launcher_args(),
            *args,
            python,
            str(path),
        ],
    )
    kw = dict(cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if popen:
        return subprocess.Popen(argv, **kw), marker
    r = subprocess.run(argv, timeout=timeout, **kw)
    return r, marker


def _nothing_left(marker, within=15.0):
    deadline = time.monotonic() + within
    while True:
        left = processes_with(marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:  # do not leak into later tests, but fail this one
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"processes left running: {left}"


COLLECTIVES = """
    import json, os, socket
    import numpy as np
    import horovod.numpy as hvd
    from horovod.core.context import current
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    res = {
        "rank": r, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
        # (horovodrun's own launcher names the host; under mpirun, the host's own name)
        "host": os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), "cwd": os.getcwd(),
        "carried": os.environ.get("CARRIED_VAR"),
        "transport": type(current().engine.transport).__name__,
        # (horovodrun --mpi --tcp: what Open MPI, and Hydra's MPIs' network modules, were told)
        "tcp": [os.environ.get(k) for k in ("OMPI_MCA_btl", "UCX_TLS", "FI_PROVIDER")],
    }
    for elems in (1, 1000, 300_001, 1_000_003):  # (the last two: pipelined hierarchically)
        x = (np.arange(elems) % 97 + r).astype(np.float32)
        res[f"sum{elems}"] = float(hvd.allreduce(x, op=hvd.Sum, name=f"s{elems}").sum(dtype=np.float64))
        res[f"avg{elems}"] = float(hvd.allreduce(x, name=f"a{elems}")[:50].sum())
        g = hvd.allgather(np.full((r + 1, elems % 7 + 1), r, np.int32), name=f"g{elems}")
        res[f"gather{elems}"] = [int(g.sum()), list(g.shape)]
    b = hvd.broadcast(np.arange(4) * (r + 1), root_rank=n - 1, name="b")
    res["bcast"] = b.tolist()
    sp = hvd.alltoall(np.arange(n) + 10 * r, name="a2a")
    res["alltoall"] = sp.tolist()
    print("RESULT " + json.dumps(res))
    hvd.shutdown()
"""


def _results(stdout):
    out = {}
    for line in stdout.splitlines():
        if "RESULT " in line:
            d = json.loads(line.split("RESULT ", 1)[1])
            out[d["rank"]] = d
    return out


def test_collectives_and_placement_across_hosts_flat_and_hierarchical(net, workdir):
    runs = {}
    for mode in ("flat", "hierarchical"):
        flags = ["--hierarchical-allreduce", "--hierarchical-allgather"] if mode != "flat" else []
        r, marker = _horovodrun(
            net,
            ["-np", "4", "-H", "hostA:2,hostB:2", *flags],
            COLLECTIVES,
            workdir,
            env={"CARRIED_VAR": "from the launcher"},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = _results(r.stdout)
        _nothing_left(marker)
    _check_collectives(runs, workdir)


def _check_collectives(runs: dict, workdir) -> None:
    """``COLLECTIVES`` on 4 ranks of hostA:2,hostB:2, flat and hierarchical: placement, the
    launcher's directory and environment, and every result (the same both ways)."""
    flat = runs["flat"]
    assert sorted(flat) == [0, 1, 2, 3]
    place = [
        (d["host"], d["local_rank"], d["cross_rank"], d["cross_size"])
        for _, d in sorted(flat.items())
    ]
    assert place == [("hostA", 0, 0, 2), ("hostA", 1, 0, 2), ("hostB", 0, 1, 2), ("hostB", 1, 1, 2)]
    for d in flat.values():
        assert d["cwd"] == str(workdir) and d["carried"] == "from the launcher"
        assert d["bcast"] == [0, 4, 8, 12]
    assert flat[2]["alltoall"] == [2, 12, 22, 32]
    for r_ in range(4):
        for k, v in flat[r_].items():
            if k.startswith(("sum", "avg", "gather")):
                assert runs["hierarchical"][r_][k] == v, (r_, k)
    assert flat[0]["sum300001"] == float(sum((i % 97) * 4 + 6 for i in range(300_001)))


@pytest.mark.parametrize("impl", mpi_impls.IMPLS)
def test_horovodrun_mpi_across_hosts_flat_and_hierarchical(workdir, impl):
    """``horovodrun --mpi`` on two hosts: mpirun starts hostB's ranks over the test network's
    ssh (``-p``/``-i``), MPI's TCP stays on the hosts' link (``--network-interfaces``), the
    ranks start up over MPI (rank 0's rendezvous on its routable address) and every byte moves
    through MPI, flat and hierarchical, with the same results as horovodrun's own launcher.
    Under MPICH and Intel MPI (Hydra) too: the hosts in a machine file, the ssh options in
    mpirun's environment."""
    path = mpi_impls.path(impl, os.environ.get("PATH", ""))  # (its mpirun first)
    named = TestNetwork(["hostA", "hostB"], hostnames=True)  # (Open MPI tells hosts by name)
    try:
        runs = {}
        for mode in ("flat", "hierarchical"):
            # (flat: MPI over TCP only, --tcp; hierarchical: the MPI's own choice)
            flags = ["--hierarchical-allreduce", "--hierarchical-allgather"]
            if mode == "flat":
                flags = ["--tcp"]
            r, marker = _horovodrun(
                named,
                ["--mpi", "-np", "4", "-H", "hostA:2,hostB:2", "--network-interfaces", "eth0"]
                + flags,
                COLLECTIVES,
                workdir,
                env={"CARRIED_VAR": "from the launcher", "PATH": path},
                timeout=180,
                python=mpi_impls.python(impl),
            )
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
            runs[mode] = _results(r.stdout)
            _nothing_left(marker)
    finally:
        named.close()
    _check_collectives(runs, workdir)
    told = [None, "tcp,self,sm", "tcp"] if mpi_impls.hydra(impl) else ["self,vader,tcp", None, None]
    for d in runs["flat"].values():
        assert d["transport"] == "MpiPolledTransport"  # (several hosts: data through MPI)
        assert d["tcp"] == told, d["tcp"]


def test_training_example_across_hosts(net, workdir):
    example = (REPO / "examples" / "numpy_digits.py").read_text()
    r, marker = _horovodrun(
        net,
        ["-np", "4", "-H", "hostA:2,hostB:2", "--hierarchical-allreduce"],
        example,
        workdir,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[3]<stdout>" in r.stdout or "[0]<stdout>" in r.stdout
    _nothing_left(marker)


KILLED = """
    import os, signal, threading, time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    hvd.allreduce(np.ones(3), name="warm")
    print("rank", hvd.rank(), "ready", flush=True)

    def die():
        print("rank 3 about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if hvd.rank() == 3:  # (while the ranks are in their allreduces: in the middle of one)
        threading.Timer(0.3, die).start()
    while True:
        hvd.allreduce(np.ones(ELEMS), name="loop")
        time.sleep(0.01)
"""


@pytest.mark.parametrize(
    "flags, elems",
    [([], 3), (["--hierarchical-allreduce"], 1 << 20)],  # (8 MB: 8 pieces in the pipeline)
    ids=["flat", "hierarchical-pipelined"],
)
def test_a_worker_killed_on_the_remote_host_stops_the_job_with_a_root_cause(
    net, workdir, flags, elems
):
    script = KILLED.replace("ELEMS", str(elems))
    r, marker = _horovodrun(net, ["-np", "4", "-H", "hostA:2,hostB:2", *flags], script, workdir)
    assert r.returncode != 0
    tail = r.stderr.strip().splitlines()
    report = "\n".join(tail[-12:])
    assert "Root cause: rank 3 on host hostB" in report, r.stderr[-3000:]
    assert "SIGKILL" in report
    assert "rank 3 about to die" in report  # its last words, brought back over ssh
    for other in (0, 1, 2):
        assert f"rank {other} (host" in r.stderr
    _nothing_left(marker)


LOOP = """
    import time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    i = 0
    while True:
        hvd.allreduce(np.ones(1000), name="loop")
        if i == 0:
            print("rank", hvd.rank(), "running", flush=True)
        i += 1
        time.sleep(0.005)
"""


def _wait_for(proc, text, timeout=60):
    """Read proc's stdout until ``text`` has appeared on every rank we expect; returns lines."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if sum(text in x for x in seen) >= 4:
            return seen
    raise AssertionError(f"workers did not start: {seen}")


def test_a_host_that_drops_off_the_network_ends_the_job(net, workdir):
    proc, marker = _horovodrun(
        net, ["-np", "4", "-H", "hostA:2,hostB:2"], LOOP, workdir, popen=True
    )
    try:
        _wait_for(proc, "running")
        net.link("hostB", up=False)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        net.link("hostB", up=True)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert took < 30, took
    assert "on host hostB" in err and "ssh" in err, err[-3000:]
    _nothing_left(marker, within=20)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_every_worker_on_every_host(net, workdir, sig, code):
    proc, marker = _horovodrun(
        net, ["-np", "4", "-H", "hostA:2,hostB:2"], LOOP, workdir, popen=True
    )
    try:
        _wait_for(proc, "running")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code
    assert f"received {sig.name}; stopped all 4 workers" in err
    _nothing_left(marker)


def test_a_host_without_ssh_is_refused_before_anything_starts(net, workdir):
    r, marker = _horovodrun(
        net, ["-np", "2", "-H", "hostA:1,hostC:1"], COLLECTIVES, workdir, timeout=60
    )
    assert r.returncode == 2
    assert "cannot start workers over ssh on hostC" in r.stderr
    assert "refused" in r.stderr.lower()
    _nothing_left(marker)


def test_hostfile_output_files_and_timestamps_for_remote_ranks(net, workdir):
    out = workdir / "logs"
    hostfile = workdir / "hosts.txt"
    hostfile.write_text("# two test hosts\nhostA slots=1\nhostB slots=2\n")
    r, marker = _horovodrun(
        net,
        [
            "-np",
            "3",
            "-hostfile",
            str(hostfile),
            "--output-filename",
            str(out),
            "--prefix-output-with-timestamp",
        ],
        COLLECTIVES,
        workdir,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(3):
        text = (out / f"rank.{rank}" / "stdout").read_text()
        assert f'"rank": {rank}' in text
    assert all(line[:3].isalpha() for line in r.stdout.splitlines() if line)  # "Sun Nov ..."
    _nothing_left(marker)
    shutil.rmtree(out)


RUN_FUNC = """
    import os, sys
    import horovod

    def work(scale):
        import numpy as np
        import horovod.numpy as hvd
        hvd.init()
        total = hvd.allreduce(np.array([hvd.rank() * scale]), op=hvd.Sum, name="t")
        return hvd.rank(), os.environ["HOROVOD_HOSTNAME"], int(total[0])

    port, key = sys.argv[1], sys.argv[2]
    print("VALUES", horovod.run(work, args=(10,), num_proc=3, hosts="hostA:1,hostB:2",
                                ssh_port=int(port), ssh_identity_file=key))
"""


def test_horovod_run_returns_values_from_ranks_on_every_host(net, workdir):
    path = workdir / "driver.py"
    path.write_text(textwrap.dedent(RUN_FUNC))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = net.exec(
        "hostA",
        [sys.executable, str(path), net.launcher_args()[1], net.launcher_args()[3]],
        cwd=workdir,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "VALUES [(0, 'hostA', 30), (1, 'hostB', 30), (2, 'hostB', 30)]" in r.stdout


def test_network_interfaces_named_explicitly(net, workdir):
    r, marker = _horovodrun(
        net,
        ["-np", "2", "-H", "hostA:1,hostB:1", "--network-interfaces", "nosuch9,eth0"],
        COLLECTIVES,
        workdir,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_results(r.stdout)) == 2
    _nothing_left(marker)
    r, marker = _horovodrun(
        net,
        ["-np", "2", "-H", "hostA:1,hostB:1", "--network-interfaces", "nosuch9"],
        COLLECTIVES,
        workdir,
    )
    assert r.returncode == 2 and "nosuch9" in r.stderr and "eth0" in r.stderr
    _nothing_left(marker)


TWO_HOST_ROOM = textwrap.dedent(WAYS) + textwrap.dedent(
    """
    import json, numpy as np, horovod.numpy as hvd
    from horovod.core.context import current
    hvd.init()
    r = hvd.rank()
    eng = current().engine
    got = {}
    for kib in (512, 1024):
        x = np.full(kib << 8, r + 1.0, np.float32)
        data, plane, out = ways(lambda: hvd.broadcast(x, 1, name=f"b{kib}"))
        assert (out == 2).all()
        got[kib] = [data, plane]
    print("ROOM", r, type(eng.board).__name__, eng.board_data,
          json.dumps(got, separators=(",", ":")), flush=True)
    hvd.shutdown()
    """
)


def test_two_ranks_on_two_hosts_post_up_to_512_kib_in_a_data_round(net, workdir):
    """Two ranks over TCP between two hosts: a post's room is 512 KiB there (2 MiB where both
    are on one machine): a 512 KiB broadcast takes data rounds, a 1 MiB one plane rounds."""
    r, marker = _horovodrun(net, ["-np", "2", "-H", "hostA:1,hostB:1"], TWO_HOST_ROOM, workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split()[1:] for line in r.stdout.splitlines() if "ROOM" in line]
    assert len(rows) == 2, r.stdout
    for row in rows:
        rank, board, room, ways = row[-4], row[-3], row[-2], row[-1]
        assert board == "TcpBoard" and int(room) == 512 << 10, row
        assert json.loads(ways) == {"512": [4, 0], "1024": [0, 4]}, (rank, ways)
    _nothing_left(marker)


ELASTIC = """
    import sys
    sys.argv[1:] = {args!r}
    from horovod.testing.elastic_train import main
    main()
"""


def test_elastic_job_grows_onto_a_remote_host_and_survives_losing_a_worker_there(net, workdir):
    """Elastic across hosts with real sshd: the job starts on hostA, hostB is discovered and
    its new workers receive the state over the network, then one of them is SIGKILLed: the
    others finish with identical weights."""
    import numpy as np

    hosts = workdir / "hosts"
    hosts.write_text("hostA:2\n")
    disc = workdir / "discover.sh"
    disc.write_text(f"#!/bin/sh\ncat {hosts}\n")
    disc.chmod(0o755)
    log, out = workdir / "log", workdir / "out"
    args = ["--epochs=3", "--batches=30", "--step-seconds=0.03", f"--log={log}", f"--out={out}"]
    fault = {"id": "b", "epoch": 2, "batch": 3, "rank": 3, "how": "sigkill"}
    proc, marker = _horovodrun(
        net,
        ["-np", "2", "--min-np", "1", "--host-discovery-script", str(disc), "--verbose"],
        ELASTIC.format(args=args),
        workdir,
        env={
            "HVD_TEST_FAULTS": json.dumps([fault]),
            "HVD_TEST_FAULT_DIR": str(workdir),
            "HOROVOD_ELASTIC_DISCOVERY_SECONDS": "0.2",
            "HOROVOD_ELASTIC_POLL_SECONDS": "0.1",
        },
        popen=True,
    )
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    hosts.write_text("hostA:2\nhostB:2\n")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "round 1: 4 workers on hostA:2, hostB:2" in stderr, stderr[-5000:]
    assert "rank 3 (hostB:1) was killed by signal SIGKILL" in stderr
    sizes = [int(line.split()[3]) for line in log.read_text().splitlines()]
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 3
    finals = [np.load(f) for f in sorted(out.glob("rank.*.npy"))]
    assert len(finals) == 3
    assert all(np.array_equal(w, finals[0]) for w in finals)
    _nothing_left(marker)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun installed")
def test_named_test_hosts_are_separate_hosts_to_open_mpi():
    """``TestNetwork(hostnames=True)``: each test host has its own host name, in commands run
    on it and in sessions ssh opens there, so Open MPI (which tells hosts apart by name) places
    and treats ranks as on two hosts, as the multi-host benchmark's Open MPI rows need."""
    pytest.importorskip("mpi4py")
    from horovod.benchmarks.multihost import mpi_command

    n = TestNetwork(["hostA", "hostB"], hostnames=True)
    try:
        assert n.exec("hostB", ["hostname"]).stdout.strip() == "hostB"
        over_ssh = n.exec("hostA", ["ssh", *n.ssh_args(), "hostB", "hostname"])
        assert over_ssh.stdout.strip() == "hostB", over_ssh.stderr
        probe = (
            "from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "local = c.Split_type(MPI.COMM_TYPE_SHARED).size; "
            "print('at', c.rank, MPI.Get_processor_name(), local, flush=True)"
        )
        argv = mpi_command(n, shutil.which("mpirun"), []) + [sys.executable, "-c", probe]
        r = n.exec("hostA", argv, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        placed = sorted(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("at"))
        assert placed == [
            ["0", "hostA", "2"],
            ["1", "hostA", "2"],
            ["2", "hostB", "2"],
            ["3", "hostB", "2"],
        ], r.stdout
    finally:
        n.close()
