"""The device data plane on a real GPU (skipped without one; ``bash tests/gpu_checks.sh`` runs
them with the GPU benchmark on the device machine): NCCL at one rank, two and three ranks
sharing the GPU (the shared-GPU path between processes, the staged path between rank threads
or where asked for), training on CUDA, JAX arrays on the GPU, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_helpers import STANDIN, device_plane, every_collective, horovodrun_script

import horovod.torch as hvd
from horovod.testing import run_ranks

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the device tool's machine)"
)


@pytest.fixture(scope="module")
def cpu_results():
    return {n: run_ranks(every_collective, n, timeout=120) for n in (1, 2)}


@needs_gpu
def test_gpu_one_rank_nccl_every_collective():
    def body(rank):
        torch.cuda.set_device(0)
        x = torch.arange(6.0, device="cuda")
        outs = [
            hvd.allreduce(x, op=hvd.Average),
            hvd.allgather(x),
            hvd.broadcast(x, 0),
            hvd.alltoall(x)[0] if hasattr(hvd, "alltoall") else x,
            hvd.reducescatter(x),
        ]
        assert all(o.device.type == "cuda" for o in outs)
        return [o.cpu().tolist() for o in outs], dict(device_plane().path_counts)

    ((outs, counts),) = run_ranks(body, 1)
    assert outs[0] == list(np.arange(6.0))
    assert counts["device"] == 5


@needs_gpu
@pytest.mark.parametrize("size", [1, 2])
def test_gpu_every_collective_has_the_cpu_planes_bits(size, cpu_results):
    """The whole scenario on CUDA tensors: NCCL at 1 rank, the staged path at 2 (the rank
    threads share the one GPU); every result has the CPU planes' bits."""
    cpu = cpu_results[size]

    def body(rank):
        torch.cuda.set_device(0)
        with torch.device("cuda"):
            res = every_collective(rank)
        return res, dict(device_plane().path_counts)

    for rank, (res, counts) in enumerate(run_ranks(body, size, timeout=180)):
        for i, (a, b) in enumerate(zip(res, cpu[rank], strict=True)):
            assert a == b, f"rank {rank}: result {i} differs from the CPU planes'"
        if size == 1:  # only Adasum is staged
            assert counts["staged"] == 1 and counts["device"] > 40, counts
        else:
            assert counts["device"] == 0 and counts["staged"] > 40, counts


@needs_gpu
@pytest.mark.parametrize("size", [1, 2])
def test_gpu_distributed_optimizer_sync_batch_norm_and_fp16(tmp_path, size):
    """Training on CUDA with SyncBatchNorm and fp16 compression (NCCL at 1 rank, the
    shared-GPU path at 2): the ranks agree to the bit, and the weights match the same training on the
    CPU planes in the same job (up to the GPU's arithmetic). Real processes: CUDA's backward
    runs on autograd threads of its own, which rank threads could not follow."""
    r = horovodrun_script(
        tmp_path,
        size,
        """
        import hashlib, torch, horovod.torch as hvd
        hvd.init()
        torch.cuda.set_device(0)

        def train(device):
            model = torch.nn.Sequential(
                torch.nn.Linear(6, 8), hvd.SyncBatchNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
            ).to(device)
            init = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=init) * 0.3)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters(),
                compression=hvd.Compression.fp16,
            )
            g = torch.Generator().manual_seed(hvd.rank())
            for _ in range(4):
                x = torch.randn(5, 6, generator=g).to(device)
                y = torch.randint(0, 2, (5,), generator=g).to(device)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            assert all(p.device.type == device for p in model.parameters())
            return [p.detach().cpu() for p in model.state_dict().values()]

        cpu, gpu = train("cpu"), train("cuda")
        # (one rank's optimizer has nothing to reduce, as upstream's: an op of its own)
        z = torch.full((4,), 1.5, device="cuda", dtype=torch.float16)
        z = hvd.allreduce(z, op=hvd.Sum, prescale_factor=2.0)
        assert z.device.type == "cuda" and z.tolist() == [3.0 * hvd.size()] * 4, z
        diff = max(float((a - b).abs().max()) for a, b in zip(cpu, gpu))
        digest = hashlib.sha1(b"".join(t.numpy().tobytes() for t in gpu)).hexdigest()
        paths = hvd.device_paths()
        print("RESULT", diff < 1e-3, digest, paths["device"] > 0, paths["shared"] > 0, flush=True)
        """,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.split("RESULT ")[1] for line in r.stdout.splitlines() if "RESULT" in line]
    assert len(lines) == size and len(set(lines)) == 1, r.stdout  # same digest on every rank
    close, _, on_device, shared = lines[0].split()
    assert close == "True", r.stdout
    # NCCL at 1 rank; 2 ranks (processes) share the one GPU: the shared-GPU path
    assert (on_device, shared) == (("True", "False") if size == 1 else ("False", "True"))


@needs_gpu
def test_gpu_tensor_under_the_cpu_stand_in_is_refused():
    def body(rank):
        with pytest.raises(ValueError, match="unset HOROVOD_DEVICE_PLANE_TEST"):
            hvd.allreduce(torch.ones(2, device="cuda"))

    run_ranks(body, 1, env=STANDIN)


@needs_gpu
def test_gpu_jax_arrays_reach_the_plane_without_a_host_copy():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("this JAX has no GPU backend")

    def body(rank):
        import jax.numpy as jnp

        import horovod.jax as hj

        torch.cuda.set_device(0)
        x = jnp.arange(6.0) + 0.5
        # (a prescale: one rank's plain allreduce is the identity and reaches no plane)
        outs = [
            hj.allreduce(x, op=hj.Sum, prescale_factor=2.0),
            hj.allgather(x[:2]),
            hj.broadcast(x, 0),
        ]
        devices = {str(next(iter(o.devices())).platform) for o in outs}
        return [np.asarray(o).tolist() for o in outs], devices, hvd.device_paths()

    ((outs, devices, paths),) = run_ranks(body, 1, timeout=120)
    assert outs[0] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0] and outs[1] == [0.5, 1.5]
    assert devices == {"gpu"} and paths["device"] >= 3, (devices, paths)


@needs_gpu
@pytest.mark.parametrize("forced", ["", "staged"], ids=["shared", "staged"])
def test_gpu_two_ranks_sharing_the_gpu(tmp_path, forced):
    """Two processes on one GPU: allreduce, allgather and broadcast through each other's
    device memory (the shared-GPU path), or through the host where asked for."""
    r = horovodrun_script(
        tmp_path,
        2,
        """
        import torch, horovod.torch as hvd
        hvd.init()
        torch.cuda.set_device(0)
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * (hvd.rank() + 1)
        s = hvd.allreduce(x, op=hvd.Sum)
        g = hvd.allgather(x[:3])
        b = hvd.broadcast(x[:4], 1)
        ok = bool(torch.equal(s, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 3))
        print("RESULT", ok, s.device.type, g.tolist(), b.tolist(), hvd.device_paths(), flush=True)
        """,
        env={"HOROVOD_GPU_OPERATIONS": forced} if forced else None,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    paths = (
        "{'device': 0, 'shared': 0, 'staged': 3}"
        if forced
        else ("{'device': 0, 'shared': 3, 'staged': 0}")
    )
    want = f"RESULT True cuda [0.0, 1.0, 2.0, 0.0, 2.0, 4.0] [0.0, 2.0, 4.0, 6.0] {paths}"
    assert f"[0]<stdout>:{want}" in r.stdout and f"[1]<stdout>:{want}" in r.stdout, r.stdout
    assert "shared CUDA tensors" not in r.stderr, r.stderr  # torch's IPC teardown warnings


@needs_gpu
@pytest.mark.parametrize("size", [2, 3])
def test_gpu_shared_path_every_type_and_op_in_chunks(tmp_path, size):
    """Ranks in processes of their own on one GPU: every reduction and type, fused groups,
    an allreduce and a broadcast larger than the window (in chunks), uneven allgathers;
    each rank checks against the arithmetic done on its own CPU."""
    r = horovodrun_script(
        tmp_path,
        size,
        """
        import torch, horovod.torch as hvd
        hvd.init()
        torch.cuda.set_device(0)
        n, me = hvd.size(), hvd.rank()
        bad = []

        def check(what, got, want):
            if got.device.type != "cuda" or not torch.equal(got.cpu(), want):
                bad.append(what)

        def base(r, dt, count=7):
            return (torch.arange(count) % 4 + r).to(dt)

        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                   torch.uint8):
            ranks = [base(r, dt) for r in range(n)]
            mine = ranks[me].cuda()
            want_sum = ranks[0]
            for t in ranks[1:]:
                want_sum = want_sum + t
            check(f"sum {dt}", hvd.allreduce(mine, op=hvd.Sum), want_sum)
            check(f"min {dt}", hvd.allreduce(mine, op=hvd.Min), torch.stack(ranks).min(0).values)
            check(f"max {dt}", hvd.allreduce(mine, op=hvd.Max), torch.stack(ranks).max(0).values)
        flags = torch.tensor([me == 0, True, False]).cuda()
        check("bool", hvd.allreduce(flags, op=hvd.Sum), torch.tensor([True, True, False]))
        prod = hvd.allreduce(torch.full((3,), me + 1.0).cuda(), op=hvd.Product)
        check("product", prod, torch.full((3,), float(torch.arange(1, n + 1).prod())))
        avg = hvd.allreduce(torch.full((5,), 2.0 * me).cuda(), op=hvd.Average)
        check("average", avg, torch.full((5,), float(n - 1)))
        ts = [torch.ones(3).cuda() * me, torch.arange(4.0).cuda() + me]
        outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
        tri = n * (n - 1) / 2
        check("grouped 0", outs[0], torch.full((3,), tri))
        check("grouped 1", outs[1], torch.arange(4.0) * n + tri)
        big = 20 << 20  # 80 MiB of float32: two chunks of the 64 MiB window
        x = torch.full((big,), float(me + 1), device="cuda")
        x[-1] = me
        hvd.allreduce_(x, op=hvd.Sum)
        ok_big = bool((x[:-1] == n * (n + 1) / 2).all()) and float(x[-1]) == tri
        if not ok_big:
            bad.append("big allreduce")
        y = torch.full((big,), float(me), device="cuda")
        hvd.broadcast_(y, n - 1)
        if not bool((y == n - 1).all()):
            bad.append("big broadcast")
        g = hvd.allgather(torch.full((me + 1, 2), float(me)).cuda())
        check("allgather", g, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)]))
        gs = hvd.grouped_allgather([torch.ones(me + 1).cuda() * me, torch.arange(2.0).cuda()])
        check("grouped allgather", gs[0], torch.cat([torch.ones(r + 1) * r for r in range(n)]))
        check("grouped allgather 1", gs[1], torch.arange(2.0).repeat(n))
        paths = hvd.device_paths()
        print("RESULT", bad, paths["shared"] > 20, paths["device"], flush=True)
        """,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("RESULT [] True 0") == size, r.stdout + r.stderr[-3000:]
    assert "shared CUDA tensors" not in r.stderr, r.stderr


@needs_gpu
@pytest.mark.parametrize("np_", [1, 2])
def test_gpu_digits_example_trains_on_cuda(tmp_path, np_):
    from conftest import horovodrun_example

    args = ("--checkpoint", str(tmp_path / "c.pt"), "--epochs", "6", "--min-accuracy", "0.8")
    r = horovodrun_example(np_, "pytorch_digits.py", *args)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_gpu
def test_gpu_cpu_tensor_on_one_rank_cuda_on_the_other_fails_on_both(tmp_path):
    r = horovodrun_script(
        tmp_path,
        2,
        """
        import torch, horovod.torch as hvd
        hvd.init()
        torch.cuda.set_device(0)
        x = torch.ones(3, device="cuda" if hvd.rank() == 1 else "cpu")
        try:
            hvd.allreduce(x, name="mixed")
        except hvd.HorovodInternalError as e:
            print("REFUSED", "device CPU on rank 0" in str(e), flush=True)
        """,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("REFUSED True") == 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_gpu_tensors_on_two_devices_in_one_grouped_call_are_refused():
    def body(rank):
        with pytest.raises(ValueError, match="same device"):
            hvd.grouped_allreduce([torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")])

    run_ranks(body, 1)
