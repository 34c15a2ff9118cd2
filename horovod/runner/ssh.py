"""Starting workers on other hosts: the ssh command line, the payload the remote supervisor
(``horovod.runner.remote``) reads from standard input, the reachability check and the choice of
addresses. Pure functions where possible, so they are unit-tested without a network.

Must not touch: the training runtime; ssh configuration beyond the options it is given.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from horovod.common.net import address_towards, ipv4_addresses
from horovod.runner.remote import MAGIC

# Never copied from the launcher's environment into workers (upstream's rule).
NOT_EXPORTED = re.compile(r"^(BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES|HOROVOD_SECRET_KEY)$")
# Describe the launcher's own login session or host-local paths: remote workers keep their own.
HOST_LOCAL = re.compile(r"^(SSH_.*|HOSTNAME|PWD|SHLVL|_|TMPDIR|XDG_RUNTIME_DIR|DISPLAY|TERM)$")

SSH_OPTIONS = (
    "-o",
    "PasswordAuthentication=no",
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
)
# ssh gives up on a host after this many unanswered keep-alives (a host that left the network).
KEEPALIVE_COUNT = 3


def exportable(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not NOT_EXPORTED.match(k)}


def host_only(environ: Mapping[str, str]) -> dict[str, str]:
    """What ``exportable`` leaves out that workers on the launcher's own host inherit (the
    GPUs it sees); never the launcher's own job secret."""
    return {
        k: v
        for k, v in environ.items()
        if NOT_EXPORTED.match(k) and k != "HOROVOD_SECRET_KEY" and not k.startswith("BASH_FUNC_")
    }


def ssh_command(
    host: str,
    remote: str,
    *,
    port: int | None = None,
    identity: str | None = None,
    keepalive_seconds: float = 5.0,
) -> list[str]:
    """``ssh ... host remote``: no password prompts (BatchMode), no host-key prompt (as
    upstream), and keep-alives so a host that drops off the network ends its ssh in about
    ``keepalive_seconds * 3``."""
    argv = ["ssh", *SSH_OPTIONS]
    if keepalive_seconds > 0:
        argv += [
            "-o",
            f"ServerAliveInterval={max(1, round(keepalive_seconds))}",
            "-o",
            f"ServerAliveCountMax={KEEPALIVE_COUNT}",
        ]
    if port is not None:
        argv += ["-p", str(port)]
    if identity is not None:
        argv += ["-i", identity]
    return [*argv, host, remote]


def supervisor_command(python: str = sys.executable) -> str:
    """The remote shell command: the supervisor under the launcher's interpreter path (pyhorovod
    must be installed at the same path on every host, as upstream requires of horovod)."""
    return f"exec {shlex.quote(python)} -m horovod.runner.remote"


def payload(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> bytes:
    """The JSON line written to the supervisor's standard input (over ssh's encrypted channel:
    the secret never appears on a command line)."""
    carried = {k: v for k, v in env.items() if not HOST_LOCAL.match(k)}
    line = json.dumps({"magic": MAGIC, "cwd": cwd, "env": carried, "argv": list(argv)})
    return line.encode() + b"\n"


def check_reachable(
    hosts: Sequence[str],
    *,
    port: int | None = None,
    identity: str | None = None,
    timeout: float = 30.0,
) -> dict[str, str]:
    """Runs ``ssh host true`` on every host at once; returns ``{host: why}`` for those that
    failed (ssh's last line of error output)."""

    def probe(host: str) -> tuple[str, str | None]:
        argv = ssh_command(host, "true", port=port, identity=identity, keepalive_seconds=0)
        try:
            r = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except FileNotFoundError:
            return host, "the ssh client is not installed on this machine"
        except subprocess.TimeoutExpired:
            return host, f"no answer within {timeout:.0f} s"
        if r.returncode == 0:
            return host, None
        lines = [x for x in r.stderr.decode("utf-8", "replace").splitlines() if x.strip()]
        return host, (lines[-1] if lines else f"ssh exited with code {r.returncode}")

    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as ex:
        results = list(ex.map(probe, hosts))
    return {h: why for h, why in results if why is not None}


def resolve(host: str) -> str:
    """The IPv4 address of ``host``; ValueError names the host that does not resolve."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        raise ValueError(
            f"host {host!r} does not resolve to an IPv4 address; check the name in -H/--hostfile"
        ) from None


def launcher_address(remote_hosts: Sequence[str], nics: Sequence[str]) -> str:
    """The address remote workers use to reach the launcher's rendezvous store: the address of
    the first of ``nics`` this machine has, else the one the kernel routes towards the first
    remote host (every remote host is checked to be reachable from that interface's side by the
    workers' own connections)."""
    if nics:
        mine = ipv4_addresses()
        for nic in nics:
            if nic in mine:
                return mine[nic]
        raise ValueError(
            f"none of the network interfaces {', '.join(nics)} has an IPv4 address on this "
            f"machine (it has: {', '.join(sorted(mine))})"
        )
    return address_towards(resolve(remote_hosts[0]))


def routable_address(nics: Sequence[str]) -> str:
    """For jobs whose hosts are not known yet (elastic discovery): an address other hosts can
    reach this machine at: the first of ``nics`` it has, else its first non-loopback IPv4
    address, else the loopback address (a machine without a network)."""
    if nics:
        return launcher_address([], nics)
    for addr in ipv4_addresses().values():
        if not addr.startswith("127."):
            return addr
    return "127.0.0.1"


def cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"
