"""MPI: jobs under a real ``mpirun`` (Open MPI from PyPI: ``pip install 'pyhorovod[mpi]'``; and
MPICH and Intel MPI, from PyPI too, each in a venv of its own: ``tests/mpi_impls.py``), the MPI
data plane, ``hvd.init(comm=...)``, process sets from communicators, hierarchical operations on
MPI, ``horovodrun --mpi`` and its errors. The jobs are ``tests/mpi_worker.py`` scenarios, which
check their results against formulas; each test here is one mpirun, under each MPI present."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from horovod.runner import mpi_output, mpi_run
from horovod.runner.hosts import HostInfo
from tests import mpi_impls
from tests.mpi_impls import IMPLS  # (the jobs below run under every MPI present)

HERE = Path(__file__).parent
ROOT = HERE.parent
needs_mpi = mpi_impls.needs("openmpi")  # (tests of Open MPI alone)
AS_ROOT = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []


@pytest.fixture(scope="module", autouse=True)
def _no_segments_left_behind():
    """Jobs these tests abort (a dying rank, the watchdog's MPI_Abort) leave the MPI's
    shared-memory segments in /dev/shm (Open MPI's, MPICH's) and Hydra's topology files in the
    temporary directory: remove the ones this module's jobs made."""
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    patterns = [(shm, "sm_segment.*"), (shm, "mpich_shm_*"), (tmp, "hydra_hwloc_xmlfile_*")]

    def segments() -> set[Path]:
        return {p for d, pattern in patterns if d.is_dir() for p in d.glob(pattern)}

    before = segments()
    yield
    for path in segments() - before:
        path.unlink(missing_ok=True)


def _env(impl: str = "openmpi", **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HOROVOD_", "OMPI_", "PMIX", "PMI_", "HYDRA_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PATH"] = mpi_impls.path(impl, env.get("PATH", ""))
    env.update(extra)
    return env


_python = mpi_impls.python


def mpirun(scenario: str, np_: int, *args: str, timeout: float = 120, impl: str = "openmpi", **env):
    """Run ``tests/mpi_worker.py scenario`` under ``impl``'s mpirun; the variables in ``env``
    are set on every rank (Hydra passes the whole environment; Open MPI is told which)."""
    argv = _mpirun_argv(impl, np_, env) + [_python(impl), str(HERE / "mpi_worker.py")]
    argv += [scenario, *args]
    return subprocess.run(
        argv, env=_env(impl, **env), capture_output=True, text=True, timeout=timeout, check=False
    )


def _mpirun_argv(impl: str, np_: int, env: dict | tuple = ()) -> list[str]:
    """``impl``'s mpirun for ``np_`` ranks on this host, with ``env``'s variables (and
    PYTHONPATH) on every rank: Hydra passes the whole environment; Open MPI is told which."""
    if mpi_impls.hydra(impl):
        return [str(mpi_impls.mpirun(impl)), "-n", str(np_)]
    exports = [a for k in ["PYTHONPATH", *env] for a in ("-x", k)]
    return [str(mpi_impls.mpirun(impl)), *AS_ROOT, "--oversubscribe", "-np", str(np_), *exports]


def _run(argv: list[str], impl: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, env=_env(impl), capture_output=True, text=True, timeout=timeout, check=False
    )


def horovodrun_mpi(impl: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``horovodrun --mpi ARGS`` with ``impl``'s mpirun first on PATH."""
    return _run([sys.executable, "-m", "horovod.runner.launch", "--mpi", *args], impl, timeout)


def _ok(r: subprocess.CompletedProcess, n: int) -> None:
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # (Hydra forwards the ranks' output unbuffered: two ranks' lines may share one)
    assert sorted(re.findall(r"OK (\d+)", r.stdout), key=int) == [str(k) for k in range(n)], (
        r.stdout
    )


# ---------------------------------------------------------------------------- jobs
@pytest.mark.parametrize("impl", IMPLS)
def test_every_collective_runs_on_the_mpi_plane_and_the_timeline_names_it(tmp_path, impl):
    timeline = tmp_path / "timeline.json"
    r = mpirun(
        "collectives", 3, impl=impl, HOROVOD_CPU_OPERATIONS="mpi", HOROVOD_TIMELINE=str(timeline)
    )
    _ok(r, 3)
    events = json.loads(timeline.read_text())  # closed at shutdown: complete JSON
    names = {e.get("name") for e in events}
    assert {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BCAST", "MPI_ALLTOALL"} <= names, names
    # Adasum: the project's tree over shared memory (MPI has no such reduction)
    assert "SHM_ADASUM" in names and "MPI_ADASUM" not in names, names


@pytest.mark.parametrize("impl", IMPLS)
def test_two_ranks_on_the_mpi_plane_take_data_rounds_with_mpis_bits(impl):
    _ok(mpirun("pair", 2, impl=impl, HOROVOD_CPU_OPERATIONS="mpi"), 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_on_one_host_large_operations_run_on_shared_memory_the_rest_on_mpi(impl):
    _ok(mpirun("one_host", 2, impl=impl, HOROVOD_CPU_OPERATIONS="mpi"), 2)


@needs_mpi
@pytest.mark.parametrize(
    "n, env", [(3, {}), (2, {"HOROVOD_SHARED_MEMORY": "0"})], ids=["3-ranks", "all-through-mpi"]
)
def test_which_operations_shared_memory_takes_from_mpi(tmp_path, n, env):
    """Three ranks: broadcasts stay MPI's; without shared memory every operation is MPI's.
    The timeline names the plane that ran each."""
    timeline = tmp_path / "timeline.json"
    _ok(
        mpirun("one_host", n, HOROVOD_CPU_OPERATIONS="mpi", HOROVOD_TIMELINE=str(timeline), **env),
        n,
    )
    names = {e.get("name") for e in json.loads(timeline.read_text())}
    ran = {x for x in names if x and x.split("_", 1)[0] in ("MPI", "SHM")}
    mpi = {"MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BCAST", "MPI_REDUCESCATTER", "MPI_ALLTOALL"}
    own = {"SHM_ALLREDUCE", "SHM_REDUCESCATTER"}
    assert ran == (mpi | own if not env else mpi), ran


@pytest.mark.parametrize("impl", IMPLS)
def test_plain_mpirun_starts_the_job_over_mpi_with_no_variables_set(impl):
    _ok(mpirun("plain", 2, impl=impl), 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_init_on_user_communicators_beside_the_users_own_mpi_traffic(impl):
    _ok(mpirun("communicators", 4, impl=impl), 4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["blocks", "interleaved"])
def test_hierarchical_allreduce_and_allgather_on_mpi(layout, impl):
    r = mpirun(
        "hierarchical",
        4,
        layout,
        impl=impl,
        HOROVOD_CPU_OPERATIONS="mpi",
        HOROVOD_HIERARCHICAL_ALLREDUCE="1",
        HOROVOD_HIERARCHICAL_ALLGATHER="1",
        HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",  # the two hosts are names on this one
    )
    _ok(r, 4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [2, 3])
def test_the_mpi_plane_keeps_the_transport_contract(n, impl):
    _ok(mpirun("conformance", n, impl=impl), n)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_rank_that_dies_ends_the_job_instead_of_hanging(impl):
    t0 = time.monotonic()
    r = mpirun("lost", 2, impl=impl, HOROVOD_CPU_OPERATIONS="mpi", timeout=90)
    assert r.returncode != 0 and "survived" not in r.stdout
    assert time.monotonic() - t0 < 60


@needs_mpi
def test_a_rank_that_dies_ends_a_job_whose_control_is_tcp():
    """Every byte through MPI, control and peer rounds over TCP (the transport of jobs across
    hosts): the survivor sees its peer's connections close and the job ends."""
    t0 = time.monotonic()
    r = mpirun("lost", 2, HOROVOD_CPU_OPERATIONS="mpi", HOROVOD_SHARED_MEMORY="0", timeout=90)
    assert r.returncode != 0 and "survived" not in r.stdout
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("impl", IMPLS)
def test_a_stuck_mpi_call_is_reported_and_ends_the_job_at_the_stall_shutdown(impl):
    t0 = time.monotonic()
    r = mpirun("watchdog", 2, impl=impl, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode != 0 and "did not end the job" not in r.stdout
    assert "MPI_BARRIER (test) has been in MPI" in r.stderr, r.stderr[-2000:]
    assert "rank 0: MPI_BARRIER (test) has not returned after" in r.stderr
    assert "ending the MPI job with MPI_Abort" in r.stderr and took < 30


@needs_mpi
def test_asking_for_mpi_without_mpirun_says_how_to_start_the_job():
    env = _env(HOROVOD_RANK="0", HOROVOD_SIZE="2", HOROVOD_CPU_OPERATIONS="mpi")
    r = subprocess.run(
        [sys.executable, str(HERE / "mpi_worker.py"), "plain"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0
    assert "not started by mpirun" in r.stderr and "horovodrun --mpi" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- horovodrun --mpi
@pytest.mark.parametrize("impl", IMPLS)
def test_horovodrun_mpi_runs_an_upstream_style_script_through_mpirun(tmp_path, impl):
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, horovod.numpy as hvd\n"
        "from horovod.core.context import current\n"
        "hvd.init()\n"
        "t = type(current().engine.transport.native).__name__\n"
        "s = hvd.allreduce(np.ones(4) * (hvd.rank() + 1), op=hvd.Sum)\n"
        "print('rank', hvd.rank(), 'of', hvd.size(), t, s.tolist(), flush=True)\n"
    )
    mpi_args = ["--mpi-args=--mca btl self,vader,tcp"] if impl == "openmpi" else []
    r = horovodrun_mpi(impl, "-np", "2", *mpi_args, _python(impl), str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    for k in range(2):  # Open MPI's --tag-output prefix (upstream's familiar one); under
        # Hydra horovodrun's own (each rank's lines put back together: HydraOutput)
        prefix = f"[1,{k}]<stdout>: " if impl == "openmpi" else f"[{k}]<stdout>:"
        assert f"{prefix}rank {k} of 2 MpiCollectives [3.0, 3.0, 3.0, 3.0]\n" in r.stdout


@pytest.mark.parametrize("impl", IMPLS)
def test_horovodrun_mpi_writes_output_files_and_timestamps_like_its_own_launcher(tmp_path, impl):
    script = tmp_path / "talk.py"
    script.write_text(
        "import sys, horovod.numpy as hvd\nhvd.init()\n"
        "print('out of', hvd.rank(), 'in', 'words', flush=True)\n"
        "print('err of', hvd.rank(), file=sys.stderr)\n"
    )
    logs = tmp_path / "logs"
    flags = ["--output-filename", str(logs), "--prefix-output-with-timestamp"]
    r = horovodrun_mpi(impl, "-np", "2", *flags, _python(impl), str(script))
    # (on failure, each rank's own error from its file: the console's tail may hold one only)
    files = sorted(logs.glob("rank.*/stderr"))
    assert r.returncode == 0, "\n".join(
        [(r.stdout + r.stderr)[-3000:]] + [f"{f}:\n{f.read_text()[-2000:]}" for f in files]
    )
    when = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"  # time.asctime()
    for k in range(2):  # (the console keeps each MPI's prefixes, after the time)
        assert (logs / f"rank.{k}" / "stdout").read_text() == f"out of {k} in words\n"
        assert (logs / f"rank.{k}" / "stderr").read_text() == f"err of {k}\n"
        assert re.search(rf"^{when}\[[\d,]*{k}\]<stdout>: ?out of {k} in words$", r.stdout, re.M)
        assert re.search(rf"^{when}\[[\d,]*{k}\]<stderr>: ?err of {k}$", r.stderr, re.M)


@pytest.mark.parametrize("impl", IMPLS)
def test_horovodrun_mpi_reports_a_failing_rank(tmp_path, impl):
    script = tmp_path / "fail.py"
    script.write_text(
        "import horovod.numpy as hvd\nhvd.init()\n"
        "if hvd.rank() == 1:\n    raise SystemExit('rank 1 gives up')\nhvd.barrier()\n"
    )
    r = horovodrun_mpi(impl, "-np", "2", _python(impl), str(script))
    assert r.returncode != 0
    assert "rank 1 gives up" in r.stderr and "mpirun exited with status" in r.stderr


def test_horovodrun_mpi_without_mpirun_says_what_to_install(tmp_path):
    env = _env(PATH=str(tmp_path))  # nothing there
    r = subprocess.run(
        [sys.executable, "-m", "horovod.runner.launch", "--mpi", "-np", "2", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert "needs an mpirun on PATH" in r.stderr and "pyhorovod[mpi]" in r.stderr


def test_mpirun_implementations_are_told_apart():
    assert mpi_run.implementation_of("mpirun (Open MPI) 5.0.11") == mpi_run.OPEN_MPI
    assert mpi_run.implementation_of("prterun (Open MPI) 5.0.3") == mpi_run.OPEN_MPI
    assert mpi_run.implementation_of("HYDRA build details:\n Version: 4.1") == mpi_run.MPICH
    assert mpi_run.implementation_of("Intel(R) MPI Library for Linux") == mpi_run.MPICH
    with pytest.raises(RuntimeError, match="knows Open MPI"):
        mpi_run.implementation_of("Some Other MPI 1.0")


def test_the_mpirun_command_lines_for_open_mpi_and_mpich():
    hosts = [HostInfo("a", 2), HostInfo("b", 2)]
    common = dict(
        mpirun="mpirun",
        np=4,
        hosts=hosts,
        env_names=["PATH", "HOROVOD_CPU_OPERATIONS"],
        train=["python", "train.py"],
        mpi_args="--mca foo 'b c'",
        nics=["eth1"],
        ssh_port=2222,
        ssh_identity="/k",
    )
    ompi = mpi_run.command(mpi_run.OPEN_MPI, tcp=True, as_root=True, **common)
    assert ompi[:8] == [
        "mpirun",
        "--allow-run-as-root",
        "--tag-output",
        "-np",
        "4",
        "-H",
        "a:2,b:2",
        "--bind-to",
    ]
    for part in (
        ["--mca", "plm_rsh_args", "-p 2222 -i /k"],
        ["--mca", "btl_tcp_if_include", "eth1"],
        ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"],
        ["-x", "PATH", "-x", "HOROVOD_CPU_OPERATIONS"],
        ["--mca", "foo", "b c", "python", "train.py"],
    ):
        assert any(ompi[i : i + len(part)] == part for i in range(len(ompi))), (part, ompi)
    hydra = mpi_run.command(mpi_run.MPICH, **common)
    assert hydra[:5] == ["mpirun", "-prepend-pattern", mpi_output.HYDRA_LABEL, "-np", "4"]
    assert hydra[5:9] == ["-hosts", "a:2,b:2", "-bind-to", "none"]
    assert "-genvlist" in hydra and "PATH,HOROVOD_CPU_OPERATIONS" in hydra
    assert hydra[-2:] == ["python", "train.py"] and "-iface" in hydra
    # (output files are horovodrun's: mpi_output, for every MPI alike)
    files = ("--output-filename", "--output", "-outfile-pattern", "-errfile-pattern")
    assert not set(files) & set(ompi + hydra)
    # Hydra's ssh options: MPICH reads them from its environment only (its mpirun knows no
    # -bootstrap-exec-args, Intel MPI's); Open MPI's are on its command line (above)
    assert hydra[hydra.index("-bootstrap") + 1] == "ssh" and "-bootstrap-exec-args" not in hydra
    env = mpi_run.launcher_env(mpi_run.MPICH, 2222, "/k")
    assert env["HYDRA_LAUNCHER_EXTRA_ARGS"] == "-p 2222 -i /k"
    assert mpi_run.launcher_env(mpi_run.OPEN_MPI, 2222, "/k") == {}
    assert all(mpi_run.LAUNCHER_OWN.match(k) for k in env)  # (mpirun's, not the ranks')
    tcp = mpi_run.command(mpi_run.MPICH, tcp=True, **common)  # (TCP between hosts only)
    at = tcp.index("UCX_TLS") - 1
    assert tcp[at : at + 6] == ["-genv", "UCX_TLS", "tcp,self,sm", "-genv", "FI_PROVIDER", "tcp"]


def test_hydras_labelled_output_comes_back_as_each_ranks_whole_lines(capfdbinary):
    """Hydra labels each piece of a rank's output it forwards: ranks printing at once interleave
    within a line (a real job's output: ``test_horovodrun_mpi_..._through_mpirun[mpich]``).
    ``HydraOutput`` gives each rank its lines back, whatever the reads cut."""
    from horovod.runner.procs import OutputSink

    def label(r: int) -> bytes:
        return mpi_output.HYDRA_LABEL.replace("%r", str(r)).encode()

    stream = (
        label(1)
        + b"rank"
        + label(0)
        + b"rank 0 of 2\n"
        + label(1)
        + b" 1 of"
        + label(1)
        + b" 2\n"
        + label(0)
        + b"second\r"
        + b"hydra's own report\n"
        + label(1)
        + b"tail"
    )
    for cut in range(len(stream) + 1):  # every place a read may end
        out = mpi_output.HydraOutput("stdout", OutputSink(False, None), sys.stdout.buffer)
        out.feed(stream[:cut])
        out.feed(stream[cut:])
        out.close()
        got = capfdbinary.readouterr().out.decode()
        assert got.splitlines(keepends=True) == [
            "[0]<stdout>:rank 0 of 2\n",
            "[1]<stdout>:rank 1 of 2\n",
            "[0]<stdout>:second\r",
            "hydra's own report\n",
            "[1]<stdout>:tail\n",
        ], (cut, got)


def test_open_mpis_tagged_lines_pass_as_they_are_and_fill_each_ranks_files(tmp_path, capfdbinary):
    """``--output-filename`` under Open MPI: its tagged lines reach the console unchanged, and
    each rank's text goes to DIR/rank.N/stdout (Open MPI 5's own flag names files otherwise)."""
    from horovod.runner.procs import OutputSink

    stream = b"[1,0]<stdout>: a\n[1,1]<stdout>:   indented\nmpirun's own\n[1,0]<stdout>: last"
    for cut in (0, 5, 17, len(stream)):
        d = tmp_path / str(cut)
        sink = OutputSink(False, str(d))
        out = mpi_output.TaggedOutput("stdout", sink, sys.stdout.buffer, 2)
        out.feed(stream[:cut])
        out.feed(stream[cut:])
        out.close()
        sink.close()
        assert capfdbinary.readouterr().out == stream + b"\n"
        assert (d / "rank.0" / "stdout").read_bytes() == b"a\nlast\n"
        assert (d / "rank.1" / "stdout").read_bytes() == b"  indented\n"


def test_ranks_get_mpi_start_up_unless_the_environment_chose_the_built_in_planes():
    env = mpi_run.worker_env({"PATH": "/bin"}, {"HOROVOD_CYCLE_TIME": "2.0"})
    assert env["HOROVOD_CPU_OPERATIONS"] == "mpi" and env["HOROVOD_CONTROLLER"] == "mpi"
    assert env["HOROVOD_CYCLE_TIME"] == "2.0" and env["PATH"] == "/bin"
    kept = mpi_run.worker_env({"HOROVOD_CPU_OPERATIONS": "gloo"}, {})
    assert kept["HOROVOD_CPU_OPERATIONS"] == "gloo"


# ---------------------------------------------------------------------------- examples
@pytest.mark.parametrize("impl", IMPLS)
def test_the_numpy_example_runs_under_plain_mpirun_unchanged(impl):
    r = _run(
        _mpirun_argv(impl, 2) + [_python(impl), str(ROOT / "examples" / "numpy_digits.py")],
        impl,
        180,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "training on 2 rank(s)" in r.stdout and "replicas identical: True" in r.stdout


@needs_mpi
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_main_example_trains_under_horovodrun_mpi(tmp_path):
    example = str(ROOT / "examples" / "pytorch_digits.py")
    checkpoint = str(tmp_path / "ckpt.pt")
    r = horovodrun_mpi(
        "openmpi", "-np", "2", sys.executable, example, "--checkpoint", checkpoint, timeout=300
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "[1,0]<stdout>: epoch 10:" in r.stdout


# ---------------------------------------------------------------------------- benchmarks
@needs_mpi
@pytest.mark.parametrize("all_mpi", [False, True], ids=["engine's-choice", "all-mpi"])
def test_the_mpi_plane_benchmark_compares_with_mpi4py_on_the_same_buffers(all_mpi):
    r = subprocess.run(
        [sys.executable, "-m", "horovod.benchmarks.mpi_plane"]
        + ["--sizes", "4M", "--iters", "2", "--repeats", "1"]
        + (["--all-mpi"] if all_mpi else []),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [
        line for line in r.stdout.splitlines() if line.startswith("| all") or "| broadcast" in line
    ]
    assert len(rows) == 3, r.stdout
    # the ratio columns are numbers (the paired one with its range); the allreduce went
    # through MPI (4 MiB: at 2 ranks one of 1 MiB or less takes the engine's data round,
    # test_two_ranks_on_the_mpi_plane_...)
    for row in rows:
        *_, best, paired = row.strip().strip("|").split("|")
        float(best)
        mid, spread = paired.split()
        lo, hi = spread.strip("()").split("-")
        assert float(lo) <= float(mid) <= float(hi), row
    ran = [row.split("|")[4].strip() for row in rows]
    assert not rows[0].split("|")[5].strip().startswith("0 us"), rows[0]
    # the Python before the first MPI call, on the slowest rank: measured (a rank's own path)
    before = rows[0].split("|")[6].strip()
    assert before.endswith(" us") and int(before[:-3]) > 0, rows[0]
    # a two-rank 4 MiB broadcast: shared memory's single copy on one host, unless all-MPI
    assert ran[0] == "MPI" and ran[2] == ("MPI" if all_mpi else "own"), ran
