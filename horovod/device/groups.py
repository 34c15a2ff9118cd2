"""Which path a process set's device collectives take, and the torch process group they use.

``choose_path`` decides from what every rank of the set reports about itself
(``describe_self``: its host, its GPU's identity, whether NCCL is present) and the settings:
the same inputs on every rank give every rank the same paths. ``bootstrap`` makes a torch
process group (``ProcessGroupNCCL``; ``ProcessGroupGloo`` in the stand-in) for the set's ranks
without ``torch.distributed``'s global state, torchrun or ``MASTER_ADDR``: the set's first
rank serves a ``TCPStore`` on a free port and sends its address to the others over the set's
own CPU view.

Must not touch: collectives, streams, the engine.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod.collectives import algorithms as alg
from horovod.core.messages import ALLGATHER, ALLREDUCE, BROADCAST

STAGED_SETTINGS = ("staged", "mpi", "gloo")
# what ranks sharing one GPU run through each other's device memory (``device.ipc``)
SHARED_GPU_OPS = frozenset({ALLREDUCE, ALLGATHER, BROADCAST})


def describe_self(device: torch.device, backend: str, shared_standin: bool = False) -> bytes:
    """This rank's record for ``choose_path``: its GPU, whether NCCL is there, and how it
    can share memory with ranks on the same GPU (``ipc``: CUDA IPC between processes, or the
    stand-in's host memory)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ident = str(getattr(props, "uuid", "")) or f"cuda:{device.index}"
        ok = dist.is_nccl_available()
        ipc = f"cuda:{os.getpid()}"
    else:  # the stand-in: each rank is a device of its own (or, shared, one per host)
        ident = "standin:shared" if shared_standin else f"standin:{uuid.uuid4()}"
        ok = backend == "gloo" and dist.is_gloo_available()
        ipc = "host"
    return json.dumps({"device": ident, "backend_ok": ok, "ipc": ipc}).encode()


def choose_path(
    records: Sequence[bytes], hosts: Sequence[str] | None, settings: Mapping[int, str]
) -> tuple[dict[int, str], str]:
    """``({op: "device" | "shared" | "staged"}, why the device path is out or "")``.

    ``shared`` (``device.ipc``): every rank of the set on one GPU of one host, each a process
    of its own (CUDA IPC cannot open a process's own memory), for the ops it has."""
    infos = [json.loads(r) for r in records]
    hosts = list(hosts) if hosts else ["localhost"] * len(infos)
    why = ""
    missing = [r for r, info in enumerate(infos) if not info["backend_ok"]]
    if missing:
        why = f"NCCL is not available on rank(s) {missing} of the set"
    else:
        seen: dict[tuple[str, str], int] = {}
        for r, (h, info) in enumerate(zip(hosts, infos, strict=True)):
            other = seen.setdefault((h, info["device"]), r)
            if other != r:
                why = f"ranks {other} and {r} share one GPU on host {h} (NCCL needs a GPU per rank)"
                break
    one_gpu = len({(h, info["device"]) for h, info in zip(hosts, infos, strict=True)}) == 1
    ipcs = [info.get("ipc", "") for info in infos]
    shared = (
        len(infos) > 1
        and one_gpu
        and all(ipcs)
        and (all(i == "host" for i in ipcs) or len(set(ipcs)) == len(ipcs))
    )

    def path(op: int, setting: str) -> str:
        if setting in STAGED_SETTINGS:
            return "staged"
        if shared and op in SHARED_GPU_OPS:
            return "shared"
        return "staged" if why else "device"

    return {op: path(op, setting) for op, setting in settings.items()}, why


def bootstrap(
    view: Any,
    backend: str,
    device: torch.device,
    timeout: datetime.timedelta,
    address: str,
    tag: str,
) -> tuple[Any, Any]:
    """A process group of ``view``'s ranks (collective over the view); ``(group, store)``."""
    me, n = view.rank, view.size
    msg = np.zeros(256, np.uint8)
    master = None
    if me == 0:
        master = dist.TCPStore(address, 0, n, True, timeout=timeout, wait_for_workers=False)
        text = f"{address}\n{master.port}".encode()
        msg[: len(text)] = np.frombuffer(text, np.uint8)
    if n > 1:
        alg.broadcast(view, msg, 0)
    host, port = bytes(msg).rstrip(b"\0").decode().split("\n")
    store = master or dist.TCPStore(host, int(port), n, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"horovod/{tag}/", store)
    pg: Any
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        with torch.cuda.device(device):
            pg = dist.ProcessGroupNCCL(prefixed, me, n, opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, me, n, timeout)
    return pg, store
