"""Requests (a rank's wish to run a collective on a named tensor) and Responses (the
coordinator's decision), with their wire forms and a safe decoder.

Control messages are pickled plain tuples of ints, floats, strings and containers. They are only
accepted from peers that proved the job secret, and they are decoded by an unpickler that refuses
every global (class or function), so even a confused peer can only send data, never code.

Must not touch: anything with state: it only defines and (de)serialises messages.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass, field

# Request/response types (upstream's codes), plus pyhorovod's process-set operations.
ALLREDUCE, ALLGATHER, BROADCAST, JOIN, ADASUM, ALLTOALL, BARRIER, REDUCESCATTER, ERROR = range(9)
PROCESS_SET_ADD, PROCESS_SET_REMOVE = 20, 21
OP_NAMES = {
    ALLREDUCE: "allreduce",
    ALLGATHER: "allgather",
    BROADCAST: "broadcast",
    JOIN: "join",
    ADASUM: "adasum",
    ALLTOALL: "alltoall",
    BARRIER: "barrier",
    REDUCESCATTER: "reducescatter",
    ERROR: "error",
    PROCESS_SET_ADD: "add_process_set",
    PROCESS_SET_REMOVE: "remove_process_set",
}

# Reduce ops (upstream's ReduceOp enum values).
AVERAGE, SUM, ADASUM_OP, MIN, MAX, PRODUCT = range(6)
REDUCE_NAMES = {
    AVERAGE: "Average",
    SUM: "Sum",
    ADASUM_OP: "Adasum",
    MIN: "Min",
    MAX: "Max",
    PRODUCT: "Product",
}

CPU_DEVICE = -1
# Requests name the kind of device only (each rank has its own GPU): a device tensor on the
# GPU its rank's device plane works on is DEVICE.
DEVICE = 0
# A request's device below this says that the rank's tensor is on a GPU other than the one its
# device plane works on (``wrong_device_code``): the coordinator refuses it on every rank.
WRONG_DEVICE_BASE = -2


def wrong_device_code(index: int, expected: int) -> int:
    return WRONG_DEVICE_BASE - (index + 1024 * expected)


def wrong_device(code: int) -> tuple[int, int]:
    """``(index, expected)`` of a ``wrong_device_code``."""
    v = WRONG_DEVICE_BASE - code
    return v % 1024, v // 1024


# (a barrier too: its one name, "barrier.noname", hits the cache from the second call on, and
# in a peer round every rank's post of it is the barrier itself)
CACHEABLE = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER})
FUSIBLE = frozenset({ALLREDUCE, ALLGATHER, REDUCESCATTER})


def display_name(op: int, name: str) -> str:
    """``allreduce 'fc1.weight'`` for core name ``allreduce.fc1.weight``."""
    prefix = OP_NAMES.get(op, "") + "."
    short = name[len(prefix) :] if name.startswith(prefix) else name
    for grouped in ("grouped_" + prefix,):
        if name.startswith(grouped):
            short = name[len(grouped) :]
    if short == "noname":  # barrier(), join()
        return OP_NAMES.get(op, "?")
    return f"{OP_NAMES.get(op, '?')} '{short}'"


@dataclass(slots=True)
class Request:
    ps_id: int
    name: str
    op: int
    dtype: int
    shape: tuple[int, ...]
    reduce_op: int = SUM
    root: int = -1  # global rank (broadcast)
    prescale: float = 1.0
    postscale: float = 1.0
    device: int = CPU_DEVICE
    group: int = -1
    extra: object = None  # process-set operations: their argument
    site: str = ""  # where the caller submitted it (file:line); not part of the signature

    def signature(self) -> tuple:
        return (
            self.op,
            self.dtype,
            self.shape,
            self.reduce_op,
            self.root,
            self.prescale,
            self.postscale,
            self.device,
            self.extra,
        )

    def wire(self) -> tuple:
        return (
            self.ps_id,
            self.name,
            self.op,
            self.dtype,
            self.shape,
            self.reduce_op,
            self.root,
            self.prescale,
            self.postscale,
            self.device,
            self.group,
            self.extra,
            self.site,
        )

    @classmethod
    def from_wire(cls, w: tuple) -> Request:
        ps_id, name, op, dtype, shape, reduce_op, root, pre, post, device, group, extra, site = w
        if not (
            isinstance(name, str)
            and isinstance(site, str)
            and isinstance(shape, tuple)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(pre, float)
            and isinstance(post, float)
            and math.isfinite(pre)
            and math.isfinite(post)
        ):
            raise ValueError("malformed request")
        return cls(
            int(ps_id),
            name,
            int(op),
            int(dtype),
            shape,
            int(reduce_op),
            int(root),
            pre,
            post,
            int(device),
            int(group),
            extra,
            site[:200],
        )


@dataclass(slots=True)
class Response:
    op: int
    ps_id: int
    names: list[str]
    dtype: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    reduce_op: int = SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    dim0s: list[list[int]] | None = None  # allgather: first dims, per tensor, per set rank
    joined: tuple[int, ...] = ()  # global ranks that had joined (contribute zeros)
    last_joined: int = -1
    error: str = ""
    extra: object = None
    group: int = -1
    device: int = CPU_DEVICE
    # nbytes() memo: (shapes list it was computed for, itemsize, value). Cached responses are
    # fused again every step; their shapes never change (merging builds new lists).
    _nb: tuple | None = field(default=None, compare=False, repr=False)

    def wire(self) -> tuple:
        return (
            "R",
            self.op,
            self.ps_id,
            self.names,
            self.dtype,
            self.shapes,
            self.reduce_op,
            self.root,
            self.prescale,
            self.postscale,
            self.dim0s,
            self.joined,
            self.last_joined,
            self.error,
            self.extra,
            self.group,
            self.device,
        )

    @classmethod
    def from_wire(cls, w: tuple) -> Response:
        (
            _,
            op,
            ps_id,
            names,
            dtype,
            shapes,
            reduce_op,
            root,
            pre,
            post,
            dim0s,
            joined,
            last_joined,
            error,
            extra,
            group,
            device,
        ) = w
        return cls(
            op,
            ps_id,
            list(names),
            dtype,
            list(shapes),
            reduce_op,
            root,
            pre,
            post,
            dim0s,
            tuple(joined),
            last_joined,
            error,
            extra,
            group,
            device,
        )

    def split(self) -> list[Response]:
        """One single-tensor response per name (for the cache)."""
        if len(self.names) == 1:
            return [self]
        return [
            Response(
                self.op,
                self.ps_id,
                [n],
                self.dtype,
                [self.shapes[i]],
                self.reduce_op,
                self.root,
                self.prescale,
                self.postscale,
                None if self.dim0s is None else [self.dim0s[i]],
                self.joined,
                self.last_joined,
                self.error,
                self.extra,
                self.group,
                self.device,
            )
            for i, n in enumerate(self.names)
        ]

    def request_for(self, set_rank: int) -> tuple:
        """The request signature the given set rank must have sent for this (single) response."""
        shape = self.shapes[0]
        if self.op == ALLGATHER and self.dim0s is not None:
            shape = (self.dim0s[0][set_rank],) + tuple(shape[1:])
        return (
            self.op,
            self.dtype,
            tuple(shape),
            self.reduce_op,
            self.root,
            self.prescale,
            self.postscale,
            self.device,
            self.extra,
        )

    def nbytes(self, itemsize: int) -> int:
        memo = self._nb
        if memo is not None and memo[0] is self.shapes and memo[1] == itemsize:
            return memo[2]
        total = self._count_bytes(itemsize)
        self._nb = (self.shapes, itemsize, total)
        return total

    def _count_bytes(self, itemsize: int) -> int:
        total = 0
        for i, s in enumerate(self.shapes):
            n = math.prod(s)
            if self.op == ALLGATHER and self.dim0s is not None:
                n = math.prod(s[1:]) * sum(self.dim0s[i])
            total += n * itemsize
        return total


# ------------------------------------------------------------------------------------ codec
class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a control message")


# The messages of steady-state training have a compact binary form (pickle output always starts
# with 0x80, so the first byte tells them apart): a rank's cache hits, and a response list made
# only of cache ids; both as lists of integers parsed without the unpickler. Their eager forms
# (small allreduces reduced by the coordinator, see coordinator.py) carry raw bytes after each record.
_HITS = 1  # int64 pairs (ps_id, cid): ("Q", [("H", ps_id, cid), ...])
_IDS = 2  # int64 runs (ps_id, n, cid x n): ("P", [("K", ps_id, [cid, ...]), ...], None, None)
_HITS_DATA = 3  # records int64 (ps_id, cid, nbytes) + nbytes of data ("D"); nbytes -1: an "H"
_IDS_DATA = 4  # records int64 (ps_id, n, cid x n, nbytes) + nbytes of result ("V"); -1: a "K"
_REC = struct.Struct("<qqq")
_Q = struct.Struct("<q")


def _binary(msg: tuple) -> bytes | None:
    tag = msg[0]
    if tag == "Q":
        items = msg[1]
        flat: list[int] = []
        for it in items:
            if it[0] != "H":
                return _binary_hits_data(items)
            flat += (it[1], it[2])
        return bytes((_HITS,)) + struct.pack(f"<{len(flat)}q", *flat)
    if tag == "P" and len(msg) == 4 and msg[2] is None and msg[3] is None:
        flat = []
        for it in msg[1]:
            if it[0] != "K":
                return _binary_ids_data(msg[1])
            flat += (it[1], len(it[2]), *it[2])
        return bytes((_IDS,)) + struct.pack(f"<{len(flat)}q", *flat)
    return None


def _binary_hits_data(items: list[tuple]) -> bytes | None:
    parts: list[bytes] = [bytes((_HITS_DATA,))]
    for it in items:
        if it[0] == "H":
            parts.append(_REC.pack(it[1], it[2], -1))
        elif it[0] == "D":
            parts.append(_REC.pack(it[1], it[2], len(it[3])))
            parts.append(it[3])
        else:
            return None
    return b"".join(parts)


def _binary_ids_data(items: list[tuple]) -> bytes | None:
    parts: list[bytes] = [bytes((_IDS_DATA,))]
    for it in items:
        if it[0] not in ("K", "V"):
            return None
        cids = it[2]
        data = it[3] if it[0] == "V" else None
        parts.append(
            struct.pack(
                f"<{len(cids) + 3}q", it[1], len(cids), *cids, -1 if data is None else len(data)
            )
        )
        if data is not None:
            parts.append(data)
    return b"".join(parts)


def encode(msg: tuple) -> bytes:
    try:
        wire = _binary(msg)
    except (struct.error, TypeError):
        wire = None
    return wire if wire is not None else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _ints(payload: bytes) -> tuple[int, ...]:
    if (len(payload) - 1) % 8:
        raise pickle.UnpicklingError("binary control message of a length that is not 1 + 8k")
    return struct.unpack_from(f"<{(len(payload) - 1) // 8}q", payload, 1)


def _data(mv: memoryview, off: int, n: int, what: str) -> tuple[memoryview | None, int]:
    """The ``n`` bytes at ``off`` (None for n == -1) and the offset after them."""
    if n == -1:
        return None, off
    if n < 0 or off + n > len(mv):
        raise pickle.UnpicklingError(f"{what} with a bad data length")
    return mv[off : off + n], off + n


def _decode_hits_data(payload: bytes) -> tuple:
    mv = memoryview(payload)
    items: list[tuple] = []
    off = 1
    while off < len(mv):
        if off + _REC.size > len(mv):
            raise pickle.UnpicklingError("cache-hit message cut inside a record")
        ps_id, cid, n = _REC.unpack_from(mv, off)
        data, off = _data(mv, off + _REC.size, n, "cache-hit message")
        items.append(("H", ps_id, cid) if data is None else ("D", ps_id, cid, data))
    return ("Q", items)


def _decode_ids_data(payload: bytes) -> tuple:
    mv = memoryview(payload)
    items: list[tuple] = []
    off = 1
    while off < len(mv):
        if off + 16 > len(mv):
            raise pickle.UnpicklingError("cache-id response list cut inside a record")
        ps_id, n = struct.unpack_from("<qq", mv, off)
        off += 16
        if n < 0 or off + 8 * (n + 1) > len(mv):
            raise pickle.UnpicklingError("cache-id response list with a bad count")
        cids = list(struct.unpack_from(f"<{n}q", mv, off))
        off += 8 * n
        (nbytes,) = _Q.unpack_from(mv, off)
        data, off = _data(mv, off + 8, nbytes, "cache-id response list")
        items.append(("K", ps_id, cids) if data is None else ("V", ps_id, cids, data))
    return ("P", items, None, None)


def decode(payload: bytes) -> tuple:
    kind = payload[0] if payload else -1
    if kind == _HITS:
        v = _ints(payload)
        if len(v) % 2:
            raise pickle.UnpicklingError("cache-hit message with an odd number of integers")
        return ("Q", [("H", v[i], v[i + 1]) for i in range(0, len(v), 2)])
    if kind == _IDS:
        v = _ints(payload)
        items = []
        i = 0
        while i < len(v):
            if i + 2 > len(v) or v[i + 1] < 0 or i + 2 + v[i + 1] > len(v):
                raise pickle.UnpicklingError("cache-id response list with a bad count")
            n = v[i + 1]
            items.append(("K", v[i], list(v[i + 2 : i + 2 + n])))
            i += 2 + n
        return ("P", items, None, None)
    if kind == _HITS_DATA:
        return _decode_hits_data(payload)
    if kind == _IDS_DATA:
        return _decode_ids_data(payload)
    msg = _SafeUnpickler(io.BytesIO(payload)).load()
    if not isinstance(msg, tuple) or not msg or not isinstance(msg[0], str):
        raise pickle.UnpicklingError("control message is not a tagged tuple")
    return msg
