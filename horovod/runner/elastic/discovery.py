"""Where an elastic job's hosts come from: a fixed list (``-H``/``--hostfile`` with
``--min-np``: fault tolerance without scaling) or a discovery script run again and again.

A discovery script prints one host per line, ``host:slots`` or ``host`` (then ``--slots``
slots). Empty output means no hosts yet. A failing script is fatal the first time (the job
cannot start) and a warning later (the last good answer stands).

Must not touch: processes other than the discovery script.
"""

from __future__ import annotations

import subprocess
import sys

from horovod.runner.hosts import HostInfo, parse_hosts

SCRIPT_TIMEOUT_S = 30.0


class DiscoveryError(RuntimeError):
    pass


class FixedHosts:
    def __init__(self, hosts: list[HostInfo]) -> None:
        self.hosts = list(hosts)

    def find(self) -> list[HostInfo]:
        return list(self.hosts)


class ScriptDiscovery:
    def __init__(self, script: str, default_slots: int | None) -> None:
        self.script = script
        self.default_slots = default_slots
        self.last: list[HostInfo] | None = None

    def find(self) -> list[HostInfo]:
        try:
            out = subprocess.run(
                self.script,
                shell=True,
                capture_output=True,
                timeout=SCRIPT_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return self._failed(f"it ran longer than {SCRIPT_TIMEOUT_S:g} s")
        if out.returncode != 0:
            why = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            return self._failed(f"exit code {out.returncode}{': ' + why[0] if why[0] else ''}")
        try:
            hosts = parse_lines(out.stdout.decode(errors="replace"), self.default_slots)
        except ValueError as e:
            return self._failed(str(e))
        self.last = hosts
        return hosts

    def _failed(self, why: str) -> list[HostInfo]:
        msg = f"host discovery script {self.script!r} failed: {why}"
        if self.last is None:
            raise DiscoveryError(msg)
        print(f"horovodrun: warning: {msg}; keeping the last hosts it found", file=sys.stderr)
        return self.last


def parse_lines(text: str, default_slots: int | None) -> list[HostInfo]:
    items = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if ":" not in line:
            if default_slots is None:
                raise ValueError(
                    f"line {line!r} gives no slots: print host:slots, or pass --slots N"
                )
            line = f"{line}:{default_slots}"
        items.append(line)
    return parse_hosts(",".join(items)) if items else []
