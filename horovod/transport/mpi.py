"""The MPI data plane: MPI's own collectives (mpi4py) for the data, the project's engine for
everything else.

``MpiPlane`` owns Horovod's communicator (a duplicate of the job's, so the user's own mpi4py
traffic never matches ours) and runs MPI's blocking collectives on it (``MpiCollectives``: the
algorithms prefer them where MPI has the operation for the buffer's type; the non-blocking
forms, Open MPI's libnbc, measured 2.5-3.5x slower for 1-64 MiB). The plane is attached to the
job's transport as ``native``: on one host that is the shared-memory transport, whose control
messages and peer rounds keep small operations at shared-memory latency; otherwise
``MpiTransport``, whose point-to-point messages go through MPI as well (``Isend``/``Irecv``,
matched in posting order, the contract's rule) and whose control messages go through the TCP
star it is given; ``MpiPolledTransport`` puts that star under the polling thread, with the
engine's peer rounds over TCP board connections, as in a job over TCP alone. Negotiation,
the response cache, fusion, the timeline and error reports are the engine's on every plane.

A blocking MPI call cannot be interrupted. The plane checks for an abort before each call, and
a watchdog thread (while a call is in progress) warns when one has run for the stall-check
time, and ends the whole MPI job with ``MPI_Abort`` when one outlives the stall shutdown time,
or when the transport was aborted (a peer lost on the control plane) and the call has not
returned a few seconds later: an MPI job never hangs silently. (A rank that dies is also seen by
``mpirun``, which ends the job.)

Process sets get sub-communicators (``MPI_Comm_create_group``, collective over the set's members
only), made when the set first runs an operation natively: every member runs the same responses
in the same order, so they all create it at the same point. Hierarchical allreduce and allgather
(``HOROVOD_HIERARCHICAL_*``) run on a host communicator (MPI moves that data through shared
memory) and a leaders' communicator.

On one host, the operations that the shared-memory transport's own algorithms move faster
than MPI's collectives do (large allreduces and reduce-scatters, two-rank broadcasts:
``OWN_FROM``) go there instead (``MpiCollectives.takes``); with ``HOROVOD_SHARED_MEMORY=0``
every byte goes through MPI.

Must not touch: the engine, negotiation, other planes (it sees a transport only through the
``Transport`` contract), mpi4py's initialisation (the job's world does that).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common import log
from horovod.common.exceptions import TransportError
from horovod.transport import tcp_board
from horovod.transport.base import CtrlHandler, Message, Transport
from horovod.transport.tcp import TcpTransport
from horovod.transport.tcp_polled import PolledTcpTransport

# Buffer types MPI reduces natively (mpi4py maps them; float16 is Open MPI's MPIX_C_FLOAT16).
# Others (bool, bfloat16) run the project's algorithms over the transport's point-to-point.
REDUCIBLE = frozenset("ebBhHiIlLqQfd")
ABORT_GRACE_S = 5.0  # after an abort, how long a blocking call may go on before MPI_Abort
# On one host (the plane attached to the shared-memory transport): the operations of at least
# this many bytes that the project's own algorithms over shared memory run instead of MPI.
# Timed in one job, switching between the two ways every ten calls (docs/mpi.md, "On one
# host"): allreduces 1.14-3.6x faster from 8 MiB (Open MPI 5, MPICH and Intel MPI at 2 ranks,
# Open MPI at 3), where at 4 MiB Open MPI's was 1.16x faster at 2 ranks; reduce-scatters
# 1.25-5.6x from 1 MiB; broadcasts between two ranks (the plane's single copy) 1.24-1.94x
# from 4 MiB, where over three ranks Open MPI's was up to 1.15x faster. Allgathers (Open
# MPI's 1.1-1.5x faster from 8 MiB), alltoalls (even) and barriers stay MPI's.
OWN_FROM = {"allreduce": 8 << 20, "reduce_scatter": 1 << 20}
OWN_BROADCAST_FROM = 4 << 20  # (two-rank sets only)


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class MpiPlane:
    """Horovod's communicator and the blocking calls made on it (module docstring).
    ``aborted`` tells whether the transport the plane is attached to was aborted."""

    kind = "MPI"

    def __init__(
        self,
        comm: Any,
        aborted: Callable[[], str | None],
        warn_s: float = 0.0,
        shutdown_s: float = 0.0,
    ) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._aborted = aborted
        self._warn_s, self._shutdown_s = warn_s, shutdown_s
        self._busy: tuple[str, float] | None = None  # (what, since) of the call in progress
        self._abort_seen: float | None = None
        self._wake = threading.Event()
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._subsets: dict[tuple[int, ...], MpiCollectives] = {}
        # The job's ranks share one host and the transport's own algorithms move its data
        # through shared memory: large operations go there (``OWN_FROM``; set by ``attach``).
        self.one_host = False
        self.world = MpiCollectives(self, _Lazy(lambda: comm), self.size)

    # ------------------------------------------------------------------ calls
    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run one blocking MPI call (``what`` names it for the watchdog's report)."""
        why = self._aborted()
        if why is not None:
            raise TransportError(why)
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, daemon=True, name=f"horovod-mpi-watchdog-{self.rank}"
            )
            self._watchdog.start()
        self._busy = (what, time.monotonic())
        try:
            fn(*args, **kwargs)
        finally:
            self._busy = None

    def wait(self, requests: list[Any]) -> None:
        """Complete non-blocking point-to-point requests, polling so that an abort ends the
        wait with ``TransportError``."""
        MPI = _mpi()
        while not MPI.Request.Testall(requests):
            why = self._aborted()
            if why is not None:
                raise TransportError(why)

    def _watch(self) -> None:
        warned: tuple[str, float] | None = None
        while not self._closed:
            self._wake.wait(1.0)
            busy = self._busy
            if busy is None or self._closed:
                continue
            what, since = busy
            now = time.monotonic()
            late = now - since
            why = self._aborted()
            if why is not None and self._abort_seen is None:
                self._abort_seen = now
            if self._warn_s > 0 and late > self._warn_s and warned != busy:
                warned = busy
                log.logger.warning(
                    "rank %d: %s has been in MPI for %.0f s: a rank of this communicator may "
                    "be stuck (or stopped) before or inside it",
                    self.rank,
                    what,
                    late,
                )
            over = self._shutdown_s > 0 and late > self._shutdown_s
            gone = self._abort_seen is not None and now - self._abort_seen > ABORT_GRACE_S
            if over or gone:
                reason = (
                    f"{what} has not returned after {late:.0f} s "
                    f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self._shutdown_s:g})"
                    if over
                    else f"{what} did not return after the job failed ({why})"
                )
                print(
                    f"horovod: rank {self.rank}: {reason}; ending the MPI job with MPI_Abort",
                    file=sys.stderr,
                    flush=True,
                )
                _mpi().COMM_WORLD.Abort(1)

    # ------------------------------------------------------------------ sub-communicators
    def subset(self, ranks: Sequence[int]) -> MpiCollectives:
        """MPI's collectives on a sub-communicator of ``ranks`` (this rank among them)."""
        key = tuple(ranks)
        found = self._subsets.get(key)
        if found is None:
            comm = self.comm

            def make() -> Any:
                group = comm.Get_group().Incl(list(key))
                try:
                    return comm.Create_group(group, tag=_tag(key))
                finally:
                    group.Free()

            found = self._subsets[key] = MpiCollectives(self, _Lazy(make), len(key))
        return found

    def close(self, free: bool = True) -> None:
        """Stop the watchdog; free the communicators unless a call may still be in flight."""
        self._closed = True
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if not free or self._aborted() is not None:
            return  # a peer may be lost mid-operation: leave MPI's objects be
        for sub in self._subsets.values():
            sub.free()
        self._subsets.clear()
        self.world.free(keep_comm=True)
        self.comm.Free()


class _Lazy:
    """A communicator made on first use (``make`` is collective over its members)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self.comm: Any = None

    def get(self) -> Any:
        if self.comm is None:
            self.comm = self._make()
        return self.comm


class MpiCollectives:
    """MPI's collectives on one communicator (the job's or a process set's, of ``size``
    ranks). Each method returns False, having done nothing, where MPI lacks the operation for
    the buffer or leaves it to the transport (``takes``); the caller then runs its own
    algorithm over point-to-point."""

    kind = "MPI"

    def __init__(self, plane: MpiPlane, comm: _Lazy, size: int) -> None:
        self._plane = plane
        self._comm = comm
        self.size = size
        self._levels: tuple[Any, Any] | None = None  # (host comm, leaders' comm or None)
        self._levels_made = False
        self._MPI = MPI = _mpi()  # (kept: an import statement per call costs on cold caches)
        self._ops: dict[Any, Any] = {
            np.add: MPI.SUM,
            np.minimum: MPI.MIN,
            np.maximum: MPI.MAX,
            np.multiply: MPI.PROD,
        }

    def subset(self, ranks: Sequence[int]) -> MpiCollectives:
        return self._plane.subset(ranks)

    def takes(self, op: str, nbytes: int) -> bool:
        """Does MPI run ``op`` ("allreduce", "allgather" (``nbytes``: the whole result),
        "broadcast", "reduce_scatter" (the whole input), ...) of ``nbytes``, rather than the
        transport's own algorithms? Everything but large operations on one host (``OWN_FROM``).
        Every rank of the set decides alike: the same operation, bytes and set size."""
        if not self._plane.one_host:
            return True
        if op == "broadcast":
            return self.size != 2 or nbytes < OWN_BROADCAST_FROM
        return nbytes < OWN_FROM.get(op, 1 << 62)

    def _op(self, op: Callable[..., np.ndarray], buf: np.ndarray) -> Any:
        if buf.dtype.char not in REDUCIBLE:
            return None
        return self._ops.get(op)

    def _host_levels(self, hosts: Sequence[str] | None) -> tuple[Any, Any] | None:
        """(host communicator, leaders' communicator or None off a leader), or None when a
        two-level algorithm would not help (one host, or one rank per host)."""
        if not self._levels_made:
            self._levels_made = True
            comm = self._comm.get()
            names = list(hosts or [])
            if 1 < len(set(names)) < len(names):
                me = comm.Get_rank()
                colour = sorted(set(names), key=names.index).index(names[me])
                local = comm.Split(colour, me)
                leader = local.Get_rank() == 0
                leaders = comm.Split(0 if leader else _mpi().UNDEFINED, me)
                self._levels = (local, leaders if leader else None)
        return self._levels

    # ------------------------------------------------------------------ operations
    def allreduce(
        self, buf: np.ndarray, op: Callable[..., np.ndarray], hierarchical: bool, hosts
    ) -> bool:
        mpi_op = self._op(op, buf)
        if mpi_op is None or not self.takes("allreduce", buf.nbytes):
            return False
        MPI = self._MPI
        call = self._plane.call
        levels = self._host_levels(hosts) if hierarchical else None
        if levels is None:
            call("MPI_ALLREDUCE", self._comm.get().Allreduce, MPI.IN_PLACE, buf, mpi_op)
            return True
        local, leaders = levels
        if leaders is not None:
            call("MPI_REDUCE (host)", local.Reduce, MPI.IN_PLACE, buf, mpi_op, root=0)
            call("MPI_ALLREDUCE (leaders)", leaders.Allreduce, MPI.IN_PLACE, buf, mpi_op)
        else:
            call("MPI_REDUCE (host)", local.Reduce, buf, None, mpi_op, root=0)
        call("MPI_BCAST (host)", local.Bcast, buf, root=0)
        return True

    def allgatherv(
        self,
        out: np.ndarray,
        nbytes: Sequence[int],
        hierarchical: bool,
        hosts,
        place: Sequence[tuple[memoryview, memoryview]] = (),
    ) -> bool:
        """Every rank's block at its place in ``out`` (bytes): this rank's is there already,
        or ``place`` (destination, block) copies put it there first."""
        if not self.takes("allgather", sum(nbytes)):
            return False
        for dst, block in place:
            dst[:] = block
        MPI = self._MPI
        call = self._plane.call
        displs = _offsets(nbytes)
        levels = self._host_levels(hosts) if hierarchical else None
        if levels is not None and _contiguous_hosts(hosts):
            local, leaders = levels
            names = list(hosts)
            me = self._comm.get().Get_rank()
            members = [r for r, h in enumerate(names) if h == names[me]]
            first = members[0]
            # The host's ranks are consecutive: gather them into the host's run of ``out``.
            counts = [nbytes[r] for r in members]
            host_displs = [displs[r] - displs[first] for r in members]
            run = out[displs[first] : displs[first] + sum(counts)]
            if leaders is not None:
                spec = [run, (counts, host_displs), MPI.BYTE]
                call("MPI_GATHERV (host)", local.Gatherv, MPI.IN_PLACE, spec, root=0)
                order = sorted(set(names), key=names.index)
                per_host = [sum(nbytes[r] for r, h in enumerate(names) if h == x) for x in order]
                starts = [displs[names.index(x)] for x in order]
                spec = [out, (per_host, starts), MPI.BYTE]
                call("MPI_ALLGATHERV (leaders)", leaders.Allgatherv, MPI.IN_PLACE, spec)
            else:
                mine = out[displs[me] : displs[me] + nbytes[me]]
                call("MPI_GATHERV (host)", local.Gatherv, [mine, MPI.BYTE], None, root=0)
            call("MPI_BCAST (host)", local.Bcast, [out, MPI.BYTE], root=0)
            return True
        spec = [out, (list(nbytes), displs), MPI.BYTE]
        call("MPI_ALLGATHERV", self._comm.get().Allgatherv, MPI.IN_PLACE, spec)
        return True

    def broadcast(self, buf: np.ndarray, root: int) -> bool:
        if not self.takes("broadcast", buf.nbytes):
            return False
        spec = buf if buf.dtype.char in REDUCIBLE else [_bytes(buf), self._MPI.BYTE]
        self._plane.call("MPI_BCAST", self._comm.get().Bcast, spec, root=root)
        return True

    def alltoallv(
        self,
        src: np.ndarray,
        send_nbytes: Sequence[int],
        dst: np.ndarray,
        recv_nbytes: Sequence[int],
    ) -> bool:
        MPI = _mpi()
        s = [_bytes(src), (list(send_nbytes), _offsets(send_nbytes)), MPI.BYTE]
        r = [_bytes(dst), (list(recv_nbytes), _offsets(recv_nbytes)), MPI.BYTE]
        self._plane.call("MPI_ALLTOALLV", self._comm.get().Alltoallv, s, r)
        return True

    def reduce_scatter(
        self, buf: np.ndarray, counts: Sequence[int], op: Callable[..., np.ndarray], out: np.ndarray
    ) -> bool:
        """Segment r (``counts[r]`` elements of ``buf``, in order) reduced across ranks lands
        in ``out`` on rank r."""
        mpi_op = self._op(op, buf)
        if mpi_op is None or not self.takes("reduce_scatter", buf.nbytes):
            return False
        comm = self._comm.get()
        self._plane.call("MPI_REDUCE_SCATTER", comm.Reduce_scatter, buf, out, list(counts), mpi_op)
        return True

    def barrier(self) -> bool:
        self._plane.call("MPI_BARRIER", self._comm.get().Barrier)
        return True

    def free(self, keep_comm: bool = False) -> None:
        if self._levels is not None:
            for c in self._levels:
                if c is not None:
                    c.Free()
            self._levels = None
        if not keep_comm and self._comm.comm is not None:
            self._comm.comm.Free()
            self._comm.comm = None


def _offsets(counts: Sequence[int]) -> list[int]:
    """Displacements of consecutive blocks of ``counts`` (MPI's ``displs``)."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _contiguous_hosts(hosts: Sequence[str]) -> bool:
    """Does every host hold one run of consecutive ranks (``--map-by slot``)?"""
    seen: list[str] = []
    for h in hosts:
        if not seen or seen[-1] != h:
            if h in seen:
                return False
            seen.append(h)
    return True


def _tag(ranks: tuple[int, ...]) -> int:
    """A tag for ``MPI_Comm_create_group`` of these ranks (any value works: the engine
    creates one group at a time; distinct tags keep MPI's matching obvious)."""
    return hash(ranks) & 0x7FFF


def attach(transport: Transport, plane: MpiPlane) -> Transport:
    """Give a built-in transport (shared memory, one host) MPI's collectives for its data,
    but for the large operations its own algorithms move faster (``MpiCollectives.takes``);
    its own point-to-point and control stay. ``transport.close`` then closes the plane too."""
    plane.one_host = True
    transport.native = plane.world
    inner_close = transport.close

    def close() -> None:
        inner_close()
        plane.close()

    transport.close = close  # type: ignore[method-assign]
    return transport


class MpiTransport(Transport):
    """Every byte through MPI: point-to-point and collectives on the plane's communicator;
    control messages through ``control``, a transport of the same ranks (TCP)."""

    kind = "MPI"

    def __init__(self, comm: Any, control: Transport, warn_s: float = 0.0, shutdown_s: float = 0.0):
        if comm.Get_size() != control.size or comm.Get_rank() != control.rank:
            raise ValueError(
                f"the MPI communicator (rank {comm.Get_rank()} of {comm.Get_size()}) and the "
                f"control plane (rank {control.rank} of {control.size}) disagree"
            )
        self.rank, self.size = control.rank, control.size
        self._control = control
        self._aborted: str | None = None
        self.plane = MpiPlane(comm, lambda: self._aborted, warn_s, shutdown_s)
        self.comm = comm
        self.native = self.plane.world

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        if self._aborted is not None:
            raise TransportError(self._aborted)
        MPI = _mpi()
        comm = self.comm
        reqs = [comm.Irecv([mv, MPI.BYTE], source=p, tag=0) for p, mv in recvs if mv.nbytes]
        reqs += [comm.Isend([mv, MPI.BYTE], dest=p, tag=0) for p, mv in sends if mv.nbytes]
        if reqs:
            self.plane.wait(reqs)

    def send_ctrl(self, peer: int, payload: bytes) -> None:
        self._control.send_ctrl(peer, payload)

    def start_ctrl(self, handler: CtrlHandler) -> None:
        self._control.start_ctrl(handler)

    def abort(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self._control.abort(reason)

    def close(self) -> None:
        self._control.close()
        self.plane.close()


class MpiPolledTransport(PolledTcpTransport):
    """Every byte through MPI (``mpi``'s point-to-point and the plane's collectives), control
    messages and the engine's peer rounds through ``inner``'s TCP connections read by the
    polling thread, as in a job over TCP alone: no reader threads and no hand-offs between
    threads, and small cached operations decided by a round over the board's connections
    (jobs of up to ``tcp_board.MAX_RANKS`` ranks) instead of through rank 0. Negotiating
    each operation through rank 0 with reader threads cost 300-550 us before every MPI call
    (docs/mpi.md)."""

    kind = "MPI"

    def __init__(
        self,
        mpi: MpiTransport,
        inner: TcpTransport,
        spin_us: float,
        oversubscribed: bool,
        board_timeout: float | None = None,
    ) -> None:
        super().__init__(inner, spin_us, oversubscribed, board_timeout)
        self.mpi = mpi
        self.native = mpi.native

    # (the data plane: MPI's point-to-point, in the base forms built on ``exchange``)
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        self.mpi.exchange(sends, recvs)

    exchange_reduce = Transport.exchange_reduce
    exchange_copy = Transport.exchange_copy
    exchange_oneway = Transport.exchange_oneway
    exchange_pair = Transport.exchange_pair

    def _board_room(self, one_host: bool) -> int:
        # (posts travel over TCP, beside the fabric MPI uses: data rounds only for small ops)
        return tcp_board.DATA_BYTES

    def abort(self, reason: str) -> None:
        # (``mpi`` marks its calls aborted, which the watchdog acts on, and aborts the TCP
        # connections it shares with this transport; the kick wakes the polling thread)
        self.mpi.abort(reason)
        self.kick()

    def close(self) -> None:
        super().close()  # (the TCP connections: ``mpi`` holds the same ones as its control)
        self.mpi.plane.close()
