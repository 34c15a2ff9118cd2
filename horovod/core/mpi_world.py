"""The job's MPI world: which communicator Horovod runs on, and the job's start-up over MPI.

A job is an MPI job when ``hvd.init(comm=...)`` names a communicator (an mpi4py ``Comm``, or a
list of ranks of ``MPI_COMM_WORLD``), when ``HOROVOD_CPU_OPERATIONS=mpi`` or
``HOROVOD_CONTROLLER=mpi`` asks for MPI (``horovodrun --mpi`` sets the first), or when
``mpirun`` started the workers without a rendezvous address, its runtime is there to join
(``runtime_present``) and mpi4py is installed (upstream's examples under ``mpirun -np 2 python
train.py``, unchanged). Then:

- Horovod's ranks are the communicator's; the communicator is duplicated, so Horovod's messages
  never match the user's own mpi4py traffic on it;
- rank 0 serves the rendezvous store and broadcasts its address and the job's key over MPI, so
  nothing has to be exported to the ranks (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT`` and
  ``HOROVOD_SECRET_KEY`` are used where set);
- with ``HOROVOD_CPU_OPERATIONS=mpi`` (or a communicator given to ``init``) the data plane is
  MPI (``horovod.transport.mpi``); otherwise the built-in planes move the data.

mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE`` (Horovod's engine thread and the user's
code may both call MPI); ``HOROVOD_MPI_THREADS_DISABLE=1`` asks for ``MPI_THREAD_SERIALIZED``
where Horovod is the first to import mpi4py.

Must not touch: the engine, the transports' internals (it hands the communicator to the MPI
plane), the environment (it returns the settings it implies).
"""

from __future__ import annotations

import importlib.util
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from horovod.common.config import setting
from horovod.common.exceptions import ConfigError
from horovod.common.net import address_towards

MPI_LAUNCHERS = ("Open MPI", "PMI")  # scheduler.detect's names of an mpirun launch


@dataclass
class MpiWorld:
    comm: Any  # Horovod's own duplicate of the job's communicator
    rank: int
    size: int
    data_plane: bool  # MPI moves the data (else the built-in planes do)
    env: dict[str, str]  # the HOROVOD_* settings this world implies
    server: Any = None  # rank 0's rendezvous server (stopped with the context)
    group: Any = None  # the communicator's group (process sets' ranks are translated to it)
    scope: str | None = None  # this init's scope in the rendezvous store (from rank 0)

    def assemble_sets(self, static: list[Any]) -> list[Any]:
        """The process sets to register, the same on every rank, from what each rank passed
        to ``init(process_sets=...)`` (collective). A set made from a communicator may differ
        between ranks (``COMM_WORLD.Split`` gives each rank its own half): every rank's sets
        are gathered, entry by entry in rank order, and a communicator's set that repeats an
        earlier set or the whole job is left out, as upstream (a list of ranks that repeats
        one stays an error, found in ``init``)."""
        if not any(ps.mpi_comm is not None for ps in static):
            return static
        from horovod.common.process_sets import ProcessSet

        mine = []
        for ps in static:
            if ps.mpi_comm is not None:
                ps.translate_to(self.group)
            mine.append((ps.ranks, ps.mpi_comm is not None))
        every = self.comm.allgather(mine)
        whole = list(range(self.size))
        final: list[list[int]] = []
        for i in range(max(len(x) for x in every)):
            for theirs in every:
                if i < len(theirs):
                    ranks, from_comm = theirs[i]
                    if ranks not in final and not (from_comm and ranks == whole):
                        final.append(ranks)
        # The rank's own objects where it passed the set (they get its id), new ones else.
        return [next((ps for ps in static if ps.ranks == r), None) or ProcessSet(r) for r in final]

    def take_comm(self) -> Any:
        """Hand the communicator to the MPI plane, which frees it when it closes."""
        comm, self.comm = self.comm, None
        return comm

    def close(self) -> None:
        """Free what the world still owns: the communicator (unless the plane took it) and
        rank 0's rendezvous server. Safe to call twice."""
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.Free()
        group, self.group = self.group, None
        if group is not None:
            group.Free()
        server, self.server = self.server, None
        if server is not None:
            server.stop()


def installed() -> bool:
    """Is mpi4py importable (without initialising MPI)?"""
    return "mpi4py" in sys.modules or importlib.util.find_spec("mpi4py") is not None


def wanted(env: Mapping[str, str], comm: Any, launcher: str | None) -> bool:
    """Does this job start over MPI (module docstring)?"""
    if comm is not None:
        return True
    if setting("cpu_operations", env) == "mpi" or setting("controller", env) == "mpi":
        return True
    return (
        launcher in MPI_LAUNCHERS
        and not setting("rendezvous_addr", env)
        and runtime_present(env)
        and installed()
    )


# Set by a live MPI runtime for the processes it starts: PMIx (Open MPI 4/5, Slurm's pmix),
# Open MPI 3's ORTE, Hydra's PMI (MPICH, Intel MPI).
RUNTIME_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "PMI_FD", "PMI_PORT")


def runtime_present(env: Mapping[str, str]) -> bool:
    """Is an MPI runtime there to join? Without one, mpi4py would start a world of one
    process (and leave its shared memory behind), so the launcher's variables are read as
    before instead."""
    return any(env.get(v) for v in RUNTIME_VARIABLES)


def mpi(env: Mapping[str, str] | None = None) -> Any:
    """mpi4py's MPI module, importing (and so initialising MPI) on first use."""
    if not installed():
        raise ConfigError(
            "this job asks for MPI (hvd.init(comm=...), HOROVOD_CPU_OPERATIONS=mpi or "
            "horovodrun --mpi) but mpi4py is not installed: pip install 'pyhorovod[mpi]' "
            "(mpi4py and Open MPI), or leave the job on the built-in planes"
        )
    if "mpi4py.MPI" not in sys.modules and setting("mpi_threads_disable", env):
        import mpi4py

        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    return MPI


def _communicator(MPI: Any, comm: Any) -> Any:
    """Horovod's own duplicate of the communicator ``init`` was given (or the world's)."""
    world = MPI.COMM_WORLD
    if comm is None:
        return world.Dup()
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("hvd.init(comm=...) got MPI.COMM_NULL: this process is not in it")
        return comm.Dup()
    try:
        ranks = [int(r) for r in comm]
    except (TypeError, ValueError):
        raise ValueError(
            f"hvd.init(comm=...) takes an mpi4py communicator or a list of ranks of "
            f"MPI_COMM_WORLD, not {type(comm).__name__}"
        ) from None
    n = world.Get_size()
    bad = [r for r in ranks if not 0 <= r < n]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(
            f"hvd.init(comm={ranks}): ranks must be distinct ranks of MPI_COMM_WORLD "
            f"(0..{n - 1}), at least one"
        )
    me = world.Get_rank()
    if me not in ranks:
        raise ValueError(
            f"hvd.init(comm={ranks}) on rank {me} of MPI_COMM_WORLD, which is not among "
            "them: call hvd.init only on the listed ranks"
        )
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def connect(
    env: Mapping[str, str], comm: Any, launcher: str | None, launch: Mapping[str, str] | None = None
) -> MpiWorld:
    """Build the world; collective over the communicator's processes. ``launch``: the
    settings the launcher's variables imply (``scheduler.detect``), checked against MPI's."""
    MPI = mpi(env)
    n = MPI.COMM_WORLD.Get_size()
    if launcher is not None and launch and comm is None and int(launch["HOROVOD_SIZE"]) != n:
        raise ConfigError(
            f"this worker was started by {launcher} (rank {launch['HOROVOD_RANK']} of "
            f"{launch['HOROVOD_SIZE']}, from its environment) but MPI sees {n} process(es): "
            "mpi4py does not talk to the MPI that started it (install mpi4py against that "
            "MPI). To start without MPI, set HOROVOD_GLOO_RENDEZVOUS_ADDR to the host name "
            "or address of rank 0's machine on every rank"
        )
    ops = setting("cpu_operations", env)
    # Unset: MPI moves the data of a job on a communicator given to init; gloo (or ccl, which
    # this build does not have) keeps the built-in planes.
    data_plane = ops == "mpi" or (not ops and comm is not None)
    if launcher is None and MPI.COMM_WORLD.Get_size() == 1 and comm is None:
        size = setting("size", env)
        if size > 1:
            raise ConfigError(
                f"HOROVOD_CPU_OPERATIONS=mpi, but MPI sees this process alone while the job "
                f"has {size} ranks: these workers were not started by mpirun. Start the job "
                "with `horovodrun --mpi ...` or `mpirun -np N ...`, or drop "
                "HOROVOD_CPU_OPERATIONS=mpi to use the built-in planes"
            )
    own = _communicator(MPI, comm)
    rank, size = own.Get_rank(), own.Get_size()
    names = own.allgather(setting("hostname", env) or socket.gethostname())
    local = [r for r, h in enumerate(names) if h == names[rank]]
    out = {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local.index(rank)),
        "HOROVOD_LOCAL_SIZE": str(len(local)),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": names[rank],
    }
    world = MpiWorld(own, rank, size, data_plane, out, group=own.Get_group())
    if size == 1:
        return world
    offer = None
    try:
        if rank == 0:
            world.server, offer = _serve(env, names)
    finally:
        # Always answer the broadcast: the other ranks wait in it.
        got = own.bcast(offer, root=0)
    if got is None:
        raise ConfigError("rank 0 could not serve the job's rendezvous (see its error)")
    addr, port, key, world.scope = got
    out.update(
        {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_SECRET_KEY": key,
        }
    )
    return world


def _serve(env: Mapping[str, str], names: list[str]) -> tuple[Any, tuple[str, int, str, str]]:
    """Rank 0: start the rendezvous server; (server, (address, port, key)) for the others."""
    from horovod.rendezvous.server import RendezvousServer

    key = setting("secret_key", env) or secrets.token_hex(32)
    addr = setting("rendezvous_addr", env)
    single_host = len(set(names)) == 1
    if not addr:
        addr = "127.0.0.1" if single_host else _address(env, names)
    host = "127.0.0.1" if addr == "127.0.0.1" else "0.0.0.0"
    port = setting("rendezvous_port", env)
    try:
        server = RendezvousServer(bytes.fromhex(key), host=host, port=max(port, 0)).start()
    except OSError as e:
        raise ConfigError(
            f"rank 0 cannot serve the rendezvous on port {port} ({e.strerror or e}); set "
            "HOROVOD_GLOO_RENDEZVOUS_PORT to a free port, or leave it unset"
        ) from None
    # The init's own scope in the store: ranks agree on it whatever each did before.
    return server, (addr, server.port, key, f"mpi-{secrets.token_hex(8)}")


def _address(env: Mapping[str, str], names: list[str]) -> str:
    """The address of rank 0 that ranks on other hosts reach: the interface named by
    HOROVOD_GLOO_IFACE, else the one this host routes to another rank's host through."""
    iface = setting("iface", env)
    if iface:
        from horovod.transport.tcp import interface_address

        return str(interface_address(iface))
    other = next(h for h in names if h != names[0])
    try:
        return address_towards(socket.gethostbyname(other))
    except OSError as e:
        raise ConfigError(
            f"rank 0 cannot find its address towards {other} ({e}); set "
            "HOROVOD_GLOO_RENDEZVOUS_ADDR to rank 0's address, or HOROVOD_GLOO_IFACE to the "
            "interface the ranks share"
        ) from None
