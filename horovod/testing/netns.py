"""Test hosts made of Linux network namespaces, each with its own sshd.

``TestNetwork(["hostA", "hostB"])`` creates a "switch" namespace holding a bridge and one
namespace per host joined to it by a veth pair (``eth0`` inside the host), addresses in a private
/24 that exists only inside these namespaces, a host key and a client key made for the run, and
an ``sshd`` per host listening on the host's address only. ``/etc/netns/<ns>/hosts`` maps the
host names to their addresses and ``/etc/netns/<ns>/ssh/ssh_config`` keeps the test's host keys
out of ``~/.ssh/known_hosts`` (``ip netns exec`` mounts both over ``/etc`` inside the namespace).
``close()`` stops every sshd and removes every namespace and file it made.

Needs root, ``ip`` (iproute2) and ``/usr/sbin/sshd`` (openssh-server); ``unavailable()`` says
why not, for a clean skip.

Must not touch: the host's own network: only namespaces, files and sshd processes it made, all
removed by ``close()``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
_NETWORKS = itertools.count()  # networks made by this process
PORT = 2222


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    if not os.path.exists("/proc/self/ns/net") or os.geteuid() != 0:
        return "network namespaces need root on Linux"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or not shutil.which("ssh-keygen"):
        return "openssh-server/openssh-client are not installed"
    probe = f"hvdprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TestNetwork:
    __test__ = False  # not a pytest class

    def __init__(
        self, hosts: list[str], without_sshd: tuple[str, ...] = (), hostnames: bool = False
    ) -> None:
        self.hosts = hosts
        self.without_sshd = without_sshd
        # Each host also gets a UTS namespace whose host name is its own (its sshd's sessions
        # and ``exec`` inherit it): software that tells hosts apart by ``gethostname()``, as
        # Open MPI does, then sees several hosts and not one.
        self.hostnames = hostnames
        # (names and subnet unique per network: a process may hold several at once)
        k = next(_NETWORKS)
        tag = f"{os.getpid() % 100000}" + (chr(ord("a") + k % 26) if k else "")
        self.tag = tag
        self.switch = f"hvd{tag}sw"
        self.ns = {h: f"hvd{tag}h{i}" for i, h in enumerate(hosts)}
        self.subnet = f"10.{213 + k % 40}.{os.getpid() % 250}"
        self.addr = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self.dir = tempfile.mkdtemp(prefix="hvd-netns-")
        self.key = os.path.join(self.dir, "id_test")
        self.sshd: dict[str, subprocess.Popen] = {}
        self._made_run_sshd = False
        self._etc: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            ns = self.ns[h]
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                f"hvd{self.tag}v{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            port = f"hvd{self.tag}v{i}"
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key],
            check=True,
            capture_output=True,
        )
        host_key = os.path.join(self.dir, "host_key")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key],
            check=True,
            capture_output=True,
        )
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.addr[h]} {h}\n" for h in self.hosts)
        for h in self.hosts:
            etc = f"/etc/netns/{self.ns[h]}"
            self._etc.append(etc)
            os.makedirs(os.path.join(etc, "ssh"), exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            with open(os.path.join(etc, "ssh", "ssh_config"), "w") as f:
                f.write(
                    "Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  GlobalKnownHostsFile /dev/null\n"
                    "  LogLevel ERROR\n"
                )
        if not os.path.isdir("/run/sshd"):
            os.makedirs("/run/sshd", mode=0o755)
            self._made_run_sshd = True
        served = [h for h in self.hosts if h not in self.without_sshd]
        for h in served:
            cfg = os.path.join(self.dir, f"sshd_{h}.conf")
            with open(cfg, "w") as f:
                f.write(
                    f"Port {PORT}\nListenAddress {self.addr[h]}\nHostKey {host_key}\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin yes\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    f"StrictModes no\nPidFile {self.dir}/sshd_{h}.pid\nClientAliveInterval 1\n"
                    "ClientAliveCountMax 3\nMaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n"
                )
            with open(os.path.join(self.dir, f"sshd_{h}.log"), "w") as log:
                self.sshd[h] = subprocess.Popen(
                    self.command(h, [SSHD, "-D", "-e", "-f", cfg]),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
        deadline = time.monotonic() + 15
        for h in served:
            while True:
                r = self.exec(self.hosts[0], ["ssh", *self.ssh_args(), h, "true"], timeout=15)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    with open(os.path.join(self.dir, f"sshd_{h}.log")) as f:
                        told = f.read()
                    raise RuntimeError(f"sshd on {h} does not answer: {r.stderr}{told}")
                time.sleep(0.2)

    # ------------------------------------------------------------------ use
    def ssh_args(self) -> list[str]:
        return ["-p", str(PORT), "-i", self.key, "-o", "BatchMode=yes"]

    def launcher_args(self) -> list[str]:
        return ["-p", str(PORT), "-i", self.key]

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host`` (every step execs: the process keeps the first's pid)."""
        if self.hostnames:
            named = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh"]
            return ["ip", "netns", "exec", self.ns[host], *named, *argv]
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def exec(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, **kw)

    def shape(self, rate: str, delay: str) -> str:
        """Limit every host's link (``tc netem`` rate and delay each way; without netem, as on
        some VM kernels, a ``tbf`` rate and no added delay); returns what was applied."""
        shaped = f"{rate}, {delay} each way (tc netem)"
        for h in self.hosts:
            netem = "tc qdisc add dev eth0 root netem delay".split() + [delay, "rate", rate]
            r = self.exec(h, netem)
            if r.returncode != 0 and "unknown" in r.stderr.lower():
                tbf = "tc qdisc add dev eth0 root tbf rate".split() + [rate]
                tbf += "burst 256kb latency 50ms".split()
                subprocess.run(self.command(h, tbf), check=True)
                shaped = f"{rate} (tc tbf: this kernel has no netem, so no added delay)"
            elif r.returncode != 0:
                raise RuntimeError(f"tc failed on {h}: {r.stderr}")
        return shaped

    def link(self, host: str, up: bool) -> None:
        i = self.hosts.index(host)
        _ip(
            "-n",
            self.switch,
            "link",
            "set",
            f"hvd{self.tag}v{i}",
            "up" if up else "down",
        )

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        for p in self.sshd.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.sshd.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in [*self.ns.values(), self.switch]:
            _ip("netns", "del", ns, check=False)
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        if self._made_run_sshd:
            try:
                os.rmdir("/run/sshd")
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment contains ``marker`` (all namespaces share the
    pid namespace, so this sees every test host)."""
    found = []
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{name}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            found.append(int(name))
        except OSError:
            continue
    return found
