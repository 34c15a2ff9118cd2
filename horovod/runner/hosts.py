"""Host lists and rank placement, as upstream's ``horovod.runner.common.util.hosts``.

Must not touch: processes or the network (it computes placements).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from horovod.rendezvous.elastic import Seat

_HOST_RE = re.compile(r"^[\w.-]+:[0-9]+$")


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    slots: int


@dataclass(frozen=True)
class SlotInfo:
    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def env(self) -> dict[str, str]:
        seat = Seat(
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
            self.cross_rank,
            self.cross_size,
        )
        return {"HOROVOD_HOSTNAME": self.hostname, **seat.env()}


def parse_hosts(text: str) -> list[HostInfo]:
    """``host1:2,host2:4`` -> hosts in order; a bare ``host`` means one slot."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if ":" not in item:
            item += ":1"
        if not _HOST_RE.match(item):
            raise ValueError(
                f"Invalid host input {item!r}: use the format host:slots, e.g. "
                "-H worker-0:2,worker-1:2"
            )
        name, slots = item.rsplit(":", 1)
        if int(slots) <= 0:
            raise ValueError(f"host {name!r} has {slots} slots; give at least 1")
        hosts.append(HostInfo(name, int(slots)))
    if not hosts:
        raise ValueError("no hosts given: use -H host:slots[,host:slots...]")
    names = [h.hostname for h in hosts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(
            f"host(s) {', '.join(dup)} listed more than once; give each host once "
            "with its total number of slots"
        )
    return hosts


def parse_hostfile(path: str) -> list[HostInfo]:
    """Lines ``<host> slots=<n>`` (``slots=`` optional, default 1); ``#`` starts a comment."""
    hosts = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            slots = 1
            for p in parts[1:]:
                m = re.fullmatch(r"slots=(\d+)", p)
                if not m:
                    raise ValueError(f"{path}:{lineno}: expected '<host> slots=<n>', got {line!r}")
                slots = int(m.group(1))
            hosts.append(f"{parts[0]}:{slots}")
    return parse_hosts(",".join(hosts))


def assign_slots(hosts: list[HostInfo], num_proc: int) -> list[SlotInfo]:
    """Fill hosts in order, slots in order, for exactly ``num_proc`` processes."""
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        raise ValueError(
            f"Requested more processes ({num_proc}) than there are available slots "
            f"({total}); add hosts or slots with -H host:slots"
        )
    placed: list[tuple[str, int]] = []
    for h in hosts:
        for lr in range(h.slots):
            if len(placed) == num_proc:
                break
            placed.append((h.hostname, lr))
    local_size = {name: sum(1 for x, _ in placed if x == name) for name, _ in placed}
    order = list(dict.fromkeys(name for name, _ in placed))
    slots = []
    for rank, (name, lr) in enumerate(placed):
        with_lr = [x for x in order if local_size[x] > lr]
        slots.append(
            SlotInfo(name, rank, lr, with_lr.index(name), num_proc, local_size[name], len(with_lr))
        )
    return slots


def is_local(hostname: str) -> bool:
    """True if ``hostname`` names this machine."""
    if hostname in ("localhost", "127.0.0.1", "::1"):
        return True
    if hostname in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(hostname, None)}
    except OSError:
        return False
    import psutil

    mine = {a.address for addrs_ in psutil.net_if_addrs().values() for a in addrs_}
    return bool(addrs) and addrs <= mine | {"127.0.0.1", "::1"}


def lsf_hosts(environ) -> list[HostInfo] | None:
    """Under LSF (``bsub``), the job's hosts and slots from ``LSB_MCPU_HOSTS``
    (``"hostA 4 hostB 4"``); None outside LSF."""
    raw = environ.get("LSB_MCPU_HOSTS", "").split()
    if not raw:
        return None
    if len(raw) % 2:
        raise ValueError(f"cannot read LSB_MCPU_HOSTS={environ['LSB_MCPU_HOSTS']!r}")
    return parse_hosts(",".join(f"{raw[i]}:{raw[i + 1]}" for i in range(0, len(raw), 2)))
