"""Local network facts shared by the launcher and the transports, and which machine (kernel)
a process runs on.

Must not touch: sockets of any transport or of the launcher (it only answers questions).
"""

from __future__ import annotations

import os
import socket

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def address_towards(addr: str) -> str:
    """The local IPv4 address the kernel would use to reach ``addr`` (no packet is sent);
    OSError if there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return str(s.getsockname()[0])


def ipv4_addresses() -> dict[str, str]:
    """``{interface: its first IPv4 address}`` on this machine."""
    import psutil

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                out[name] = a.address
                break
    return out


def machine_id() -> str:
    """What every process on this machine's kernel shares, whatever host name it is given:
    the kernel's boot id (network namespaces, containers and ``HOROVOD_HOSTNAME`` do not
    change it), or the host name where there is none."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def crowded(machines: list[str], me: int) -> bool:
    """Do more ranks run on rank ``me``'s machine (``machines``: each rank's ``machine_id``)
    than it has cores? Then waiting loops must yield the CPU: a rank polling for a peer's
    message would otherwise hold the core that peer needs. Test hosts made of network
    namespaces, or two host names given to one machine, count as the one machine they are."""
    here = machines.count(machines[me])
    return here > (os.cpu_count() or 1)
