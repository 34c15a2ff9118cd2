"""The life of a rank's shared memory: creating its segment and notify sockets, mapping the
peers' segments, agreeing on single-copy transfers, and releasing everything at the end.

Segments are unlinked as soon as every local rank has mapped them, so nothing is left in
``/dev/shm`` even when a rank is killed later; names carry the job's id (derived from its
secret), so horovodrun can remove the segments of ranks that died during set-up, and a random
part, so two jobs on one host never collide. If any local rank cannot create or map its segment
(no ``/dev/shm``, not enough space), every rank of that host agrees to stay on TCP
(``Unusable``). ``ShmSegments`` also holds the state that the layers above it share
(``waiting``, ``exchange``, ``control``).

Must not touch: moving bytes (``exchange``), waiting (``waiting``), the engine's messages.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from horovod.common import log
from horovod.common.exceptions import TransportError
from horovod.common.shm_names import PREFIX, job_id, shm_dir
from horovod.rendezvous.store import Store
from horovod.transport import cma
from horovod.transport.base import PolledTransport, Scratch, Transport, spin_seconds
from horovod.transport.shm.board import Board
from horovod.transport.shm.channels import Channel
from horovod.transport.shm.layout import OUT_BYTES, OUT_MIN, OUT_SLOTS, Layout
from horovod.transport.shm.rings import Ring
from horovod.transport.tcp_polled import PolledTcpTransport

if TYPE_CHECKING:
    from horovod.transport.mixed_board import MixedBoard


class ShmSegments(PolledTransport):
    """Set-up and release of the segments, and the state every layer of ``ShmTransport`` uses."""

    kind = "SHM"

    def __init__(
        self,
        inner: Transport,
        local: Sequence[int],
        *,
        store: Store,
        scope: str,
        secret: bytes,
        chunk: int,
        slots: int,
        spin_us: float,
        timeout: float,
        single_copy: int = 0,
        outputs: bool = True,
        crowded: bool = False,
    ) -> None:
        """``local``: the global ranks on this host (this one included). Raises
        ``TransportError`` if this host's ranks cannot all use shared memory (every one of
        them raises, so they agree); use ``create`` to fall back to ``inner`` instead.
        ``single_copy``: messages of more than one chunk and at least this many bytes are read
        straight from the sender's memory where every local rank can (0: never).
        ``outputs``: results of allgather peer rounds may live in this rank's output slots
        (every rank reads the others' either way); only where reference counts tell that no
        view of a result is alive any more (``horovod.core.pool``). ``crowded``: more ranks
        share this machine's cores than this host name has (``horovod.common.net.crowded``)."""
        self.inner = inner
        # The TCP plane to the other hosts, where the thread running the engine reads its
        # control connections (``PolledTcpTransport``) instead of reader threads.
        self._remote = inner if isinstance(inner, PolledTcpTransport) else None
        self.rank, self.size = inner.rank, inner.size
        self.local = sorted(local)
        self.peers = [r for r in self.local if r != self.rank]
        self.chunk = (chunk + 63) // 64 * 64
        self.nslots = slots
        self.layout = Layout(len(self.local), slots, self.chunk)
        self._yield = crowded or len(self.local) > (os.cpu_count() or 1)
        self.spin_s = spin_seconds(spin_us, self._yield)
        self.oversubscribed = self._yield  # waiting loops yield the CPU between polls
        self._aborted: str | None = None
        self._closed = False
        self._scratch = Scratch()
        self._maps: dict[int, mmap.mmap] = {}
        self._out: dict[int, Channel] = {}
        self._in: dict[int, Channel] = {}
        self._asleep: dict[int, memoryview] = {}
        self._rin: dict[int, Ring] = {}
        self._rout: dict[int, Ring] = {}
        self._backlog = False  # some control frame waits for room in its ring
        self._sleepers = 0  # threads in a data-plane wait's sleep
        self._engine_asleep = False  # the engine thread in sleep()
        self._driving = False
        self._sleep_lock = threading.Lock()
        self._addr: dict[int, str | bytes] = {}  # peers' data-plane sockets
        self._eaddr: dict[int, str | bytes] = {}  # peers' engine sockets
        self._sock: socket.socket | None = None  # wakes this rank's data-plane waits
        self._esock: socket.socket | None = None  # wakes its engine thread
        self._path: str | None = None
        self._sock_paths: list[str] = []
        # The engine's peer rounds: all ranks on this host, or ``mix_boards`` (several hosts).
        self.board: Board | MixedBoard | None = None
        # Output slots (``out_slot``): every local rank's, and the arrays that hand out this
        # rank's (when ``outputs``: a result may then live in shared memory).
        self.outputs = outputs
        self.out_min = OUT_MIN
        self._out_views: dict[int, list[memoryview]] = {}
        self.out_owners: list[np.ndarray] = []
        self._out_next = [0] * OUT_SLOTS  # where the next result goes in each slot
        # Single copy (cross-memory attach): messages of at least this many bytes (0: off).
        self.single_copy = 0
        self.split_copy = False  # large two-rank broadcasts: root writes half, receiver reads half
        self._pids: dict[int, int] = {}
        self._ptracer_set = False
        try:
            self._setup(store, scope, secret, timeout)
            if single_copy > 0:
                self._setup_single_copy(store, scope, timeout, max(single_copy, self.chunk + 1))
        except BaseException:
            self._release()
            raise

    def _setup(self, store: Store, scope: str, secret: bytes, timeout: float) -> None:
        me = self.rank
        name = f"{PREFIX}{job_id(secret)}-{me}-{os.urandom(6).hex()}"
        err = ""
        try:
            self._path = self._create_segment(name)
            self._sock = self._bind(name)
            self._esock = self._bind(name + "e")
        except OSError as e:
            err = f"rank {me}: {e}"
        store.set(scope, f"shm.{me}", (name if not err else "!" + err).encode())
        names = [b.decode() for b in store.wait(scope, [f"shm.{r}" for r in self.local], timeout)]
        bad = [n[1:] for n in names if n.startswith("!")]
        if not bad:
            try:
                for r, n in zip(self.local, names, strict=True):
                    if r != me:
                        self._map_peer(r, n)
            except OSError as e:
                bad.append(f"rank {me} cannot map rank {r}'s segment: {e}")
        store.set(scope, f"shm.mapped.{me}", ("!" + bad[0] if bad else "ok").encode())
        done = [
            b.decode() for b in store.wait(scope, [f"shm.mapped.{r}" for r in self.local], timeout)
        ]
        # Every rank has mapped every segment (or given up): the names can go.
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None
        why = next((d[1:] for d in done if d != "ok"), None)
        if why is not None:
            raise Unusable(why)
        self._build_channels()

    def _create_segment(self, name: str) -> str:
        d = shm_dir()
        need = self.layout.total
        st = os.statvfs(d)
        # Leave room for the other ranks of this host too: each needs about as much.
        if st.f_bavail * st.f_frsize < need * len(self.local):
            raise OSError(
                f"{d} has {st.f_bavail * st.f_frsize >> 20} MiB free, shared memory for "
                f"{len(self.local)} ranks needs {need * len(self.local) >> 20} MiB (lower "
                "HOROVOD_SHM_CHUNK_BYTES / HOROVOD_SHM_SLOTS or enlarge /dev/shm, e.g. "
                "docker run --shm-size=1g)"
            )
        path = os.path.join(d, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, need)  # reserve now: tmpfs full later = SIGBUS
            else:
                os.ftruncate(fd, need)
            self._maps[self.rank] = mmap.mmap(fd, need)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path

    def _bind(self, name: str) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if sys.platform.startswith("linux"):
            s.bind("\0" + name)  # abstract: vanishes with the process
        else:
            path = os.path.join(tempfile.gettempdir(), name + ".sock")
            self._sock_paths.append(path)
            s.bind(path)
        s.setblocking(False)
        return s

    def _map_peer(self, r: int, name: str) -> None:
        d = shm_dir()
        fd = os.open(os.path.join(d, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != self.layout.total:
                raise OSError(
                    f"segment of rank {r} has {size} bytes, expected {self.layout.total}: "
                    "HOROVOD_SHM_CHUNK_BYTES / HOROVOD_SHM_SLOTS differ between ranks"
                )
            self._maps[r] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._addr[r] = address(name)
        self._eaddr[r] = address(name + "e")

    def _build_channels(self) -> None:
        me = self.rank
        lay = self.layout
        mine = self._maps[me]
        for r in self.peers:
            theirs = self._maps[r]
            # The channel r -> me lives in my segment at r's index among my peers, and
            # me -> r in r's segment at my index among r's peers.
            self._in[r] = Channel(mine, lay.chan(self._index(me, r)), self.nslots, self.chunk)
            self._out[r] = Channel(theirs, lay.chan(self._index(r, me)), self.nslots, self.chunk)
            self._asleep[r] = memoryview(theirs)[0:72].cast("q")  # [0] data, [8] engine
            self._rin[r] = Ring(mine, lay.ring(self._index(me, r)))
            self._rout[r] = Ring(theirs, lay.ring(self._index(r, me)))
        self._me_asleep = memoryview(mine)[0:72].cast("q")
        if len(self.local) == self.size:  # peer rounds need every rank on this host
            self.board = Board(
                mine, {r: self._maps[r] for r in self.peers}, lay.board, move=not self._yield
            )
            ob = lay.outputs
            for r in self.local:
                mv = memoryview(self._maps[r])
                self._out_views[r] = [
                    mv[ob + k * OUT_BYTES : ob + (k + 1) * OUT_BYTES] for k in range(OUT_SLOTS)
                ]
                mv.release()
            if self.outputs:
                self.out_owners = [np.frombuffer(v, np.uint8) for v in self._out_views[me]]

    def _setup_single_copy(self, store: Store, scope: str, timeout: float, threshold: int) -> None:
        """Use single-copy transfers if every local rank can read every other one's memory:
        each publishes a random probe, names its peers as allowed readers (Yama mode 1), and
        reads its peers' probes; all of them see all the verdicts, so they agree. Each also
        writes into a box of every peer: split broadcasts (which write) need every write to
        succeed too."""
        me = self.rank
        writes = True
        if not cma.available():
            verdict = "!no process_vm_readv on this platform"
        else:
            probe = ctypes.create_string_buffer(os.urandom(16), 16)  # alive until the verdicts
            box = ctypes.create_string_buffer(16)  # peers write here
            mine = (
                f"{os.getpid()}:{ctypes.addressof(probe)}:{probe.raw.hex()}:{threshold}"
                f":{ctypes.addressof(box)}"
            )
            store.set(scope, f"cma.{me}", mine.encode())
            peers = dict(
                zip(
                    self.local,
                    (
                        b.decode()
                        for b in store.wait(scope, [f"cma.{r}" for r in self.local], timeout)
                    ),
                    strict=True,
                )
            )
            pids = {r: int(v.split(":")[0]) for r, v in peers.items() if r != me}
            self._ptracer_set = cma.allow_readers(sorted(set(pids.values()) - {os.getpid()}))
            store.set(scope, f"cma.allowed.{me}", b"1")
            store.wait(scope, [f"cma.allowed.{r}" for r in self.local], timeout)
            verdict = "ok"
            for r, v in peers.items():
                pid, addr, want, limit, their_box = v.split(":")
                if int(limit) != threshold:
                    verdict = f"!single-copy thresholds differ ({limit} on rank {r})"
                    break
                if r == me:
                    continue
                got = ctypes.create_string_buffer(16)
                try:
                    cma.read(int(pid), int(addr), ctypes.addressof(got), 16)
                except OSError as e:
                    verdict = f"!rank {me} cannot read rank {r}'s memory: {e.strerror}"
                    break
                if got.raw.hex() != want:
                    verdict = f"!rank {me} read something else than rank {r}'s probe"
                    break
                try:
                    cma.write(int(pid), ctypes.addressof(probe), int(their_box), 16)
                except OSError as e:
                    writes = False
                    log.logger.info(
                        "rank %d cannot write rank %d's memory (%s): large broadcasts between "
                        "two ranks are read by the receiver alone",
                        me,
                        r,
                        e.strerror,
                    )
            if verdict == "ok" and not writes:
                verdict = "ok-read"
        store.set(scope, f"cma.ok.{me}", verdict.encode())
        done = [b.decode() for b in store.wait(scope, [f"cma.ok.{r}" for r in self.local], timeout)]
        why = next((d[1:] for d in done if not d.startswith("ok")), None)
        if why is not None:
            log.logger.info(
                "rank %d: single-copy transfers off on this host (%s); large messages use two "
                "copies through shared memory",
                me,
                why,
            )
            if self._ptracer_set:
                cma.forbid_readers()
                self._ptracer_set = False
            return
        self._pids = pids
        self.single_copy = threshold
        self.split_copy = all(d == "ok" for d in done)
        self.split_pair_bytes = threshold if self.split_copy else 0

    def _index(self, owner: int, sender: int) -> int:
        return [r for r in self.local if r != owner].index(sender)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ptracer_set:
            cma.forbid_readers()
            self._ptracer_set = False
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
        for sock in (self._sock, self._esock):
            if sock is not None:
                sock.close()
        for path in self._sock_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        for ch in list(self._in.values()) + list(self._out.values()):
            for v in [ch.wr, ch.rd, *ch.slots]:
                v.release()
        for v in self._asleep.values():
            v.release()
        for ring in list(self._rin.values()) + list(self._rout.values()):
            ring.release()
        if self.board is not None:
            self.board.release()
            self.board = None
        self.out_owners = []
        for views in self._out_views.values():
            for v in views:
                try:
                    v.release()
                except BufferError:
                    pass  # a result still lives there; the mapping goes with it
        self._out_views.clear()
        self._rin.clear()
        self._rout.clear()
        if hasattr(self, "_me_asleep"):
            self._me_asleep.release()
        self._in.clear()
        self._out.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a view is still referenced; the mapping goes with it
        self._maps.clear()


def address(name: str) -> str:
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name + ".sock")


class Unusable(TransportError):
    """Shared memory cannot be set up on this host (all its ranks agree)."""
