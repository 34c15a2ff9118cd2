"""What the profiler measures inside a Horovod job: a model's gradients per layer, each rank's
compute and communication time per step, the links between hosts (latency and bandwidth of
every pair of hosts, and within a host), and real steps with each method.

Must not touch: the engine (it uses the public API: collectives, process sets, the
optimizers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PROBE_BYTES = 8 << 20


def hosts_of_ranks(hvd: Any) -> list[list[int]]:
    """The ranks of each host, in order (horovodrun places a host's ranks consecutively)."""
    rows = hvd.allgather_object((hvd.rank(), hvd.local_rank()))
    hosts: list[list[int]] = []
    for rank, local in sorted(rows):
        if local == 0 or not hosts:
            hosts.append([])
        hosts[-1].append(rank)
    return hosts


def timed(fn: Callable[[], Any], repeats: int, hvd: Any, ps: Any = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, each after a barrier of ``ps``."""
    times = []
    for _ in range(repeats):
        hvd.barrier(process_set=ps) if ps is not None else hvd.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_pair(hvd: Any, a: int, b: int, repeats: int) -> tuple[float, float] | None:
    """(latency seconds, bytes per second) between ranks ``a`` and ``b``, measured by them (a
    collective call of every rank; None on the others)."""
    whole = sorted((a, b)) == list(range(hvd.size()))
    ps = hvd.global_process_set if whole else hvd.add_process_set([a, b])
    out = None
    if hvd.rank() in (a, b):
        import torch

        tiny = torch.zeros(1)
        big = torch.zeros(PROBE_BYTES // 4)
        for _ in range(3):
            hvd.allreduce(tiny, process_set=ps, name="probe.tiny")
            hvd.broadcast_(big, root_rank=a, process_set=ps, name="probe.big")
        lat = timed(
            lambda: hvd.allreduce(tiny, process_set=ps, name="probe.tiny"), repeats, hvd, ps
        )
        t = timed(
            lambda: hvd.broadcast_(big, root_rank=a, process_set=ps, name="probe.big"),
            max(3, repeats // 4),
            hvd,
            ps,
        )
        out = (lat, PROBE_BYTES / max(t - lat, 1e-9))
    hvd.barrier()
    if not whole:
        hvd.remove_process_set(ps)
    return out


def probe_links(hvd: Any, hosts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Every pair of hosts (their first ranks), and within the first host with two ranks."""
    pairs = [
        (f"host {i} - host {j}", hosts[i][0], hosts[j][0], "net")
        for i in range(len(hosts))
        for j in range(i + 1, len(hosts))
    ]
    within = next((h for h in hosts if len(h) > 1), None)
    if within is not None:
        pairs.append((f"within host {hosts.index(within)}", within[0], within[1], "local"))
    found = []
    for label, a, b, kind in pairs:
        got = probe_pair(hvd, a, b, repeats)
        # the receiver's figures: the sender may finish into its socket buffers
        figures = hvd.broadcast_object(got, root_rank=b)
        found.append(
            {
                "pair": label,
                "ranks": (a, b),
                "kind": kind,
                "latency_s": figures[0],
                "bytes_per_s": figures[1],
            }
        )
    return {"pairs": found}


def step_times(
    hvd: Any, model: Any, batch: Callable[[], tuple[Any, Any]], steps: int
) -> tuple[float, float]:
    """(compute seconds, communication seconds) per step on this rank: forward and backward
    alone, then one grouped allreduce of every gradient (what the optimizer sends)."""
    import torch

    loss_fn = torch.nn.functional.cross_entropy
    x, y = batch()

    def compute() -> None:
        model.zero_grad()
        loss_fn(model(x), y).backward()

    for _ in range(2):
        compute()
    t_compute = timed(compute, steps, hvd)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    hvd.grouped_allreduce(grads, name="profile.grads")
    t_comm = timed(lambda: hvd.grouped_allreduce(grads, name="profile.grads"), steps, hvd)
    return t_compute, t_comm


def achieved(
    hvd: Any,
    make_model: Callable[[], Any],
    batch: Callable[[], tuple[Any, Any]],
    method: str,
    steps: int,
) -> float:
    """Median seconds of a real training step with ``method`` (the optimizers users call)."""
    import torch

    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    name, _, arg = method.partition(":")
    C = hvd.Compression
    if name in ("localsgd", "diloco"):
        every = int(arg or 8)
        opt = hvd.LocalSGD(opt, every) if name == "localsgd" else hvd.DiLoCo(opt, every)
    else:
        comp = {
            "none": lambda: C.none,
            "fp16": lambda: C.fp16,
            "int8": lambda: C.int8,
            "topk": lambda: C.topk(float(arg or 0.01)),
            "powersgd": lambda: C.powersgd(rank=int(arg or 4)),
        }[name]()
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=comp
        )
    x, y = batch()

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    # Local SGD's cost comes every H steps: time whole periods
    if name in ("localsgd", "diloco"):
        every = int(arg or 8)

        def period() -> None:
            for _ in range(every):
                step()

        return timed(period, max(2, steps // every), hvd) / every
    return timed(step, steps, hvd)
