"""GPU benchmark: the device data plane against the plain optimizer, the copy engine and
torch.distributed, in one run.

    python -m horovod.benchmarks.gpu                  # on a machine with a CUDA GPU
    python -m horovod.benchmarks.gpu --standin        # no GPU: the same code on CPU tensors

It prints, with the GPU's name and the date:

- ``optimizer``: a training step with ``hvd.DistributedOptimizer`` at 1 rank against the plain
  optimizer (the device plane's overhead; target at most 1.05x);
- ``staged``: a 64 MiB allreduce at 2 ranks sharing the GPU on the staged path (asked for
  with ``HOROVOD_GPU_OPERATIONS=staged``) against the host<->device copy bandwidth measured in
  the same processes (a round trip of the same bytes through pinned memory; target at least
  70%), then the same on the shared-GPU path that such ranks take by default (NCCL refuses
  two ranks on one GPU);
- ``collectives``: allreduce, allgather and broadcast of CUDA tensors, pyhorovod against
  torch.distributed in the same run: NCCL at 1 rank, Gloo on CUDA tensors at 2 ranks (ours
  on the shared-GPU path).

``--standin`` runs everything on CPU tensors with PyTorch's Gloo standing in for NCCL
(``HOROVOD_DEVICE_PLANE_TEST=gloo``): its figures say nothing about GPUs; it checks that the
benchmark itself works (the tests run it).

Must not touch: the runtime's internals (it uses ``horovod.torch`` like a user).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from horovod.benchmarks import launch

MIB = 1 << 20


def _device(standin: bool):
    import torch

    if standin:
        return torch.device("cpu")
    import horovod.torch as hvd

    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` (after warm-up), the device synchronised around each call."""
    for _ in range(max(2, repeats // 4)):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------- workers
def worker_optimizer(args) -> dict:
    import torch

    import horovod.torch as hvd

    hvd.init()
    device = _device(args.standin)
    torch.manual_seed(0)
    width = 256 if args.standin else 2048
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    ).to(device)
    x = torch.randn(64, width, device=device)
    plain = torch.optim.SGD(model.parameters(), lr=1e-3)
    dist = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
    )

    def step(opt):
        def run():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        return run

    out: dict[str, float] = {}
    for _ in range(2):  # alternate, keep each one's best pass
        for name, opt in (("plain", plain), ("horovod", dist)):
            t = _timed(step(opt), device, args.steps)
            out[name] = min(out.get(name, t), t)
    hvd.shutdown()
    return out


def worker_staged(args) -> dict:
    import torch

    import horovod.torch as hvd

    hvd.init()
    device = _device(args.standin)
    nbytes = args.staged_bytes
    x = torch.ones(nbytes // 4, device=device)
    host = torch.empty(nbytes // 4, pin_memory=device.type == "cuda")

    def round_trip():
        host.copy_(x, non_blocking=True)
        x.copy_(host, non_blocking=True)

    copy_t = _timed(round_trip, device, args.steps)
    hvd.barrier()
    allreduce_t = _timed(lambda: hvd.allreduce_(x, op=hvd.Sum, name="staged"), device, args.steps)
    paths = hvd.device_paths()  # (which path the ops took, for the table)
    me = hvd.rank()
    hvd.shutdown()
    result = {"copy_round_trip": copy_t, "allreduce": allreduce_t, "paths": paths}
    return result if me == 0 else {}


def worker_collectives(args) -> dict:
    import torch

    device = None
    if args.peer == "ours":
        import horovod.torch as hvd

        hvd.init()
        device = _device(args.standin)
        n, me = hvd.size(), hvd.rank()
        barrier: Any = hvd.barrier

        def ops(x, part):
            return {
                "allreduce": lambda: hvd.allreduce_(x, op=hvd.Sum, name="c.ar"),
                "allgather": lambda: hvd.allgather(part, name="c.ag"),
                "broadcast": lambda: hvd.broadcast_(x, 0, name="c.bc"),
            }
    else:
        import torch.distributed as tdist

        backend = "gloo" if args.standin or int(os.environ["WORLD_SIZE"]) > 1 else "nccl"
        if not args.standin:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        tdist.init_process_group(backend)
        device = torch.device("cpu") if args.standin else torch.device("cuda")
        n, me = tdist.get_world_size(), tdist.get_rank()
        barrier = tdist.barrier

        def ops(x, part):
            gathered = torch.empty(part.numel() * n, device=device)
            return {
                "allreduce": lambda: tdist.all_reduce(x),
                "allgather": lambda: tdist.all_gather_into_tensor(gathered, part),
                "broadcast": lambda: tdist.broadcast(x, 0),
            }

    out = {}
    for nbytes in args.sizes:
        x = torch.ones(nbytes // 4, device=device)
        part = torch.ones(max(1, nbytes // 4 // n), device=device)
        for op, fn in ops(x, part).items():
            barrier()
            out[f"{op}:{nbytes}"] = _timed(fn, device, args.steps)
    if args.peer == "ours":
        hvd.shutdown()
    else:
        tdist.destroy_process_group()
    return out if me == 0 else {}


WORKERS = {
    "optimizer": worker_optimizer,
    "staged": worker_staged,
    "collectives": worker_collectives,
}


# ---------------------------------------------------------------------------- driver
def _run(
    launcher: str, np_: int, worker: str, args, extra: list[str], env: dict | None = None
) -> dict:
    out_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    module_args = [
        "horovod.benchmarks.gpu",
        "--worker",
        worker,
        "--out",
        out_file,
        "--steps",
        str(args.steps),
        "--sizes",
        ",".join(map(str, args.sizes)),
        "--staged-bytes",
        str(args.staged_bytes),
        *(["--standin"] if args.standin else []),
        *extra,
    ]
    env = {**({"HOROVOD_DEVICE_PLANE_TEST": "gloo"} if args.standin else {}), **(env or {})}
    launch.run(launcher, np_, module_args, extra_env=env)
    with open(out_file) as f:
        data = json.load(f)
    os.unlink(out_file)
    return data


def _gpu_name(standin: bool) -> str:
    if standin:
        return "none (stand-in on CPU tensors: figures say nothing about GPUs)"
    import torch

    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standin", action="store_true", help="CPU tensors, Gloo for NCCL")
    ap.add_argument("--steps", type=int, default=30, help="timed calls per figure")
    ap.add_argument("--sizes", default=f"{MIB},{16 * MIB},{64 * MIB}")
    ap.add_argument("--staged-bytes", type=int, default=64 * MIB)
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--peer", default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    if args.worker:
        result = WORKERS[args.worker](args)
        if result:
            with open(args.out, "w") as f:
                json.dump(result, f)
        return 0
    if not args.standin:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA GPU here: run with --standin to check the benchmark on CPU tensors")
            return 2
    print(f"GPU: {_gpu_name(args.standin)}   date: {datetime.date.today()}")
    opt = _run("horovodrun", 1, "optimizer", args, [])
    ratio = opt["horovod"] / opt["plain"]
    print(
        f"optimizer step, 1 rank: plain {opt['plain'] * 1e3:.2f} ms, DistributedOptimizer "
        f"{opt['horovod'] * 1e3:.2f} ms: {ratio:.3f}x the plain step (target <= 1.05)"
    )
    mb = args.staged_bytes / MIB
    # The staged path (asked for: two ranks on one GPU take the shared-GPU path by default),
    # then the shared-GPU path (on the stand-in: every rank of the host on one device).
    for label, env in (
        ("staged", {"HOROVOD_GPU_OPERATIONS": "staged"}),
        ("shared-GPU", {"HOROVOD_DEVICE_PLANE_TEST": "shared"} if args.standin else {}),
    ):
        st = _run("horovodrun", 2, "staged", args, [], env)
        copy_bw = args.staged_bytes / st["copy_round_trip"] / 1e9
        ar_bw = args.staged_bytes / st["allreduce"] / 1e9
        print(
            f"{label} allreduce, 2 ranks on one GPU, {mb:.0f} MiB: {st['allreduce'] * 1e3:.2f} ms "
            f"({ar_bw:.2f} GB/s) against a host<->device round trip of {copy_bw:.2f} GB/s: "
            f"{ar_bw / copy_bw:.0%} (staged target >= 70%; paths taken {st['paths']})"
        )
    print("\ncollectives on device tensors (median ms; ratio > 1: pyhorovod faster)")
    print(f"{'ranks':>5} {'op':>10} {'size':>8} {'pyhorovod':>10} {'torch':>10} {'ratio':>6}  peer")
    for np_ in (1, 2):
        peer = "Gloo" if args.standin or np_ > 1 else "NCCL"
        ours = _run("horovodrun", np_, "collectives", args, ["--peer", "ours"])
        theirs = _run("torchrun", np_, "collectives", args, ["--peer", "torch"])
        for key in ours:
            op, nbytes = key.split(":")
            a, b = ours[key], theirs[key]
            print(
                f"{np_:>5} {op:>10} {int(nbytes) // MIB:>5}MiB {a * 1e3:>10.3f} {b * 1e3:>10.3f} "
                f"{b / a:>6.2f}  torch.distributed {peer}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
