"""Workers started by srun or mpirun instead of horovodrun: the scheduler's variables are read
(pure unit tests), and real jobs rendezvous on their own (processes started with Slurm's
environment as srun would set it, and, where Open MPI is installed, under a real mpirun)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from horovod.common.scheduler import detect, first_host, tasks_per_node
from tests.conftest import REPO


def _slurm(rank, n, local, per_node="2", node=0, **extra):
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_LOCALID": str(local),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_NODEID": str(node),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[07-08]",
    }
    env.update(extra)
    return env


def test_slurm_step_variables():
    launch = detect(_slurm(3, 4, 1, per_node="2(x2)", node=1))
    assert launch is not None and launch.scheduler == "Slurm"
    e = launch.env
    assert (e["HOROVOD_RANK"], e["HOROVOD_SIZE"], e["HOROVOD_LOCAL_RANK"]) == ("3", "4", "1")
    assert e["HOROVOD_LOCAL_SIZE"] == "2"
    assert e["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "node07"  # the step's first node hosts rank 0
    assert 28000 <= int(e["HOROVOD_GLOO_RENDEZVOUS_PORT"]) < 30000
    assert launch.derived_secret and len(e["HOROVOD_SECRET_KEY"]) == 64
    # every rank of the step derives the same port and key
    other = detect(_slurm(0, 4, 0, per_node="2(x2)")).env
    assert other["HOROVOD_SECRET_KEY"] == e["HOROVOD_SECRET_KEY"]
    assert other["HOROVOD_GLOO_RENDEZVOUS_PORT"] == e["HOROVOD_GLOO_RENDEZVOUS_PORT"]


def test_what_the_user_sets_wins():
    env = _slurm(
        1,
        2,
        1,
        HOROVOD_GLOO_RENDEZVOUS_ADDR="10.0.0.5",
        HOROVOD_SECRET_KEY="ab" * 32,
        HOROVOD_GLOO_RENDEZVOUS_PORT="5000",
    )
    launch = detect(env)
    assert launch is not None and not launch.derived_secret
    for var in (
        "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "HOROVOD_SECRET_KEY",
        "HOROVOD_GLOO_RENDEZVOUS_PORT",
    ):
        assert var not in launch.env


def test_horovodrun_workers_and_batch_scripts_are_left_alone():
    assert detect({**_slurm(0, 2, 0), "HOROVOD_RANK": "0"}) is None
    # sbatch's own shell has SLURM_PROCID but is not an srun step
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}) is None
    assert detect({}) is None


def test_open_mpi_and_pmi_variables():
    e = detect(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        }
    )
    assert e is not None and e.scheduler == "Open MPI"
    assert (e.env["HOROVOD_RANK"], e.env["HOROVOD_SIZE"], e.env["HOROVOD_LOCAL_SIZE"]) == (
        "1",
        "3",
        "3",
    )
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in e.env  # must be given: no node list to read
    p = detect({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert p is not None and p.scheduler == "PMI" and p.env["HOROVOD_SIZE"] == "1"
    assert "HOROVOD_SECRET_KEY" not in p.env  # one process needs no rendezvous


def test_slurm_notations():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks per node"):
        tasks_per_node("2(x")
    assert first_host("node[07-09,12],gpu1") == "node07"
    assert first_host("a,b") == "a"
    assert first_host("gpu[3]") == "gpu3"


SCRIPT = """
    import os
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    s = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="x")
    # One write per line: print() with several arguments may write them piecewise (an
    # unbuffered stdout), and two ranks' pieces then interleave in the launcher's output.
    line = (f"rank {hvd.rank()} size {hvd.size()} local {hvd.local_rank()} {hvd.local_size()} "
            f"cross {hvd.cross_rank()} {hvd.cross_size()} sum {float(s[0])}\\n")
    os.write(1, line.encode())
    hvd.shutdown()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def _env(extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HOROVOD_", "SLURM_", "OMPI_", "PMI_"))
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_processes_started_as_srun_would_rendezvous_without_horovodrun(tmp_path):
    n, port, path = 3, _free_port(), _script(tmp_path)
    procs = []
    for r in reversed(range(n)):  # rank 0 last: the others wait for its store
        env = _env(
            _slurm(
                r,
                n,
                r,
                per_node=str(n),
                SLURM_STEP_NODELIST="localhost",
                HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert f"size {n} " in out and "sum 6.0" in out and "cross 0 1" in out


SLOW_READER = """
import sys, time
from horovod.rendezvous.store import HTTPStoreClient
if sys.argv[1] == "1":  # this rank reads the store late, after rank 0 has read all it needs
    wait = HTTPStoreClient.wait
    def late(self, *args, **kwargs):
        time.sleep(1.0)
        return wait(self, *args, **kwargs)
    HTTPStoreClient.wait = late
import horovod.numpy as hvd
hvd.init()
print("init done", hvd.rank(), flush=True)
"""


def test_rank_0_serving_the_store_ends_only_after_every_rank_is_done_with_it(tmp_path):
    """Where rank 0's process serves the rendezvous (srun, mpirun), a script with nothing after
    init must not end rank 0, and with it the store, while another rank still reads it."""
    port, path = _free_port(), tmp_path / "slow_reader.py"
    path.write_text(SLOW_READER)
    procs = []
    for r in (1, 0):  # (rank 0 last: the other waits for its store)
        env = _env(_slurm(r, 2, r, SLURM_STEP_NODELIST="localhost"))
        env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(path), str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=90) for p in procs]
    for r, p, (out, err) in zip((1, 0), procs, outs, strict=True):
        assert p.returncode == 0 and f"init done {r}" in out, err[-2000:]


def test_a_scheduled_job_without_a_rendezvous_address_says_which_variable(tmp_path):
    env = _env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    r = subprocess.run(
        [sys.executable, str(_script(tmp_path))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "started by Open MPI" in r.stderr and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in r.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_under_a_real_mpirun(tmp_path):
    path = _script(tmp_path)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    r = subprocess.run(
        [
            "mpirun",
            *root,
            "--oversubscribe",
            "-np",
            "2",
            "-x",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR=127.0.0.1",
            "-x",
            f"HOROVOD_GLOO_RENDEZVOUS_PORT={_free_port()}",
            "-x",
            "PYTHONPATH",
            sys.executable,
            str(path),
        ],
        env=_env({}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("size 2 ") == 2 and r.stdout.count("sum 3.0") == 2


def test_kubernetes_indexed_job():
    launch = detect(
        {
            "JOB_COMPLETION_INDEX": "1",
            "HOROVOD_SIZE": "2",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "digits-0.digits",
        }
    )
    assert launch is not None and launch.scheduler == "Kubernetes"
    assert launch.env["HOROVOD_RANK"] == "1" and launch.env["HOROVOD_LOCAL_SIZE"] == "1"
    assert detect({"JOB_COMPLETION_INDEX": "1"}) is None  # an ordinary indexed job


def test_lsf_hosts_and_slots():
    from horovod.runner.hosts import lsf_hosts

    hs = lsf_hosts({"LSB_MCPU_HOSTS": "hostA 4 hostB 2"})
    assert [(h.hostname, h.slots) for h in hs] == [("hostA", 4), ("hostB", 2)]
    assert lsf_hosts({}) is None
    with pytest.raises(ValueError, match="LSB_MCPU_HOSTS"):
        lsf_hosts({"LSB_MCPU_HOSTS": "hostA 4 hostB"})


def test_horovodrun_under_lsf_defaults_np_and_hosts(tmp_path):
    env = _env({"LSB_MCPU_HOSTS": "localhost 2"})
    path = _script(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "horovod.runner.launch", sys.executable, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("size 2 ") == 2


def test_the_kubernetes_manifest_trains_with_its_own_environment(tmp_path):
    """examples/kubernetes/digits-job.yaml, minus the cluster: two processes get exactly the
    manifest's variables (pod 0's DNS name replaced by this host) and run its command."""
    import secrets

    import yaml

    docs = list(yaml.safe_load_all((REPO / "examples/kubernetes/digits-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    values = {e["name"]: e.get("value") for e in container["env"]}
    assert values["HOROVOD_SIZE"] == str(spec["completions"])
    assert values["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == f"{job['metadata']['name']}-0.digits"
    port = _free_port()
    key = secrets.token_hex(32)
    procs = []
    for index in range(spec["completions"]):
        env = _env({k: v for k, v in values.items() if v is not None})
        env.update(
            JOB_COMPLETION_INDEX=str(index),
            HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
            HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
            HOROVOD_SECRET_KEY=key,
        )
        procs.append(
            subprocess.Popen(
                container["command"],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    assert "accuracy" in outs[0][0].lower()
