"""Local network facts shared by the launcher and the transports.

Must not touch: sockets of any transport or of the launcher (it only answers questions).
"""

from __future__ import annotations

import socket


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
