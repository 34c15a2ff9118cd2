"""Collective algorithms over a Transport (or a process-set view of one).

Every function works on flat C-contiguous NumPy arrays and leaves bitwise-identical results on
every rank: reductions are combined in one fixed order (rank order for the direct algorithms,
one owner per segment for the ring), so floating-point sums never differ between ranks.

Small messages use latency-optimal algorithms: direct exchange (one round: every rank sends its
data to every other rank), recursive doubling for allreduce on a power-of-two number of ranks
above 2, a binomial tree for broadcast. Large ones use bandwidth-optimal ones: the ring
(reduce-scatter then allgather, reducing straight out of the transport's buffers where it can)
and a pipelined chain broadcast, or a star where the transport moves such a message by single
copy between every pair (``Transport.direct_reads``: each receiver reads the root's buffer).
``SMALL_BYTES`` is the switch point (HOROVOD_RING_THRESHOLD_BYTES); every rank checks at init
that it has the same value, so all ranks pick the same algorithm.

Must not touch: the engine, negotiation, a transport's internals (only the ``Transport``
contract), framework tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from horovod.collectives import subnormals
from horovod.transport.base import Message, Reducer, Scratch, SubTransport, as_bytes

SMALL_BYTES = 128 * 1024  # HOROVOD_RING_THRESHOLD_BYTES, set at hvd.init()
# Over more than 2 ranks, allreduces from SMALL_BYTES up to this are reduced in rank order
# (``_allreduce_ordered``): the ring's traffic, and the bits of a peer round's fold.
ORDERED_BYTES = 512 * 1024
PIPELINE_BYTES = 1 << 20  # block size of the pipelined chain broadcast
# HOROVOD_HIERARCHICAL_ALLREDUCE / _ALLGATHER, set at hvd.init() (the same on every rank).
HIERARCHICAL_ALLREDUCE = False
HIERARCHICAL_ALLGATHER = False
# A hierarchical allreduce of at least this many bytes runs as a pipeline over pieces of about
# this size (at least two), at most HIERARCHICAL_PIECES of them (HOROVOD_HIERARCHICAL_ALLREDUCE_
# PIECES, set at hvd.init(): ``_hierarchical_pipeline``). Over a 1 Gbit/s link, pieces of 1 MiB
# kept it busy where 4 MiB ones did not (64 MiB: 566 against 627 ms; the link's own 561).
HIERARCHICAL_PIECE_BYTES = 1 << 20
HIERARCHICAL_PIECES = 64


class Finish(NamedTuple):
    """The end of an Average: ``* factor`` (a postscale factor, ``scale``'s numerics), then
    ``/ divisor`` (the number of ranks) as a correctly rounded division in the buffer's type,
    which is how the frameworks divide an average (upstream divides the sum in framework code:
    a multiplication by a rounded 1/n is off by one bit for some values)."""

    factor: float
    divisor: int


Post = float | Finish  # what a reduction's result is scaled by at the end


def average_post(postscale: float, n: int) -> Post:
    """The end of an Average over ``n`` ranks with ``postscale``. For a power of two, one
    multiplication by ``postscale / n`` gives the same bits at no extra cost: dividing by
    2**k is exact and commutes with rounding (and, for integers, with truncation)."""
    if n & (n - 1) == 0:
        return postscale / n
    return Finish(postscale, n)


def scale(buf: np.ndarray, factor: Post, wide: bool | None = None) -> None:
    """In-place ``buf *= factor`` with upstream's numerics: float math in the buffer's type
    (float16 via float32), integers in float64 truncated toward zero. A ``Finish`` scales by
    its factor, then divides by its divisor (floats correctly rounded, integers truncated
    toward zero). ``wide``: float32 ``buf`` (C-contiguous) holds subnormal values, so it is
    scaled through float64 (the same bits, without x86's assists: ``subnormals``); None: look,
    if large."""
    if factor == 1.0 or buf.size == 0:
        return
    if wide is None:
        wide = buf.size >= subnormals.MIN_ELEMENTS and subnormals.likely(buf)
    if isinstance(factor, Finish):
        scale(buf, factor.factor, wide)
        _divide(buf, factor.divisor, wide)
        return
    kind = buf.dtype.kind
    if wide and buf.dtype is subnormals.FLOAT32 and buf.flags.c_contiguous:
        subnormals.multiply(buf.reshape(-1), factor)
    elif kind == "f" and buf.dtype.itemsize >= 4:
        np.multiply(buf, buf.dtype.type(factor), out=buf)
    elif kind in "iu":
        np.copyto(buf, np.trunc(buf.astype(np.float64) * factor), casting="unsafe")
    else:  # float16, bfloat16
        np.copyto(buf, buf.astype(np.float32) * np.float32(factor), casting="unsafe")


def _divide(buf: np.ndarray, n: int, wide: bool) -> None:
    if n == 1 or buf.size == 0:
        return
    kind = buf.dtype.kind
    if wide and buf.dtype is subnormals.FLOAT32 and buf.flags.c_contiguous:
        subnormals.divide(buf.reshape(-1), n)
    elif kind == "f" and buf.dtype.itemsize >= 4:
        np.divide(buf, buf.dtype.type(n), out=buf)
    elif kind in "iu":  # exact: the quotient truncated toward zero
        q = np.abs(buf) // n
        np.copyto(buf, np.where(buf < 0, -q, q), casting="unsafe")
    else:  # float16, bfloat16: in float32 (exact enough that the rounding back is correct)
        np.copyto(buf, buf.astype(np.float32) / np.float32(n), casting="unsafe")


def _scaled(op: Reducer, factor: Post, buf: np.ndarray, mine: np.ndarray) -> Reducer:
    """``op`` followed by ``scale(out, factor)`` on what it wrote. The transports apply a
    reducer chunk by chunk as data arrives, so a ring's last reduce step scales each chunk
    while it is in cache, instead of a pass over the whole buffer afterwards (an average of
    64 MiB took 1.5x a sum that way). The same bits: one multiply per element either way.
    Whether the chunks go through float64 is decided once for the whole of ``buf`` (whose
    subnormals are looked for in ``mine``, this rank's part of it: ``subnormals.likely``)."""
    if factor == 1.0:
        return op
    wide = subnormals.likely(buf, mine)

    def reduce_then_scale(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        op(a, b, out=out)
        scale(out, factor, wide)
        return out

    return reduce_then_scale


def split_even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` contiguous counts, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _offsets(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class Hosts:
    """How the ranks of a transport view sit on hosts: ``local`` are the view ranks on this
    rank's host (in rank order, the first is the host's leader), ``leaders`` the first rank of
    every host (hosts in order of their first rank)."""

    def __init__(self, hosts: Sequence[str], me: int) -> None:
        first: dict[str, int] = {}
        for r, h in enumerate(hosts):
            first.setdefault(h, r)
        self.hosts = list(hosts)
        self.local = [r for r, h in enumerate(hosts) if h == hosts[me]]
        self.leaders = list(first.values())
        self.members = {h: [r for r, x in enumerate(hosts) if x == h] for h in first}
        self.even = len({len(r) for r in self.members.values()}) == 1  # as many ranks a host
        self.local_view: SubTransport | None = None  # set by _hosts()
        self.leaders_view: SubTransport | None = None  # only on a leader

    @property
    def useful(self) -> bool:
        """A two-level algorithm helps only with several hosts and several ranks on one."""
        return 1 < len(self.leaders) < len(self.hosts)


def _hosts(t) -> Hosts | None:
    """The view's host layout with its local and leaders' sub-views, built once per view."""
    cached = t.__dict__.get("_host_layout", False)
    if cached is not False:
        return cached
    names = getattr(t, "hosts", None)
    h = Hosts(names, t.rank) if names else None
    if h is not None and h.useful:
        h.local_view = SubTransport(t, h.local)
        h.leaders_view = SubTransport(t, h.leaders) if t.rank == h.local[0] else None
    else:
        h = None
    t.__dict__["_host_layout"] = h
    return h


host_layout = _hosts  # (the device plane's hierarchical allreduce groups ranks the same way)


def native(t):
    """The plane's own collectives for view ``t`` (MPI), or None: the algorithms here then
    run over its point-to-point. Each native method returns False where the plane lacks the
    operation for the buffer (its type, its reduction), and the algorithm runs instead."""
    return getattr(t, "native", None)


def allreduce(
    t,
    buf: np.ndarray,
    op: Reducer,
    scratch: Scratch,
    post: Post = 1.0,
    src: np.ndarray | None = None,
) -> None:
    """In-place reduction of ``buf`` (flat) across all ranks of ``t``, the result scaled by
    ``post`` (``scale``; the ring scales each segment once, as its owner reduces it). With
    ``src`` (flat, ``buf``'s size), this rank's data is there and ``buf`` only receives the
    result: the hierarchical pipeline copies it piece by piece while the link between hosts
    is busy (a host's other ranks send straight from it), every other algorithm first."""
    n = t.size
    if HIERARCHICAL_ALLREDUCE and n > 1 and src is not None and native(t) is None:
        hosts = _hosts(t)
        if hosts is not None and _pipelined(buf, hosts):
            hierarchical_allreduce(t, buf, op, scratch, hosts, post, src)
            return
    if src is not None:
        np.copyto(buf, src)
    if n == 1 or buf.size == 0:
        scale(buf, post)
        return
    nat = native(t)
    if nat is not None and nat.allreduce(buf, op, HIERARCHICAL_ALLREDUCE, t.hosts):
        scale(buf, post)
        return
    if HIERARCHICAL_ALLREDUCE:
        hosts = _hosts(t)
        if hosts is not None:
            hierarchical_allreduce(t, buf, op, scratch, hosts, post)
            return
    if buf.nbytes <= SMALL_BYTES or buf.size < n:
        if n > 2 and n & (n - 1) == 0:
            _allreduce_recursive_doubling(t, buf, op, scratch)
        else:
            _allreduce_direct(t, buf, op, scratch)
        scale(buf, post)
    elif n > 2 and buf.nbytes <= ORDERED_BYTES:
        _allreduce_ordered(t, buf, op, scratch, post)
    else:
        counts = split_even(buf.size, n)
        _reduce_scatter_ring(t, buf, counts, op, scratch, post)
        _allgather_ring(t, buf, counts)


def _allreduce_direct(t, buf: np.ndarray, op: Reducer, scratch: Scratch) -> None:
    n, me = t.size, t.rank
    if n == 2:  # both compute op(rank 0's data, rank 1's data): the same bits
        other = scratch.get(buf.nbytes, buf.dtype)
        t.exchange([(1 - me, as_bytes(buf))], [(1 - me, as_bytes(other))])
        if me == 0:
            op(buf, other, out=buf)
        else:
            op(other, buf, out=buf)
        return
    others = scratch.get(buf.nbytes * (n - 1), buf.dtype).reshape(n - 1, buf.size)
    peers = [p for p in range(n) if p != me]
    mine = as_bytes(buf)
    t.exchange([(p, mine) for p in peers], [(p, as_bytes(others[i])) for i, p in enumerate(peers)])
    parts = [others[i] for i in range(me)] + [buf] + [others[i] for i in range(me, n - 1)]
    if me == 0:
        acc = buf
        for part in parts[1:]:
            op(acc, part, out=acc)
    else:
        # Fold in rank order into others[0] (rank 0's data), then copy: identical to rank 0.
        acc = parts[0]
        for part in parts[1:]:
            op(acc, part, out=acc)
        np.copyto(buf, acc)


def _allreduce_ordered(t, buf: np.ndarray, op: Reducer, scratch: Scratch, post: Post) -> None:
    """Over more than 2 ranks: segment r of every rank's data goes straight to rank r, which
    folds the segments in rank order and scales the result, then every rank sends its segment
    to every other. Each rank moves what the ring moves (2(n-1)/n of the buffer) in two steps
    instead of 2(n-1), and every element is the fold of the ranks' data in rank order: the
    bits of ``_allreduce_direct`` and of a peer round's data round (numerics.fold), so a
    cached op gives the same result whichever way it runs."""
    n, me = t.size, t.rank
    counts = split_even(buf.size, n)
    offs = _offsets(counts)
    seg = [buf[offs[r] : offs[r] + counts[r]] for r in range(n)]
    mine = seg[me]
    peers = [p for p in range(n) if p != me]
    theirs = scratch.get(mine.nbytes * (n - 1), buf.dtype).reshape(n - 1, mine.size)
    t.exchange(
        [(p, as_bytes(seg[p])) for p in peers],
        [(p, as_bytes(theirs[i])) for i, p in enumerate(peers)],
    )
    parts = [theirs[i] for i in range(me)] + [mine] + [theirs[i] for i in range(me, n - 1)]
    _fold_into(parts, mine, me, op)
    scale(mine, post)
    t.exchange([(p, as_bytes(mine)) for p in peers], [(p, as_bytes(seg[p])) for p in peers])


def _allreduce_recursive_doubling(t, buf: np.ndarray, op: Reducer, scratch: Scratch) -> None:
    """log2(n) rounds for a power-of-two n: exchange with rank ``me ^ mask`` and combine.
    Both partners compute ``op(lower rank's data, higher rank's data)``, so they stay equal."""
    n, me = t.size, t.rank
    tmp = scratch.get(buf.nbytes, buf.dtype)
    mask = 1
    while mask < n:
        partner = me ^ mask
        t.exchange([(partner, as_bytes(buf))], [(partner, as_bytes(tmp))])
        if me < partner:
            op(buf, tmp, out=buf)
        else:
            op(tmp, buf, out=buf)
        mask <<= 1


def _reduce_scatter_ring(
    t, buf: np.ndarray, counts: Sequence[int], op: Reducer, scratch: Scratch, post: Post = 1.0
) -> None:
    """After this, segment ``r`` of ``buf`` on rank ``r`` holds the reduction of segment r,
    scaled by ``post`` (in the last step, which reduces this rank's own segment)."""
    n, me = t.size, t.rank
    offs = _offsets(counts)
    right, left = (me + 1) % n, (me - 1) % n
    last = _scaled(op, post, buf, buf[offs[me] : offs[me] + counts[me]])
    for s in range(n - 1):
        si = (me - s - 1) % n
        ri = (me - s - 2) % n
        seg_out = buf[offs[si] : offs[si] + counts[si]]
        seg_in = buf[offs[ri] : offs[ri] + counts[ri]]
        step_op = last if s == n - 2 else op
        t.exchange_reduce([(right, as_bytes(seg_out))], [], [(left, seg_in, step_op)])


def _allgather_ring(t, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Segment r of ``buf`` is valid on rank r; afterwards every segment is valid everywhere."""
    n, me = t.size, t.rank
    offs = _offsets(counts)
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        si = (me - s) % n
        ri = (me - s - 1) % n
        t.exchange(
            [(right, as_bytes(buf[offs[si] : offs[si] + counts[si]]))],
            [(left, as_bytes(buf[offs[ri] : offs[ri] + counts[ri]]))],
        )


def reduce_scatter(
    t, buf: np.ndarray, counts: Sequence[int], op: Reducer, scratch: Scratch, post: Post = 1.0
) -> np.ndarray:
    """Reduce ``buf`` (flat, segments of ``counts`` elements in rank order) and return this
    rank's reduced segment (a view into ``buf``), scaled by ``post``."""
    n, me = t.size, t.rank
    offs = _offsets(counts)
    mine = buf[offs[me] : offs[me] + counts[me]]
    if n == 1:
        scale(mine, post)
        return mine
    nat = native(t)
    if nat is not None:
        out = scratch.get(counts[me] * buf.itemsize, buf.dtype)
        if nat.reduce_scatter(buf, counts, op, out):
            np.copyto(mine, out)
            scale(mine, post)
            return mine
    if buf.nbytes <= SMALL_BYTES * n:
        peers = [p for p in range(n) if p != me]
        got = scratch.get(counts[me] * buf.itemsize * (n - 1), buf.dtype).reshape(n - 1, counts[me])
        t.exchange(
            [(p, as_bytes(buf[offs[p] : offs[p] + counts[p]])) for p in peers],
            [(p, as_bytes(got[i])) for i, p in enumerate(peers)],
        )
        parts = [got[i] for i in range(me)] + [mine] + [got[i] for i in range(me, n - 1)]
        acc = parts[0]
        for part in parts[1:]:
            op(acc, part, out=acc)
        if acc is not mine:
            np.copyto(mine, acc)
        scale(mine, post)
        return mine
    _reduce_scatter_ring(t, buf, counts, op, scratch, post)
    return mine


def reduce(t, buf: np.ndarray, op: Reducer, scratch: Scratch, root: int) -> None:
    """``buf`` on view rank ``root`` ends as the reduction over all ranks (others' ``buf`` is
    clobbered). Small: everyone sends to the root, which folds in rank order. Large: ring
    reduce-scatter, then the root gathers the reduced segments."""
    n, me = t.size, t.rank
    if n == 1 or buf.size == 0:
        return
    if buf.nbytes <= SMALL_BYTES or buf.size < n:
        if me != root:
            t.exchange([(root, as_bytes(buf))], [])
            return
        others = scratch.get(buf.nbytes * (n - 1), buf.dtype).reshape(n - 1, buf.size)
        peers = [p for p in range(n) if p != me]
        t.exchange([], [(p, as_bytes(others[i])) for i, p in enumerate(peers)])
        parts = [others[i] for i in range(me)] + [buf] + [others[i] for i in range(me, n - 1)]
        acc = parts[0]
        for part in parts[1:]:
            op(acc, part, out=acc)
        if acc is not buf:
            np.copyto(buf, acc)
        return
    counts = split_even(buf.size, n)
    offs = _offsets(counts)
    _reduce_scatter_ring(t, buf, counts, op, scratch)
    seg = [as_bytes(buf[offs[r] : offs[r] + counts[r]]) for r in range(n)]
    if me == root:
        t.exchange([], [(p, seg[p]) for p in range(n) if p != me])
    else:
        t.exchange([(root, seg[me])], [])


def _pipelined(buf: np.ndarray, hosts: Hosts) -> int:
    """The pieces ``hierarchical_allreduce`` pipelines ``buf`` in (0: none, the three steps
    one after the other): a buffer of at least ``HIERARCHICAL_PIECE_BYTES`` in pieces of
    about that size, at least two and at most ``HIERARCHICAL_PIECES``, where every host has
    as many ranks and each piece an element for every rank."""
    if buf.nbytes < HIERARCHICAL_PIECE_BYTES or not hosts.even:
        return 0
    pieces = min(HIERARCHICAL_PIECES, max(2, buf.nbytes // HIERARCHICAL_PIECE_BYTES))
    return pieces if pieces >= 2 and buf.size >= pieces * len(hosts.hosts) else 0


def hierarchical_allreduce(
    t,
    buf: np.ndarray,
    op: Reducer,
    scratch: Scratch,
    hosts: Hosts,
    post: Post = 1.0,
    src: np.ndarray | None = None,
) -> None:
    """Reduce within each host to its leader (shared memory), allreduce among the leaders
    (across hosts, scaled by ``post`` there), broadcast within each host. Every rank ends
    with the leaders' result. A buffer of at least ``HIERARCHICAL_PIECE_BYTES`` on hosts of
    as many ranks each instead runs the same three levels as a pipeline over its pieces, in
    which every rank of a host owns a segment (``_pipelined``, ``_hierarchical_pipeline``);
    it takes this rank's data from ``src`` where given (``allreduce``)."""
    pieces = _pipelined(buf, hosts)
    if pieces:
        _hierarchical_pipeline(t, buf, op, scratch, hosts, post, pieces, src)
        return
    if src is not None:
        np.copyto(buf, src)
    local = hosts.local_view or SubTransport(t, hosts.local)
    reduce(local, buf, op, scratch, root=0)
    if t.rank == hosts.local[0]:
        allreduce(hosts.leaders_view or SubTransport(t, hosts.leaders), buf, op, scratch, post)
    broadcast(local, buf, 0)


def _hierarchical_pipeline(
    t,
    buf: np.ndarray,
    op: Reducer,
    scratch: Scratch,
    hosts: Hosts,
    post: Post,
    pieces: int,
    src: np.ndarray | None = None,
) -> None:
    """``hierarchical_allreduce`` over ``pieces`` pieces of ``buf``, four stages deep, on hosts
    of m ranks each. Each piece splits into m segments, segment i owned by each host's i-th
    rank; step s, one exchange, (a) reduce-scatters piece s within each host (the owner folds
    its host's parts of its segment in rank order), (b) reduce-scatters piece s-1 among the
    owners of the same segment on every host (each folds its share of it in host order and
    scales it by ``post``), (c) allgathers piece s-2 among them and (d) allgathers piece s-3
    within the host. The link between hosts then carries pieces while shared memory moves the
    others, where the three steps one after the other left it idle during the steps within
    the hosts (10-15% of a link-bound 16 MiB allreduce, docs/benchmarks.md); and every rank
    of a host, not only its first, moves and folds its share (m connections across, each
    with the ring's share: 2(L-1)/L of its segment for L hosts). Every element is folded once,
    by one rank, in rank order within the host then host order, so every rank ends with the
    same bits. With ``src`` (this rank's data; ``buf`` only receives), each rank copies only
    its own segment into ``buf`` and sends the others straight from ``src``."""
    me = t.rank
    local = hosts.local
    li = local.index(me)  # this rank's place on its host: the segment it owns
    groups = [hosts.members[hosts.hosts[lead]] for lead in hosts.leaders]  # hosts in order
    hi = hosts.leaders.index(local[0])
    column = [g[li] for g in groups]  # the owners of the same segment, one per host
    m, nh = len(local), len(groups)
    counts = split_even(buf.size, pieces)
    offs = _offsets(counts)
    piece = [buf[offs[k] : offs[k] + counts[k]] for k in range(pieces)]
    data = piece if src is None else [src[offs[k] : offs[k] + counts[k]] for k in range(pieces)]
    seg, dseg, sub = [], [], []  # by piece: its segments in buf and in data; mine's shares
    for k in range(pieces):
        c = _offsets(split_even(counts[k], m)) + [counts[k]]
        seg.append([piece[k][c[j] : c[j + 1]] for j in range(m)])
        dseg.append([data[k][c[j] : c[j + 1]] for j in range(m)])
        h = _offsets(split_even(c[li + 1] - c[li], nh)) + [c[li + 1] - c[li]]
        sub.append([seg[k][li][h[j] : h[j + 1]] for j in range(nh)])
    seg_big = max(len(sg[li]) for sg in seg)
    sub_big = max(len(sb[hi]) for sb in sub)
    raw = scratch.get(((m - 1) * seg_big + (nh - 1) * sub_big) * buf.itemsize, buf.dtype)
    at = (m - 1) * seg_big
    got = [raw[i * seg_big : (i + 1) * seg_big] for i in range(m - 1)]
    parts = [raw[at + i * sub_big : at + (i + 1) * sub_big] for i in range(nh - 1)]
    peers = [j for j in range(m) if j != li]  # local places
    across = [j for j in range(nh) if j != hi]  # hosts
    for s in range(pieces + 3):
        sends: list[Message] = []
        recvs: list[Message] = []
        a, x1, x2, b = s, s - 1, s - 2, s - 3
        if a < pieces:  # (a) the host's parts of this rank's segment of piece s
            mine = seg[a][li]
            if src is not None:
                np.copyto(mine, dseg[a][li])
            sends += [(local[j], as_bytes(dseg[a][j])) for j in peers]
            recvs += [(local[j], as_bytes(got[i][: len(mine)])) for i, j in enumerate(peers)]
        if 0 <= x1 < pieces:  # (b) the hosts' sums of this rank's share of piece s-1
            n_own = len(sub[x1][hi])
            sends += [(column[j], as_bytes(sub[x1][j])) for j in across]
            recvs += [(column[j], as_bytes(parts[i][:n_own])) for i, j in enumerate(across)]
        if 0 <= x2 < pieces:  # (c) the other shares of this rank's segment of piece s-2
            sends += [(column[j], as_bytes(sub[x2][hi])) for j in across]
            recvs += [(column[j], as_bytes(sub[x2][j])) for j in across]
        if 0 <= b < pieces:  # (d) the host's other segments of piece s-3
            sends += [(local[j], as_bytes(seg[b][li])) for j in peers]
            recvs += [(local[j], as_bytes(seg[b][j])) for j in peers]
        t.exchange(sends, recvs)
        if a < pieces:
            mine = seg[a][li]
            ordered = [got[i][: len(mine)] for i in range(li)] + [mine]
            ordered += [got[i][: len(mine)] for i in range(li, m - 1)]
            _fold_into(ordered, mine, li, op)
        if 0 <= x1 < pieces:
            share = sub[x1][hi]
            ordered = [parts[i][: len(share)] for i in range(hi)] + [share]
            ordered += [parts[i][: len(share)] for i in range(hi, nh - 1)]
            _fold_into(ordered, share, hi, op)
            scale(share, post)


def _fold_into(parts: Sequence[np.ndarray], mine: np.ndarray, me: int, op: Reducer) -> None:
    """``mine`` (``parts[me]``) becomes the fold of ``parts`` in order: into ``mine`` as soon
    as it is one of the parts folded (element by element, reading it while writing it is
    safe); the parts before it fold into ``parts[0]``, which is clobbered."""
    if me < 2:
        op(parts[0], parts[1], out=mine)
    else:
        acc = parts[0]
        for part in parts[1:me]:
            op(acc, part, out=acc)
        op(acc, mine, out=mine)
    for part in parts[max(2, me + 1) :]:
        op(mine, part, out=mine)


def hierarchical_allgatherv(t, out: np.ndarray, nbytes: Sequence[int], hosts: Hosts) -> None:
    """Each host's leader collects its host's blocks, the leaders swap whole hosts' blocks, and
    each leader broadcasts the full result within its host."""
    me = t.rank
    offs = _offsets(nbytes)
    blocks = [as_bytes(out[offs[r] : offs[r] + nbytes[r]]) for r in range(t.size)]
    leader = hosts.local[0]
    if me != leader:
        t.exchange([(leader, blocks[me])], [])
    else:
        t.exchange([], [(r, blocks[r]) for r in hosts.local[1:]])
        mine = hosts.hosts[me]
        others = [lead for lead in hosts.leaders if lead != me]
        t.exchange(
            [(lead, blocks[r]) for lead in others for r in hosts.members[mine]],
            [(lead, blocks[r]) for lead in others for r in hosts.members[hosts.hosts[lead]]],
        )
    broadcast(hosts.local_view or SubTransport(t, hosts.local), out, 0)


def allgatherv(t, out: np.ndarray, nbytes: Sequence[int], src: np.ndarray | None = None) -> None:
    """``out`` (flat uint8) holds block r (``nbytes[r]`` bytes, rank order) on rank r; afterwards
    every block is present on every rank. With ``src`` (this rank's block, elsewhere), the
    block is sent from ``src`` and copied into ``out`` during the first step."""
    n, me = t.size, t.rank
    offs = _offsets(nbytes)
    blocks = [out[offs[r] : offs[r] + nbytes[r]] for r in range(n)]
    copies = [] if src is None else [(as_bytes(blocks[me]), as_bytes(src))]
    nat = native(t) if n > 1 else None
    if nat is not None and nat.allgatherv(out, nbytes, HIERARCHICAL_ALLGATHER, t.hosts, copies):
        return
    hosts = _hosts(t) if HIERARCHICAL_ALLGATHER and n > 1 else None
    if n == 1 or hosts is not None:
        for dst, mine in copies:
            dst[:] = mine
        if hosts is not None:
            hierarchical_allgatherv(t, out, nbytes, hosts)
        return
    own = as_bytes(blocks[me]) if src is None else as_bytes(src)
    if sum(nbytes) <= SMALL_BYTES * 2 or n == 2:
        peers = [p for p in range(n) if p != me]
        t.exchange_copy(
            [(p, own) for p in peers], [(p, as_bytes(blocks[p])) for p in peers], copies
        )
    else:
        right, left = (me + 1) % n, (me - 1) % n
        for s in range(n - 1):
            t.exchange_copy(
                [(right, own if s == 0 else as_bytes(blocks[(me - s) % n]))],
                [(left, as_bytes(blocks[(me - s - 1) % n]))],
                copies if s == 0 else (),
            )


def broadcast(t, buf: np.ndarray, root: int) -> None:
    """From set rank ``root``: a binomial tree (log2 n steps) for small ``buf`` or two ranks;
    for large, a star where every rank reads every other's memory (each receiver copies the
    root's buffer once, all at once), else a pipelined chain (every link busy at once, each
    byte crosses n-1 links)."""
    n, me = t.size, t.rank
    if n == 1 or buf.nbytes == 0:
        return
    nat = native(t)
    if nat is not None and nat.broadcast(buf, root):
        return
    if n > 2 and buf.nbytes > max(SMALL_BYTES, PIPELINE_BYTES):
        if t.direct_reads(buf.nbytes):
            _broadcast_star(t, as_bytes(buf), root)
        else:
            _broadcast_chain(t, buf, root)
        return
    view = as_bytes(buf)
    if n == 2:
        t.exchange_pair(1 - me, view, me == root)
        return
    vr = (me - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            t.exchange_oneway([], [(((vr - mask) + root) % n, view)])
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < n:
            sends.append((((vr + mask) + root) % n, view))
        mask >>= 1
    if sends:
        t.exchange_oneway(sends, [])


def _broadcast_star(t, view: memoryview, root: int) -> None:
    """Every other rank reads the whole buffer straight from the root's memory at once (where
    the transport moves such messages by single copy): each byte is copied once per receiver,
    in parallel, where the chain copies it twice per link (in and out of the slots), one link
    after the other."""
    if t.rank == root:
        t.exchange([(p, view) for p in range(t.size) if p != root], [])
    else:
        t.exchange([], [(root, view)])


def _broadcast_chain(t, buf: np.ndarray, root: int) -> None:
    n, me = t.size, t.rank
    vr = (me - root) % n
    prev, nxt = (me - 1) % n, (me + 1) % n
    view = as_bytes(buf)
    blocks = [view[i : i + PIPELINE_BYTES] for i in range(0, view.nbytes, PIPELINE_BYTES)]
    if vr == 0:
        t.exchange([(nxt, b) for b in blocks], [])
    elif vr == n - 1:
        t.exchange([], [(prev, b) for b in blocks])
    else:  # receive block k while forwarding block k - 1
        for k in range(len(blocks) + 1):
            t.exchange(
                [(nxt, blocks[k - 1])] if k >= 1 else [],
                [(prev, blocks[k])] if k < len(blocks) else [],
            )


def alltoallv_flat(
    t, src: np.ndarray, send_nbytes: Sequence[int], dst: np.ndarray, recv_nbytes: Sequence[int]
) -> None:
    """``src`` (bytes) holds the blocks for ranks 0..n-1 in order, ``send_nbytes[p]`` bytes
    for rank p; ``dst`` receives rank p's block for this rank at its place in rank order."""
    nat = native(t) if t.size > 1 else None
    if nat is not None and nat.alltoallv(src, send_nbytes, dst, recv_nbytes):
        return
    so, ro = _offsets(send_nbytes), _offsets(recv_nbytes)
    alltoallv(
        t,
        [as_bytes(src[so[p] : so[p] + send_nbytes[p]]) for p in range(t.size)],
        [as_bytes(dst[ro[p] : ro[p] + recv_nbytes[p]]) for p in range(t.size)],
    )


def alltoallv(t, sends: Sequence[memoryview], recvs: Sequence[memoryview]) -> None:
    """Block ``sends[p]`` goes to rank p, ``recvs[p]`` receives from rank p (own block copied)."""
    me = t.rank
    recvs[me][:] = sends[me]
    peers = [p for p in range(t.size) if p != me]
    t.exchange([(p, sends[p]) for p in peers], [(p, recvs[p]) for p in peers])


def barrier(t) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of one-byte messages."""
    n, me = t.size, t.rank
    nat = native(t) if n > 1 else None
    if nat is not None and nat.barrier():
        return
    token = memoryview(bytearray(1))
    got = memoryview(bytearray(1))
    k = 1
    while k < n:
        t.exchange([((me + k) % n, token)], [((me - k) % n, got)])
        k <<= 1


def exchange_counts(t, counts: Sequence[int]) -> list[int]:
    """Alltoall of one int64 per peer: returns what every rank sent to this one."""
    n = t.size
    send = np.asarray(counts, dtype=np.int64)
    recv = np.empty(n, np.int64)
    alltoallv_flat(t, send.view(np.uint8), [8] * n, recv.view(np.uint8), [8] * n)
    return recv.tolist()
