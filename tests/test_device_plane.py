"""The device data plane (horovod.device) without a GPU: PyTorch's Gloo process group stands
in for NCCL and host stand-in streams check the ordering (HOROVOD_DEVICE_PLANE_TEST=gloo).
Everything but the CUDA calls runs: path choice, process-group bootstrap from the job's own
ranks, device fusion, every collective with upstream's numerics, the staged path through
host memory and the CPU planes, hierarchical allreduce, errors, the timeline. The results
must have the bits of the CPU planes' results. The tests on a real GPU are in test_device_plane_gpu.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from device_helpers import (
    SHARED,
    STAGED,
    STANDIN,
    bits_of,
    device_plane,
    every_collective,
    horovodrun_script,
)

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError
from horovod.testing import run_ranks


@pytest.fixture(scope="module")
def cpu_results():
    return {n: run_ranks(every_collective, n, timeout=120) for n in (2, 3)}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("env", [STANDIN, STAGED, SHARED], ids=["device", "staged", "shared"])
def test_every_collective_has_the_cpu_planes_bits(size, env, cpu_results):
    def body(rank):
        res = every_collective(rank)
        return res, dict(device_plane().path_counts)

    got = run_ranks(body, size, env=env, timeout=120)
    for rank, (res, counts) in enumerate(got):
        assert len(res) == len(cpu_results[size][rank])
        for i, (a, b) in enumerate(zip(res, cpu_results[size][rank], strict=True)):
            assert a == b, f"rank {rank}: result {i} differs from the CPU planes'"
        if env is STAGED:
            assert counts["device"] == 0 and counts["staged"] > 0
        elif env is SHARED:  # allreduce, broadcast, allgather; the others through the host
            assert counts["device"] == 0 and counts["shared"] > 30 and counts["staged"] == 5
        else:  # only Adasum is staged
            assert counts["staged"] == 1 and counts["device"] > 40


def test_shared_gpu_path_in_chunks_of_its_window(monkeypatch):
    """Ops larger than the window: allreduce and broadcast go through it in chunks, an
    allgather whose rows do not fit takes the staged path; the results are the CPU planes'."""
    from horovod.device import ipc

    monkeypatch.setattr(ipc, "WINDOW_BYTES", 256)

    def body(rank):
        x = torch.arange(1001, dtype=torch.float32) * (rank + 1)
        outs = [
            hvd.allreduce(x, op=hvd.Sum, name="big"),
            hvd.allreduce(x.to(torch.float64), op=hvd.Average, name="big64"),
            hvd.allreduce(torch.arange(3) % 2 == rank % 2, op=hvd.Sum, name="bool"),
            hvd.allreduce(torch.tensor([rank + 1.0] * 5), op=hvd.Product, name="prod"),
            hvd.allreduce(torch.tensor([float(rank)] * 7), op=hvd.Min, name="min"),
            hvd.broadcast(x + 0.5, 2, name="bc"),
            hvd.allgather(torch.full((rank + 1, 3), float(rank)), name="small"),
            hvd.allgather(x[: 100 * (rank + 1)], name="large"),  # 400-1200 bytes a rank
        ]
        return [bits_of(o) for o in outs], hvd.device_paths()

    cpu = run_ranks(lambda r: body(r)[0], 3)
    for rank, (res, counts) in enumerate(run_ranks(body, 3, env=SHARED, timeout=120)):
        assert res == cpu[rank], rank
        assert counts == {"device": 0, "shared": 7, "staged": 1}, counts


def test_shared_gpu_path_in_separate_processes_leaves_no_shared_memory(tmp_path):
    import glob

    before = set(glob.glob("/dev/shm/hvd-window-*"))
    r = horovodrun_script(
        tmp_path,
        2,
        """
        import torch, horovod.torch as hvd
        hvd.init()
        x = torch.arange(6.0) * (hvd.rank() + 1)
        s = hvd.allreduce(x, op=hvd.Sum)
        g = hvd.allgather(x[: hvd.rank() + 1])
        b = hvd.broadcast(x, 1)
        print("RESULT", s.tolist(), g.tolist(), b.tolist(), hvd.device_paths(), flush=True)
        """,
        env=SHARED,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    want = "[0.0, 3.0, 6.0, 9.0, 12.0, 15.0] [0.0, 0.0, 2.0] [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]"
    assert f"[0]<stdout>:RESULT {want} {{'device': 0, 'shared': 3, 'staged': 0}}" in r.stdout
    assert set(glob.glob("/dev/shm/hvd-window-*")) <= before


def test_per_op_setting_picks_the_path():
    env = {**STANDIN, "HOROVOD_GPU_ALLGATHER": "staged"}

    def body(rank):
        hvd.allreduce(torch.ones(3))
        before = dict(device_plane().path_counts)
        hvd.allgather(torch.ones(2))
        return before, dict(device_plane().path_counts)

    for before, after in run_ranks(body, 2, env=env):
        assert before == {"device": 1, "shared": 0, "staged": 0}
        assert after == {"device": 1, "shared": 0, "staged": 1}


def test_streams_are_ordered_for_every_op():
    """The plane waits for each input's ready event (recorded by the caller) before it
    records the op's done event, and results are consumed only after that event."""

    def body(rank):
        handles = [
            hvd.allreduce_async(torch.ones(4) * i, name=f"s{i}", op=hvd.Sum) for i in range(5)
        ]
        outs = [hvd.synchronize(h) for h in handles]
        return list(device_plane().streams.log), [o.tolist() for o in outs]

    for log, outs in run_ranks(body, 2, env=STANDIN):
        assert outs == [[2.0 * i] * 4 for i in range(5)]
        waits = 0
        for kind, _ in log:
            if kind == "wait":
                waits += 1
            else:
                assert kind == "record" and waits >= 1, log
                waits = 0
        # every input waited for once (fused ops share one done event)
        assert sum(1 for k, _ in log if k == "wait") == 5
        assert 1 <= sum(1 for k, _ in log if k == "record") <= 5


def test_host_stand_in_refuses_what_would_race_on_a_gpu():
    from horovod.device.streams import HostEvent, HostStreams, consume

    s = HostStreams(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="never recorded"):
        s.wait_ready(torch.ones(1), HostEvent())
    with pytest.raises(RuntimeError, match="before the plane recorded"):
        consume(torch.ones(1), HostEvent())
    with pytest.raises(RuntimeError, match="no stream recorded"):
        s.host_wait(HostEvent())


def test_distributed_optimizer_sync_batch_norm_and_fp16_match_the_cpu_planes():
    def body(rank):
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), hvd.SyncBatchNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )
        # (rank threads share torch's global generator: initialise from one of our own, so
        # that both runs start from the same weights)
        init = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=init) * 0.3)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16,
        )
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            x = torch.randn(5, 6, generator=g)
            y = torch.randint(0, 2, (5,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [bits_of(p) for p in model.state_dict().values()]

    cpu = run_ranks(body, 2, timeout=120)
    dev = run_ranks(body, 2, env=STANDIN, timeout=120)
    assert dev == cpu
    assert dev[0] == dev[1]


def test_joined_rank_contributes_zeros_to_device_allreduces():
    def body(rank):
        if rank == 1:
            return hvd.join()
        outs = [hvd.allreduce(torch.ones(3) * (i + 1), op=hvd.Sum).tolist() for i in range(3)]
        last = hvd.join()
        return outs, last

    res = run_ranks(body, 2, env=STANDIN)
    outs, last = res[0]
    assert outs == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert last in (0, 1)


@pytest.mark.parametrize("standin", [STANDIN, SHARED], ids=["device", "shared"])
def test_process_sets_get_their_own_groups(standin):
    """Each set gets its own group (and, on the shared-GPU path, its own windows), made on
    first use and released when the set is removed."""

    def body(rank):
        ps = hvd.add_process_set([0, 2])
        try:
            out = None
            if rank in (0, 2):
                out = hvd.allreduce(torch.ones(2) * rank, op=hvd.Sum, process_set=ps).tolist()
            whole = hvd.allreduce(torch.ones(2) * rank, op=hvd.Sum).tolist()
            return out, whole, sorted(device_plane().groups)
        finally:
            hvd.remove_process_set(ps)

    res = run_ranks(body, 3, env={**standin, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert res[0][0] == res[2][0] == [2.0, 2.0] and res[1][0] is None
    assert all(r[1] == [3.0, 3.0] for r in res)
    assert res[0][2] == res[2][2] == [0, 1] and res[1][2] == [0]

    def removed(rank):  # a removed set's group is released
        ps = hvd.add_process_set([0, 1])
        if rank < 2:
            hvd.allreduce(torch.ones(2), process_set=ps)
        before = sorted(device_plane().groups) if rank < 2 else []
        hvd.remove_process_set(ps)
        return before, sorted(device_plane().groups) if rank < 2 else []

    env = {**standin, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    res = run_ranks(removed, 3, env=env)
    assert res[0][1] == res[1][1] == [] and len(res[0][0]) == 1


def test_hierarchical_allreduce_device_within_hosts_cpu_across():
    hosts = ["a", "a", "b", "b"]

    def body(rank):
        x = torch.arange(6, dtype=torch.float64) * (rank + 1) + 0.25
        out = [hvd.allreduce(x, op=op, name=f"h{op}") for op in (hvd.Sum, hvd.Average, hvd.Max)]
        fused = hvd.grouped_allreduce([x[:2], x * 2], op=hvd.Sum)
        return [bits_of(t) for t in out + fused], sorted(device_plane().groups[0].__dict__)

    env = {**STANDIN, "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    dev = run_ranks(body, 4, env=env, hosts=hosts)
    flat = run_ranks(body, 4, env=STANDIN, hosts=hosts)
    for (a, _), (b, _) in zip(dev, flat, strict=True):
        assert a == b
    # sums of these values are exact in any order: compare with the arithmetic too
    want = sum(np.arange(6.0) * (r + 1) + 0.25 for r in range(4))
    assert np.frombuffer(dev[0][0][0], np.float64).tolist() == want.tolist()


def test_timeline_names_the_path(tmp_path):
    path = tmp_path / "tl.json"

    def body(rank):
        hvd.allreduce(torch.ones(3), name="dev")
        hvd.allreduce(torch.ones(3), name="ada", op=hvd.Adasum)

    run_ranks(body, 2, env={**STANDIN, "HOROVOD_TIMELINE": str(path)})
    names = {e.get("name") for e in json.loads(path.read_text()) if isinstance(e, dict)}
    assert "GLOO_ALLREDUCE" in names
    assert "MEMCPY_DEVICE_TO_HOST" in names and "MEMCPY_HOST_TO_DEVICE" in names
    assert any(n and n.startswith("STAGED_") for n in names)


def test_cpu_tensor_on_one_rank_device_on_another_fails_on_every_rank():
    import horovod.numpy as hnp

    def body(rank):
        with pytest.raises(HorovodInternalError) as info:
            if rank == 0:
                hnp.allreduce(np.ones(3), name="mixed")
            else:
                hvd.allreduce(torch.ones(3, dtype=torch.float64), name="mixed")
        return str(info.value)

    for m in run_ranks(body, 2, env=STANDIN):
        assert "device CPU on rank 0" in m and "but GPU on rank 1" in m


def test_tensor_on_another_ranks_gpu_fails_on_every_rank():
    from horovod.core.context import current
    from horovod.core.handles import Entry, Handle
    from horovod.core.messages import ALLREDUCE, DEVICE, Request, wrong_device_code

    def body(rank):
        h = Handle(1)
        x = np.zeros(3)
        dev = wrong_device_code(0, 1) if rank == 1 else DEVICE
        req = Request(0, "wrongdev", ALLREDUCE, 8, (3,), device=dev)
        current().engine.submit([Entry(req, x, x.copy(), h)])
        with pytest.raises(HorovodInternalError) as info:
            h.wait()
        return str(info.value)

    for m in run_ranks(body, 2):
        assert "rank 1" in m and "GPU 0" in m and "works on GPU 1" in m
        assert "torch.cuda.set_device(hvd.local_rank())" in m


def test_choose_path():
    from horovod.device.groups import choose_path

    def rec(device, ok=True):
        return json.dumps({"device": device, "backend_ok": ok}).encode()

    all_nccl = {0: "", 1: "nccl"}
    paths, why = choose_path([rec("g0"), rec("g1")], ["a", "a"], all_nccl)
    assert paths == {0: "device", 1: "device"} and why == ""
    paths, why = choose_path([rec("g0"), rec("g0")], ["a", "a"], all_nccl)
    assert paths == {0: "staged", 1: "staged"} and "ranks 0 and 1 share one GPU" in why
    paths, why = choose_path([rec("g0"), rec("g0")], ["a", "b"], all_nccl)  # two hosts
    assert paths == {0: "device", 1: "device"}
    paths, why = choose_path([rec("g0"), rec("g1", ok=False)], None, all_nccl)
    assert paths[0] == "staged" and "not available on rank(s) [1]" in why
    paths, why = choose_path([rec("g0"), rec("g1")], None, {0: "staged", 1: "mpi", 2: ""})
    assert paths == {0: "staged", 1: "staged", 2: "device"}


def test_the_plane_is_released_at_shutdown_and_made_again_after_init():
    def body(rank):
        first = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
        plane = device_plane()
        hvd.shutdown()
        hvd.init()
        second = hvd.allreduce(torch.ones(2) * 2, op=hvd.Sum).tolist()
        return first, second, plane.groups == {}, device_plane() is not plane

    for first, second, cleared, fresh in run_ranks(body, 2, env=STANDIN):
        assert first == [2.0, 2.0] and second == [4.0, 4.0] and cleared and fresh


# --- whole jobs under horovodrun, on the stand-in -------------------------------------------


@pytest.mark.e2e
def test_digits_example_trains_on_the_device_plane(tmp_path, monkeypatch):
    from conftest import horovodrun_example

    def epochs(r):
        assert r.returncode == 0, r.stdout + r.stderr
        return [line for line in r.stdout.splitlines() if "<stdout>:epoch" in line]

    args = ("--checkpoint", str(tmp_path / "c.pt"), "--epochs", "4", "--min-accuracy", "0.5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU tensors (the stand-in's) on any machine
    on_cpu_planes = epochs(horovodrun_example(2, "pytorch_digits.py", *args))
    timeline = tmp_path / "timeline.json"
    monkeypatch.setenv("HOROVOD_DEVICE_PLANE_TEST", "gloo")
    monkeypatch.setenv("HOROVOD_TIMELINE", str(timeline))
    on_device_plane = epochs(horovodrun_example(2, "pytorch_digits.py", *args))
    # the same losses and accuracies to the last printed digit, epoch by epoch
    assert on_device_plane == on_cpu_planes and len(on_cpu_planes) == 4
    names = {e.get("name") for e in json.loads(timeline.read_text()) if isinstance(e, dict)}
    assert "GLOO_ALLREDUCE" in names


@pytest.mark.e2e
@pytest.mark.parametrize("standin", ["gloo", "shared"])
def test_a_rank_lost_during_device_collectives_ends_the_job_with_a_report(
    tmp_path, monkeypatch, standin
):
    """A rank killed in the middle of device collectives, on the device path (Gloo for NCCL)
    and on the shared-GPU path (its barriers): the job ends with a report naming it."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    script = tmp_path / "lost.py"
    script.write_text(
        "import os, threading, torch\n"
        "import horovod.torch as hvd\n"
        "hvd.init()\n"
        "x = torch.ones(4 << 20)\n"
        "hvd.allreduce(x, name='first')\n"
        "if hvd.rank() == 1:\n"
        "    threading.Timer(0.05, lambda: os._exit(7)).start()\n"
        "for i in range(1000):\n"
        "    hvd.allreduce(x, name=f'w{i}')\n"
        "    hvd.broadcast(x[:9], 0, name=f'b{i}')\n"
        "print('finished all steps', flush=True)\n"
    )
    env = dict(
        __import__("os").environ,
        PYTHONPATH=str(REPO),
        HOROVOD_DEVICE_PLANE_TEST=standin,
    )
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "horovod.runner.launch", "-np", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert r.returncode != 0
    assert time.monotonic() - start < 60
    out = r.stdout + r.stderr
    assert "finished all steps" not in out
    assert "rank 1" in out and "7" in out, out[-3000:]


@pytest.mark.e2e
def test_gpu_benchmark_runs_on_the_stand_in():
    from conftest import run_module

    r = run_module(
        "horovod.benchmarks.gpu",
        "--standin",
        "--steps",
        "3",
        "--sizes",
        str(1 << 20),
        "--staged-bytes",
        str(4 << 20),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stand-in on CPU tensors" in r.stdout
    assert "x the plain step" in r.stdout
    staged = next(line for line in r.stdout.splitlines() if line.startswith("staged allreduce"))
    assert "'device': 0" in staged and "'staged': 0" not in staged
    shared = next(line for line in r.stdout.splitlines() if line.startswith("shared-GPU"))
    assert "'device': 0" in shared and "'shared': 0" not in shared and "'staged': 0" in shared
    rows = [line for line in r.stdout.splitlines() if "torch.distributed Gloo" in line]
    assert len(rows) == 6  # three ops at 1 and 2 ranks, each with its ratio


# --- JAX arrays and TensorFlow tensors reach the same plane (DLPack) ------------------------


def _jax_scenario(rank):
    import jax

    # host arrays (the stand-in's): on a machine with a GPU, JAX would put them there
    with jax.default_device(jax.devices("cpu")[0]):
        return _jax_ops(rank)


def _jax_ops(rank):
    import jax
    import jax.numpy as jnp

    import horovod.jax as hj

    x = jnp.arange(6.0) * (rank + 1) + 0.5
    outs = [
        hj.allreduce(x, op=hj.Sum),
        hj.allreduce(x.astype(jnp.bfloat16), op=hj.Average),
        hj.allgather(x[: rank + 1]),
        hj.broadcast(x, 1),
        hj.reducescatter(x, op=hj.Sum),
        hj.alltoall(x),
        *hj.grouped_allreduce([x, x[:2] * 2], op=hj.Average),
        *hj.alltoall(x, splits=[2, 4] if rank == 0 else [3, 3]),
        jax.grad(lambda w: hj.allreduce(w * (rank + 1), op=hj.Sum).sum())(x),
        jax.jit(lambda w: hj.allreduce(w, op=hj.Sum))(x),  # traced: a host callback
    ]
    return [np.asarray(o).tobytes() for o in outs]


def _tf_scenario(rank):
    import tensorflow as tf

    import horovod.tensorflow as ht

    x = tf.range(6.0) * (rank + 1) + 0.5
    outs = [
        ht.allreduce(x, op=ht.Sum),
        ht.allgather(x[: rank + 1]),
        ht.broadcast(x, 1),
        ht.reducescatter(x, op=ht.Sum),
        ht.alltoall(x),
        *ht.grouped_allreduce([x, x[:2] * 2], op=ht.Average),
        *ht.alltoall(x, splits=[2, 4] if rank == 0 else [3, 3]),
    ]
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(ht.allreduce(w * (rank + 1), op=ht.Sum))
    outs.append(tape.gradient(y, w))
    return [np.asarray(o).tobytes() for o in outs]


@pytest.mark.parametrize("framework", ["jax", "tensorflow"])
def test_jax_and_tensorflow_tensors_take_the_device_plane(framework):
    pytest.importorskip(framework)
    scenario = _jax_scenario if framework == "jax" else _tf_scenario

    def body(rank):
        return scenario(rank), hvd.device_paths()

    cpu = run_ranks(lambda r: scenario(r), 2, timeout=120)
    dev = run_ranks(body, 2, env=STANDIN, timeout=120)
    for rank in range(2):
        assert dev[rank][0] == cpu[rank]
        assert dev[rank][1]["device"] >= 9  # eager calls went to the plane (jit's did not)


def test_build_flags_follow_the_installed_torch(monkeypatch):
    import importlib.metadata as md

    from horovod.common import util
    from horovod.runner.launch import check_build

    class Dist:
        def __init__(self, name):
            self.metadata = {"Name": name}

    def fake(torch_version, packages):
        versions = {"torch": torch_version, **packages}
        monkeypatch.setattr(md, "version", lambda n: versions[n])
        monkeypatch.setattr(md, "distributions", lambda: [Dist(n) for n in versions])
        util._torch_gpu_stack.cache_clear()

    try:
        fake("2.13.0", {"nvidia-cuda-runtime-cu12": "12.8", "nvidia-nccl-cu12": "2.21.5"})
        assert util.nccl_built() == 22105 and util.cuda_built()
        assert "[X] NCCL" in check_build()
        fake("2.13.0+cpu", {})
        assert util.nccl_built() == 0 and not util.cuda_built()
        assert "[ ] NCCL" in check_build()
    finally:
        monkeypatch.undo()
        util._torch_gpu_stack.cache_clear()
    # this machine: 0 on a CPU build of torch; on a CUDA build, the NCCL that torch loads
    import torch

    want = 0
    if torch.version.cuda:
        major, minor, patch = torch.cuda.nccl.version()[:3]
        want = major * 10000 + minor * 100 + patch
    assert util.nccl_built() == want
