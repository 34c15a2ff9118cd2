"""What the device plane's tests share: the stand-in settings, the scenario of every
collective, and a job under the real horovodrun."""

from __future__ import annotations

import torch

import horovod.torch as hvd

STANDIN = {"HOROVOD_DEVICE_PLANE_TEST": "gloo"}
STAGED = {**STANDIN, "HOROVOD_GPU_OPERATIONS": "staged"}
SHARED = {"HOROVOD_DEVICE_PLANE_TEST": "shared"}  # every rank on one stand-in device


def device_plane():
    from horovod.core.context import current

    return current().engine.device_plane


def bits_of(t) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8]


def every_collective(rank: int) -> list[bytes]:
    """Every collective with its variants; every result as bytes."""
    g = torch.Generator().manual_seed(100 + rank)
    out: list[bytes] = []
    for dt in DTYPES:
        # Values whose sums and products are exact in every type: the process group and the
        # CPU planes add in different orders, and must still agree to the bit.
        # (drawn on the CPU and moved: under a GPU default device the generator stays a CPU one)
        base = torch.randint(0, 4, (5, 3), generator=g, device="cpu").to(torch.empty(0).device, dt)
        if dt.is_floating_point:
            base = base / 4
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            if dt == torch.uint8 and op in (hvd.Average, hvd.Product):
                continue
            out.append(bits_of(hvd.allreduce(base, op=op, name=f"ar.{dt}.{op}")))
        if dt.is_floating_point:
            out.append(
                bits_of(
                    hvd.allreduce(base, op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)
                )
            )
    flags = torch.tensor([rank == 0, True, False, rank == 1])
    for op in (hvd.Sum, hvd.Min, hvd.Max):
        out.append(bits_of(hvd.allreduce(flags, op=op)))
    # grouped (fused on the device), in place
    ts = [torch.arange(4.0) * (rank + 1), torch.ones(2, 2) * rank, torch.tensor([rank * 1.5])]
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    out += [bits_of(t) for t in ts]
    # allgather with rows that differ by rank, alone and grouped
    out.append(bits_of(hvd.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int64))))
    gs = hvd.grouped_allgather([torch.ones(rank + 2) * rank, torch.arange(2.0 * (rank + 1))])
    out += [bits_of(x) for x in gs]
    out.append(bits_of(hvd.allgather(torch.tensor([[rank, rank + 1]], dtype=torch.float16))))
    # broadcast from every root, in place too
    for root in range(hvd.size()):
        out.append(bits_of(hvd.broadcast(torch.arange(3.0) + rank, root)))
    b = torch.full((4,), float(rank))
    hvd.broadcast_(b, hvd.size() - 1)
    out.append(bits_of(b))
    # alltoall with uneven splits
    n = hvd.size()
    splits = torch.tensor([(rank + p) % 3 for p in range(n)], dtype=torch.int32)
    x = torch.arange(int(splits.sum()) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    got, recv = hvd.alltoall(x, splits=splits)
    out += [bits_of(got), bits_of(recv)]
    # reducescatter, rows not divisible by the size, alone and grouped
    out.append(bits_of(hvd.reducescatter(torch.arange(7.0) * (rank + 1), op=hvd.Sum)))
    out.append(bits_of(hvd.reducescatter(torch.arange(10.0).reshape(5, 2) + rank, op=hvd.Average)))
    rs = hvd.grouped_reducescatter([torch.ones(4) * rank, torch.arange(6.0) + rank])
    out += [bits_of(r) for r in rs]
    # Adasum (the staged path: its coefficients are computed on the host)
    out.append(bits_of(hvd.allreduce(torch.tensor([1.0, 2.0, 0.5]) * (rank + 1), op=hvd.Adasum)))
    return out


def horovodrun_script(tmp_path, np_: int, body: str, timeout: float = 180, env=None):
    import subprocess
    import sys
    import textwrap

    from conftest import REPO

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = dict(__import__("os").environ, PYTHONPATH=str(REPO), **(env or {}))
    cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", str(np_), sys.executable]
    return subprocess.run(
        cmd + [str(script)], capture_output=True, text=True, timeout=timeout, env=env
    )
