"""The MPI data plane: data moves through an MPI communicator (mpi4py), control stays on the
project's own star.

``MpiTransport`` implements the ``Transport`` contract on a communicator Horovod owns (a
duplicate of the job's, so the user's own mpi4py traffic never matches ours): ``exchange`` and
its forms are ``Isend``/``Irecv`` pairs (MPI keeps messages between a pair in posting order,
which is the contract's matching rule), and ``native`` offers MPI's own collectives, which the
algorithms prefer where MPI has the operation for the buffer's type (``MpiCollectives``).
Control messages (negotiation, the hang doctor's pings) go through the control transport it is
given (TCP), so negotiation, the response cache and error reports work as on every plane.

Every MPI call here is non-blocking and completed by polling (``MPI_Test``), never a blocking
wait: ``abort`` (a lost peer seen on the control plane, the stall shutdown) makes an operation
in progress raise ``TransportError`` at once instead of leaving the engine thread inside MPI.

Process sets get sub-communicators (``MPI_Comm_create_group``, collective over the set's members
only), made when the set first runs an operation natively: every member runs the same responses
in the same order, so they all create it at the same point. Hierarchical allreduce and allgather
(``HOROVOD_HIERARCHICAL_*``) run as MPI operations on a host communicator (``MPI_Comm_split_type``
shared: MPI moves that data through shared memory) and a leaders' communicator.

Must not touch: the engine, negotiation, other planes (the control transport only through the
``Transport`` contract), mpi4py's initialisation (the job's world does that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.exceptions import TransportError
from horovod.transport.base import CtrlHandler, Message, Transport

# Buffer types MPI reduces natively (mpi4py maps them; float16 is Open MPI's MPIX_C_FLOAT16).
# Others (bool, bfloat16) run the project's algorithms over this plane's point-to-point.
REDUCIBLE = frozenset("ebBhHiIlLqQfd")


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class _Lazy:
    """A communicator made on first use (``make`` is collective over its members)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._comm: Any = None

    def get(self) -> Any:
        if self._comm is None:
            self._comm = self._make()
        return self._comm

    def free(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


class MpiCollectives:
    """MPI's collectives on one communicator (the job's or a process set's). Each method
    returns False, having done nothing, where MPI lacks the operation for the buffer; the
    caller then runs its own algorithm over point-to-point."""

    def __init__(self, plane: MpiTransport, comm: _Lazy, ranks: Sequence[int] | None) -> None:
        self._plane = plane
        self._comm = comm
        self._ranks = None if ranks is None else list(ranks)  # plane ranks of the members
        self._levels: tuple[Any, Any] | None = None  # (host comm, leaders' comm or None)
        self._levels_made = False
        MPI = _mpi()
        self._ops: dict[Any, Any] = {
            np.add: MPI.SUM,
            np.minimum: MPI.MIN,
            np.maximum: MPI.MAX,
            np.multiply: MPI.PROD,
        }

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
            if len(set(names)) > 1 and len(set(names)) < len(names):
                me = comm.Get_rank()
                colour = sorted(set(names), key=names.index).index(names[me])
                local = comm.Split(colour, me)
                leader = local.Get_rank() == 0
                MPI = _mpi()
                leaders = comm.Split(0 if leader else MPI.UNDEFINED, me)
                self._levels = (local, leaders if leader else None)
        return self._levels

    # ------------------------------------------------------------------ operations
    def allreduce(
        self, buf: np.ndarray, op: Callable[..., np.ndarray], hierarchical: bool, hosts
    ) -> bool:
        mpi_op = self._op(op, buf)
        if mpi_op is None:
            return False
        MPI = _mpi()
        levels = self._host_levels(hosts) if hierarchical else None
        if levels is None:
            self._plane.wait(self._comm.get().Iallreduce(MPI.IN_PLACE, buf, mpi_op))
            return True
        local, leaders = levels
        wait = self._plane.wait
        wait(local.Ireduce(MPI.IN_PLACE if leaders is not None else buf, buf, mpi_op, root=0))
        if leaders is not None:
            wait(leaders.Iallreduce(MPI.IN_PLACE, buf, mpi_op))
        wait(local.Ibcast(buf, root=0))
        return True

    def allgatherv(self, out: np.ndarray, nbytes: Sequence[int], hierarchical: bool, hosts) -> bool:
        """``out`` (bytes) holds this rank's block at its place already."""
        MPI = _mpi()
        displs = _offsets(nbytes)
        levels = self._host_levels(hosts) if hierarchical else None
        if levels is not None and _contiguous_hosts(hosts):
            local, leaders = levels
            me = self._comm.get().Get_rank()
            names = list(hosts)
            members = [r for r, h in enumerate(names) if h == names[me]]
            first = members[0]
            # The host's ranks are consecutive: gather them into the host's run of ``out``.
            wait = self._plane.wait
            counts = [nbytes[r] for r in members]
            host_displs = [displs[r] - displs[first] for r in members]
            run = out[displs[first] : displs[first] + sum(counts)]
            if leaders is not None:
                wait(local.Igatherv(MPI.IN_PLACE, [run, (counts, host_displs), MPI.BYTE], root=0))
                order = sorted(set(names), key=names.index)
                per_host = [sum(nbytes[r] for r, h in enumerate(names) if h == x) for x in order]
                starts = [displs[names.index(x)] for x in order]
                wait(leaders.Iallgatherv(MPI.IN_PLACE, [out, (per_host, starts), MPI.BYTE]))
            else:
                mine = out[displs[me] : displs[me] + nbytes[me]]
                wait(local.Igatherv([mine, MPI.BYTE], None, root=0))
            wait(local.Ibcast([out, MPI.BYTE], root=0))
            return True
        self._plane.wait(
            self._comm.get().Iallgatherv(MPI.IN_PLACE, [out, (list(nbytes), displs), MPI.BYTE])
        )
        return True

    def broadcast(self, buf: np.ndarray, root: int) -> bool:
        MPI = _mpi()
        self._plane.wait(self._comm.get().Ibcast([_bytes(buf), MPI.BYTE], root=root))
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
        self._plane.wait(self._comm.get().Ialltoallv(s, r))
        return True

    def reduce_scatter(
        self, buf: np.ndarray, counts: Sequence[int], op: Callable[..., np.ndarray], out: np.ndarray
    ) -> bool:
        """Segment r (``counts[r]`` elements of ``buf``, in order) reduced across ranks lands
        in ``out`` on rank r."""
        mpi_op = self._op(op, buf)
        if mpi_op is None:
            return False
        self._plane.wait(self._comm.get().Ireduce_scatter(buf, out, list(counts), mpi_op))
        return True

    def barrier(self) -> bool:
        self._plane.wait(self._comm.get().Ibarrier())
        return True

    def free(self) -> None:
        if self._levels is not None:
            for c in self._levels:
                if c is not None:
                    c.Free()
            self._levels = None


def _offsets(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


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


class MpiTransport(Transport):
    """The data plane on MPI communicator ``comm`` (owned: freed by ``close``); control
    messages through ``control``, a transport of the same ranks."""

    kind = "MPI"

    def __init__(self, comm: Any, control: Transport) -> None:
        if comm.Get_size() != control.size or comm.Get_rank() != control.rank:
            raise ValueError(
                f"the MPI communicator (rank {comm.Get_rank()} of {comm.Get_size()}) and the "
                f"control plane (rank {control.rank} of {control.size}) disagree"
            )
        self.comm = comm
        self.rank, self.size = control.rank, control.size
        self._control = control
        self._aborted: str | None = None
        self._subsets: dict[tuple[int, ...], MpiCollectives] = {}
        self._world = _Lazy(lambda: comm)
        self.native: MpiCollectives | None = MpiCollectives(self, self._world, None)

    # ------------------------------------------------------------------ waiting
    @property
    def aborted(self) -> str | None:
        return self._aborted

    def wait(self, request: Any) -> None:
        """Complete ``request`` (or a list of them), polling so that ``abort`` ends the wait."""
        if isinstance(request, list):
            test: Callable[[], bool] = lambda: _mpi().Request.Testall(request)  # noqa: E731
        else:
            test = request.Test
        while not test():
            if self._aborted is not None:
                raise TransportError(self._aborted)

    # ------------------------------------------------------------------ data
    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
        if self._aborted is not None:
            raise TransportError(self._aborted)
        MPI = _mpi()
        comm = self.comm
        reqs = [comm.Irecv([mv, MPI.BYTE], source=p, tag=0) for p, mv in recvs if mv.nbytes]
        reqs += [comm.Isend([mv, MPI.BYTE], dest=p, tag=0) for p, mv in sends if mv.nbytes]
        if reqs:
            self.wait(reqs)

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

            found = self._subsets[key] = MpiCollectives(self, _Lazy(make), key)
        return found

    # ------------------------------------------------------------------ control
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
        if self._aborted is not None:
            return  # operations may be in flight with a lost peer: leave MPI's objects be
        for sub in self._subsets.values():
            sub.free()
            sub._comm.free()
        self._subsets.clear()
        if self.native is not None:
            self.native.free()
        self.comm.Free()


def _tag(ranks: tuple[int, ...]) -> int:
    """A tag for ``MPI_Comm_create_group`` of these ranks (any value works: the engine
    creates one group at a time; distinct tags keep MPI's matching obvious)."""
    return hash(ranks) & 0x7FFF
