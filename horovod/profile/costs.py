"""The alpha-beta cost model of the profiler: how long a step's communication takes, for a
model's gradients, a link (``alpha``: seconds per message, ``beta``: seconds per byte), a
layout (hosts x ranks per host) and a method.

A ring allreduce of B bytes over n ranks sends 2(n-1) messages of B/n: ``2(n-1) alpha +
2 (n-1)/n B beta``. Hierarchical: the ranks of a host reduce and broadcast over the host's own
link (``local``), and one rank per host runs the ring over the hosts. The compressors change
what travels (``horovod.frontend.lossy``): fp16 halves B; int8 and top-k are allgathered
(``(n-1) alpha + (n-1) payload beta``); PowerSGD runs two rings on its factors P and Q (and the
layers it leaves exact); Local SGD and DiLoCo run the plain ring every H steps.

Predicted step time = compute + communication (no overlap: an upper bound; the optimizer
overlaps the plain ring with the backward pass), scaling efficiency = compute / step.

Must not touch: anything but numbers (pure functions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

FLOAT = 4  # bytes of a float32 gradient element


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    @staticmethod
    def from_figures(latency_s: float, bytes_per_s: float) -> Link:
        return Link(latency_s, 1.0 / bytes_per_s if bytes_per_s > 0 else 0.0)


@dataclass(frozen=True)
class Layout:
    hosts: int
    per_host: int = 1

    @property
    def ranks(self) -> int:
        return self.hosts * self.per_host


def ring(nbytes: float, n: int, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta


def gather(payload: float, n: int, link: Link) -> float:
    """Every rank's ``payload`` to every other rank (an allgather)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha + (n - 1) * payload * link.beta


def allreduce(nbytes: float, layout: Layout, net: Link, local: Link, hierarchical: bool) -> float:
    if not hierarchical or layout.per_host == 1 or layout.hosts == 1:
        if layout.hosts == 1:
            return ring(nbytes, layout.per_host, local)
        # a flat ring over every rank: its slowest hops cross the network
        return ring(nbytes, layout.ranks, net)
    within = ring(nbytes, layout.per_host, local)  # reduce-scatter + allgather within a host
    return within + ring(nbytes, layout.hosts, net)


def powersgd_bytes(shapes: Sequence[tuple[int, ...]], rank: int) -> tuple[float, float]:
    """(bytes of P and the exact layers, bytes of Q) for PowerSGD of ``rank``."""
    p = q = 0.0
    for s in shapes:
        size = math.prod(s)
        if len(s) >= 2:
            rows, cols = s[0], size // s[0]
            if min(rows, cols) > rank and (rows + cols) * rank < rows * cols:
                p += rows * rank * FLOAT
                q += cols * rank * FLOAT
                continue
        p += size * FLOAT
    return p, q


def communication(
    method: str,
    shapes: Sequence[tuple[int, ...]],
    layout: Layout,
    net: Link,
    local: Link,
    hierarchical: bool = False,
) -> tuple[float, float]:
    """(seconds of communication per step, bytes each rank sends per step) of ``method``:
    ``none``, ``fp16``, ``int8``, ``topk:<ratio>``, ``powersgd:<rank>``, ``localsgd:<H>``."""
    name, _, arg = method.partition(":")
    total = sum(math.prod(s) for s in shapes) * FLOAT
    n = layout.ranks
    link = net if layout.hosts > 1 else local
    if name in ("none", "fp16", "localsgd", "diloco"):
        b = total / 2 if name == "fp16" else total
        every = float(arg or 8) if name in ("localsgd", "diloco") else 1.0
        t = allreduce(b, layout, net, local, hierarchical) / every
        return t, 2 * (n - 1) / n * b / every if n > 1 else 0.0
    if name == "int8":
        payload = total / FLOAT + math.ceil(total / FLOAT / 4096) * FLOAT
        return gather(payload, n, link), (n - 1) * payload
    if name == "topk":
        ratio = float(arg or 0.01)
        payload = sum(max(1, math.ceil(ratio * math.prod(s))) for s in shapes) * 2 * FLOAT
        return gather(payload, n, link), (n - 1) * payload
    if name == "powersgd":
        p, q = powersgd_bytes(shapes, int(arg or 4))
        t = allreduce(p, layout, net, local, hierarchical) + allreduce(
            q, layout, net, local, hierarchical
        )
        return t, 2 * (n - 1) / n * (p + q) if n > 1 else 0.0
    raise ValueError(
        f"unknown method {method!r}: use none, fp16, int8, topk:<ratio>, powersgd:<rank>, "
        "localsgd:<H> or diloco:<H>"
    )


def predict(
    method: str,
    shapes: Sequence[tuple[int, ...]],
    compute_s: float,
    layout: Layout,
    net: Link,
    local: Link,
    hierarchical: bool = False,
) -> tuple[float, float, float]:
    """(step seconds, scaling efficiency, bytes sent per rank and step)."""
    comm, sent = communication(method, shapes, layout, net, local, hierarchical)
    step = compute_s + comm
    return step, (compute_s / step if step > 0 else 1.0), sent
